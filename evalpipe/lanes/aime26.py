"""Lane `aime26`: AIME 2026, one greedy response per problem, served one at a time.

Data: the 30 problems vendored in sgl-eval 0.1.0 (`_vendored/nemo_skills/dataset/aime26/test.txt`,
NeMo-Skills@645cf567; sha256 pinned in pins/aime26.json); id = the row's `id` (aime26-0..29).
Prompt: the vendored `matharena-aime` YAML rendered with `str.format` as the single user message.
It is NeMo-Skills' copy of MathArena's **AIME-2024 wording** ("Please reason step by step, and put your final
answer within \\boxed{}." + range sentence), not MathArena's 2025/2026 wording; no system message.
Request: /v1/chat/completions, chat_template_kwargs {"thinking": true}, reasoning_effort "max",
temperature 0, top_p 0.95, seed 0, max_tokens 65536, min_p 0, repetition_penalty 1 (as sgl-eval sends).
Grading: last \\boxed{} of message.content -> NS math_equal (math-verify) in a process pool with a hard timeout.
Truncations and errors count wrong and stay in the denominator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from evalpipe.digest import file_sha256
from evalpipe.lanes import Item, Lane, LaneData, load_pins, prompt_sha256
from evalpipe.lanes.data import check_pin, read_jsonl
from evalpipe.lanes.sgl_eval_adapter import aime26_dataset, prompt_template, render_prompt

PROMPT_NAME = "matharena-aime"
PROMPT_NOTE = (
    "NS-vendored MathArena AIME-2024 wording (sgl-eval 0.1.0 matharena-aime.yaml), not MathArena's 2026 prompt"
)


def build_messages(template_path: Path, problem: str) -> list[dict]:
    return [{"role": "user", "content": render_prompt(template_path, problem=problem)}]


class AIME26Lane(Lane):
    def load(self, data_dir: Optional[Path], allow_data_drift: bool) -> LaneData:
        path = aime26_dataset()
        sha = file_sha256(path)
        pins = load_pins(self.name)
        drift = check_pin(path, sha, pins["dataset_sha256"], allow_data_drift)
        template = prompt_template(PROMPT_NAME)
        template_sha = file_sha256(template)
        if template_sha != pins["template_sha256"] and not allow_data_drift:
            from evalpipe.lanes.data import DataError

            raise DataError(
                f"prompt template {template} has sha256 {template_sha}, pin is {pins['template_sha256']} "
                "(a different sgl-eval?). Pass --allow-data-drift to run anyway."
            )
        items = []
        for row in read_jsonl(path):
            messages = build_messages(template, row["problem"])
            items.append(Item(row["id"], messages, str(row["expected_answer"]), prompt_sha256(messages)))
        return LaneData(
            items=items,
            dataset_path=str(path),
            dataset_sha256=sha,
            data_drift=drift or template_sha != pins["template_sha256"],
            template_id=PROMPT_NAME,
            template_sha256=template_sha,
            extra={"prompt_wording": PROMPT_NOTE, "template_path": str(template)},
        )


COMMON_PARAMS = {
    "top_p": 0.95,
    "max_tokens": 65536,
    "reasoning_effort": "max",
    "chat_template_kwargs": {"thinking": True},
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

LANE = AIME26Lane(
    name="aime26",
    description="AIME 2026 serial: 30 problems, greedy, one request at a time, MathArena-2024 prompt (chat).",
    api="chat",
    params={"temperature": 0.0, "seed": 0, **COMMON_PARAMS},
    concurrency=1,
    repeats=1,
    grader="ns_last_boxed",
    headline="accuracy = correct / 30 planned (errors, truncations, no answer count as wrong)",
    notes=PROMPT_NOTE,
)
