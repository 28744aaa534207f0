"""Lane `copy`: 300 held-out random strings of evalpipe.skills.copy_text (72-160 characters, longer than the
sliding window), 100 per length group. Greedy, max_tokens 192; exact match of the reply (stripped)."""

from evalpipe.lanes.skill_lane import skill_lane
from evalpipe.skills import copy_text

RANGES = [("short", 72, 96), ("medium", 97, 128), ("long", 129, 160)]

LANE = skill_lane(
    name="copy",
    description="Synthetic exact copy of random strings longer than the sliding window.",
    grader="exact_text",
    max_tokens=192,
    seed="lane|copy|v1",
    groups=[
        (label, 100, lambda rng, lo=lo, hi=hi: copy_text.generate(rng, length=rng.randint(lo, hi)))
        for label, lo, hi in RANGES
    ],
    headline="accuracy = exact copies / 300 planned (by group: string length)",
    notes="held-out split of evalpipe.skills (identity hash); exact match after stripping whitespace",
)
