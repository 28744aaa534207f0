"""Lane `chat-arith-boxed`: 300 held-out arith word problems of evalpipe.skills.boxed, 100 each of 2, 3 and 4
operations (interleaved), asked in sgl-eval's own math prompt as the single user message, thinking off.

/v1/chat/completions, greedy (temperature 0, seed 0), max_tokens 512 (the longest worked answer with its boxed line
is under 500 bytes), chat_template_kwargs {"thinking": false}. Graded like the AIME lanes: the last `\\boxed{}` of
message.content through sgl-eval's vendored NeMo-Skills `math_equal`; truncations and replies without a box count
wrong.

`datasets/arith-as-boxed.jsonl` holds the same problems in sgl-eval's dataset form (`sgl_eval_rows`; a test keeps
the file equal to it), so `sgl-eval run gsm8k --from-dataset datasets/arith-as-boxed.jsonl --prompt math ...` sends
the same messages and grades with the same grader (`sgl_eval_command`; docs/lanes.md shows it).
"""

import sys
from pathlib import Path

from evalpipe.lanes.skill_lane import chat_skill_lane, lane_examples
from evalpipe.skills import boxed

GROUPS = [(f"{n}ops", 100, lambda rng, n=n: boxed.generate(rng, n_ops=n)) for n in (2, 3, 4)]
SGL_EVAL = str(Path(sys.executable).parent / "sgl-eval")  # the sgl-eval installed beside this interpreter
PARAMS = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": 512, "chat_template_kwargs": {"thinking": False}}

LANE = chat_skill_lane(
    name="chat-arith-boxed",
    description="Synthetic arithmetic in sgl-eval's math prompt (chat), worked steps and a final \\boxed{N}.",
    grader="ns_last_boxed",
    params=PARAMS,
    seed="lane|chat-arith-boxed|v1",
    repeats=1,
    groups=GROUPS,
    template=boxed.MATH_PROMPT,
    headline="accuracy = correct boxed answers / 300 planned (by group: number of operations)",
    notes="held-out split of evalpipe.skills (the arith identity hash); sgl-eval's math prompt and grader",
)


def sgl_eval_rows() -> list[dict]:
    """The lane's items as sgl-eval's `--from-dataset` rows ({id, problem, expected_answer}), in id order."""
    return [
        {"id": f"arith-boxed-{i}", "problem": ex.meta["problem"], "expected_answer": ex.meta["expected"]}
        for i, (_, ex) in enumerate(lane_examples(LANE))
    ]


def sgl_eval_command(dataset: Path, base_url: str, out_dir: Path, max_tokens: int | None = None) -> list[str]:
    """sgl-eval's command line (argv) that sends `dataset` (rows as `sgl_eval_rows`) with this lane's prompt,
    repeats and sampling parameters (`max_tokens`: the lane's unless given) to `base_url` and writes to `out_dir`."""
    return [
        SGL_EVAL,
        "run",
        "gsm8k",
        "--from-dataset",
        str(dataset),
        "--prompt",
        "math",
        "--n-repeats",
        str(LANE.repeats),
        "--temperature",
        f"{PARAMS['temperature']:g}",
        "--top-p",
        f"{PARAMS['top_p']:g}",
        "--seed",
        str(PARAMS["seed"]),
        "--max-tokens",
        str(PARAMS["max_tokens"] if max_tokens is None else max_tokens),
        "--thinking" if PARAMS["chat_template_kwargs"]["thinking"] else "--no-thinking",
        "--base-url",
        base_url,
        "--out-dir",
        str(out_dir),
    ]
