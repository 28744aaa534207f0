"""Lane `chat-arith-boxed-think`: the problems of `chat-arith-boxed` with thinking on.

The chat template opens `<think>`; the model works the steps inside it, closes it and answers `\\boxed{N}`. Same
items, endpoint, greedy sampling and grader as chat-arith-boxed (evalpipe/lanes/chat_arith_boxed.py), but
chat_template_kwargs {"thinking": true}: a reply cut off inside its thinking block is a truncation (finish_reason
"length"), counted wrong and reported as `n_truncated`.
"""

from evalpipe.lanes.chat_arith_boxed import PARAMS
from evalpipe.lanes.skill_lane import chat_skill_lane
from evalpipe.skills import boxed

THINK_GROUPS = [(f"{n}ops", 100, lambda rng, n=n: boxed.generate_thinking(rng, n_ops=n)) for n in (2, 3, 4)]

LANE = chat_skill_lane(
    name="chat-arith-boxed-think",
    description="chat-arith-boxed with thinking on: worked steps inside <think>...</think>, then \\boxed{N}.",
    grader="ns_last_boxed",
    params={**PARAMS, "chat_template_kwargs": {"thinking": True}},
    seed="lane|chat-arith-boxed|v1",
    repeats=1,
    groups=THINK_GROUPS,
    template="<think>" + boxed.MATH_PROMPT,
    headline="accuracy = correct boxed answers / 300 planned (truncations inside thinking count wrong)",
    notes="same problems as chat-arith-boxed (same seed), thinking on",
)
