"""Lane `retrieval`: 250 held-out needles of evalpipe.skills.retrieval, 50 at each of five depths.

Depth = tokens from the needle's value to the end of the prompt: inside the sliding window (the needle right before
the question), ~200, ~1000, ~2000, and the deepest (the needle first, the prompt near the model's 4096-token context).
Greedy, max_tokens 16; exact match of the reply (stripped) with the 5-digit code. Reported per depth.
"""

from evalpipe.lanes.skill_lane import skill_lane
from evalpipe.skills import retrieval

DEPTHS = [
    ("in-window", 0, None),
    ("d256", 150, None),
    ("d1024", 800, None),
    ("d2048", 1800, None),
    ("deepest", 3780, 0),
]

LANE = skill_lane(
    name="retrieval",
    description="Synthetic needle retrieval at five depths up to the default model's 4096-token context.",
    grader="exact_text",
    max_tokens=16,
    seed="lane|retrieval|v1",
    groups=[
        (label, 50, lambda rng, a=after, b=before: retrieval.generate(rng, after=a, before=b))
        for label, after, before in DEPTHS
    ],
    headline="accuracy = exact codes / 250 planned (by group: depth)",
    notes="held-out split of evalpipe.skills (identity hash); exact match after stripping whitespace",
)
