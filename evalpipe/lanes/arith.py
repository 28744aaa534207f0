"""Lane `arith`: 1200 held-out word problems of evalpipe.skills.arith, 400 each of 2, 3 and 4 operations
(interleaved: ids 0, 1, 2 have 2, 3, 4 operations).

Prompt `Question: {story}\nAnswer:` to /v1/completions (zero-shot: the default model was trained on this format),
greedy, max_tokens 512 (the longest worked answer is under 470 bytes). Graded like GSM8K legacy: the last integer
of the reply (the `#### N` line) against the exact result; truncated replies and replies without digits count wrong.
Reported overall and per operation count.
"""

from evalpipe.lanes.skill_lane import skill_lane
from evalpipe.skills import arith

LANE = skill_lane(
    name="arith",
    description="Synthetic GSM8K-format arithmetic (2-4 operations, operands up to 3 digits, beyond the window).",
    grader="legacy_last_int",
    max_tokens=512,
    seed="lane|arith|v1",
    groups=[(f"{n}ops", 400, lambda rng, n=n: arith.generate(rng, n_ops=n)) for n in (2, 3, 4)],
    headline="accuracy = exact final answers / 1200 planned (by group: number of operations)",
    notes="held-out split of evalpipe.skills (identity hash); legacy last-integer scorer",
)
