"""Lanes generated from `evalpipe.skills` (arith, retrieval, copy): the held-out items the default model never saw.

Items are drawn from a fixed seed, only from the held-out split of the skill's identity hash, a fixed number per
reporting group (number of operations, needle depth, string length); ids are 0..N-1 in that order. The whole item
list (id, group, prompt, expected answer) is pinned by its sha256 in `manifests/<lane>.json`, so a change to a
generator is a data drift the runner refuses unless `--allow-data-drift`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from evalpipe.lanes import Item, Lane, LaneData, canonical_json, load_pins, prompt_sha256, sha256_hex
from evalpipe.skills import completion_prompt, draw

TEMPLATE = completion_prompt("{body}")  # 'Question: {body}\nAnswer:' (the reply follows after one space)


@dataclass(frozen=True)
class SkillLane(Lane):
    seed: str = ""
    groups: tuple = ()  # (group label, items, generator(rng) -> Example), in id order

    def items(self) -> list[Item]:
        if self.name not in _CACHE:  # run, audit and compare may each load the lane
            _CACHE[self.name] = tuple(_generate(self))
        return list(_CACHE[self.name])

    def load(self, data_dir: Optional[Path], allow_data_drift: bool) -> LaneData:
        items = self.items()
        listing = canonical_json([[it.question_id, it.group, it.prompt, it.expected_answer] for it in items])
        sha = sha256_hex(listing)
        return LaneData(
            items=items,
            dataset_path=f"generated: evalpipe.skills, seed {self.seed!r}, held-out split",
            dataset_sha256=sha,
            data_drift=sha != load_pins(self.name)["dataset_sha256"],
            template_id=f"evalpipe-skills-{self.name}-zero-shot",
            template_sha256=sha256_hex(TEMPLATE),
            extra={"groups": {label: count for label, count, _ in self.groups}},
        )


_CACHE: dict[str, tuple[Item, ...]] = {}


def _generate(lane: SkillLane) -> list[Item]:
    rng = random.Random(lane.seed)
    out, seen = [], set()
    for label, count, generator in lane.groups:
        for _ in range(count):
            ex = draw(generator, rng, "heldout")
            while ex.identity in seen:
                ex = draw(generator, rng, "heldout")
            seen.add(ex.identity)
            out.append(Item(len(out), ex.prompt, ex.meta["expected"], prompt_sha256(ex.prompt), group=label))
    return out


def skill_lane(name: str, description: str, grader: str, max_tokens: int, seed: str,
               groups: list[tuple[str, int, Callable]], headline: str, notes: str = "") -> SkillLane:
    return SkillLane(
        name=name, description=description, api="completions",
        params={"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": max_tokens, "stop": ["Question:"]},
        concurrency=64, repeats=1, grader=grader, headline=headline, notes=notes, seed=seed, groups=tuple(groups),
    )
