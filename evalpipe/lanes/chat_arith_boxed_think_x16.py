"""Lane `chat-arith-boxed-think-x16`: 30 of the thinking lane's problems, 16 sampled responses each (480).

The aime26-x16 design on problems the default model can answer: temperature 1, no seed sent, thinking on, the same
prompt and grader as chat-arith-boxed-think; queued question-major. Headline: pass@1 over all 480 responses
(truncations and errors wrong and in the denominator); pass@16 and majority@16 are secondary.
"""

from evalpipe.lanes.chat_arith_boxed import PARAMS
from evalpipe.lanes.chat_arith_boxed_think import LANE as THINK
from evalpipe.lanes.skill_lane import chat_skill_lane

LANE = chat_skill_lane(
    name="chat-arith-boxed-think-x16",
    description="chat-arith-boxed-think x16: 30 problems x 16 sampled responses (T=1, unseeded), concurrency 64.",
    grader="ns_last_boxed",
    params={**PARAMS, "temperature": 1.0, "seed": None, "chat_template_kwargs": {"thinking": True}},
    seed="lane|chat-arith-boxed-x16|v1",
    repeats=16,
    groups=[(label, 10, gen) for label, _, gen in THINK.groups],
    template=THINK.template,
    headline="accuracy = pass@1 over all 480 planned responses; pass@16 / majority@16 are secondary",
    notes="held-out split of evalpipe.skills; thinking on; sampled like aime26-x16",
)
