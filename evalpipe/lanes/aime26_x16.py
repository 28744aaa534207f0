"""Lane `aime26-x16`: AIME 2026, 16 sampled responses per problem (480), concurrency 64.

Same data, prompt, endpoint and grader as `aime26` (see evalpipe/lanes/aime26.py); differs only in sampling:
temperature 1, **no seed sent** (one seed repeated to all 16 would make them identical where honoured).
Requests queue question-major (question 0's 16 repeats, then question 1's, ...).
Headline: correctness over all 480 responses (= pass@1 averaged over 16), truncations and errors wrong and in
the denominator. pass@16 and majority@16 are secondary figures, never the headline.
"""

from __future__ import annotations

from evalpipe.lanes.aime26 import COMMON_PARAMS, PROMPT_NOTE, AIME26Lane

LANE = AIME26Lane(
    name="aime26-x16",
    description="AIME 2026 x16: 30 problems x 16 sampled responses (T=1, unseeded), concurrency 64.",
    api="chat",
    params={"temperature": 1.0, "seed": None, **COMMON_PARAMS},
    concurrency=64,
    repeats=16,
    grader="ns_last_boxed",
    headline="accuracy = pass@1 over all 480 planned responses; pass@16 / majority@16 are secondary",
    notes=PROMPT_NOTE,
)
