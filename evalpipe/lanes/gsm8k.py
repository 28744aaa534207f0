"""Lane `gsm8k`: the legacy SGLang few-shot GSM8K protocol, with the demo-overlap bug fixed.

Data: openai/grade-school-math `test.jsonl` (1319 rows, sha256 pinned in pins/gsm8k.json).
Rows 0-4 are demonstrations only; rows 5..1318 are the 1314 scored questions; id = source row index.
Prompt (raw text, no chat template): for j in 0..4 "Question: " + q_j + "\\nAnswer: " + a_j + "\\n\\n"
(answer field verbatim, calculator annotations and "#### N" kept), then "Question: " + q_i + "\\nAnswer:".
Sent to /v1/completions; stops "Question", "Assistant:", "<|separator|>"; temperature 0, top_p 1, seed 0,
max_tokens 4096; concurrency 64.
Scorer (legacy, same for gold and prediction): remove commas, last run of digits, literal parse;
no digits -> INVALID (-9999999), never correct. Truncated (finish_reason "length") responses count wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from evalpipe.digest import file_sha256
from evalpipe.lanes import Item, Lane, LaneData, load_pins, prompt_sha256, sha256_hex
from evalpipe.lanes.data import check_pin, find_gsm8k_test, read_jsonl
from evalpipe.lanes.grading import legacy_answer_value

N_DEMOS = 5
TEMPLATE_ID = "legacy-sglang-gsm8k-5shot-rows0-4"


def demo_prefix(rows: list[dict]) -> str:
    return "".join("Question: " + r["question"] + "\nAnswer: " + r["answer"] + "\n\n" for r in rows[:N_DEMOS])


def build_prompt(prefix: str, row: dict) -> str:
    return prefix + "Question: " + row["question"] + "\nAnswer:"


class GSM8KLane(Lane):
    def load(self, data_dir: Optional[Path], allow_data_drift: bool) -> LaneData:
        path = find_gsm8k_test(data_dir)
        sha = file_sha256(path)
        drift = check_pin(path, sha, load_pins(self.name)["dataset_sha256"], allow_data_drift)
        rows = read_jsonl(path)
        prefix = demo_prefix(rows)
        items = []
        for i in range(N_DEMOS, len(rows)):
            prompt = build_prompt(prefix, rows[i])
            items.append(Item(i, prompt, legacy_answer_value(rows[i]["answer"]), prompt_sha256(prompt)))
        return LaneData(
            items=items,
            dataset_path=str(path),
            dataset_sha256=sha,
            data_drift=drift,
            template_id=TEMPLATE_ID,
            template_sha256=sha256_hex(prefix),  # the five-demo prefix (2212 chars on the pinned file)
            extra={"demo_row_ids": list(range(N_DEMOS)), "prefix_chars": len(prefix)},
        )


LANE = GSM8KLane(
    name="gsm8k",
    description="Legacy 5-shot GSM8K: 1314 scored questions (rows 5-1318), raw prompt to /v1/completions.",
    api="completions",
    params={
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "max_tokens": 4096,
        "stop": ["Question", "Assistant:", "<|separator|>"],
    },
    concurrency=64,
    repeats=1,
    grader="legacy_last_int",
    headline="accuracy = correct / 1314 planned (errors, truncations, INVALID count as wrong)",
    notes="demos = rows 0-4 only (never scored); INVALID = -9999999",
)
