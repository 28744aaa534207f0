"""Lanes generated from `evalpipe.skills` (arith, retrieval, copy, chat-arith-boxed...): the held-out items the
default model never saw.

Items are drawn from fixed seeds, only from the held-out split of the skill's identity hash, a fixed number per
reporting group (number of operations, needle depth, string length), groups interleaved; ids are 0..N-1. The whole item
list (id, group, prompt, expected answer) is pinned by its sha256 in `evalpipe/lanes/pins/<lane>.json`, so a change to a
generator is a data drift the runner refuses unless `--allow-data-drift`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from evalpipe.lanes import Item, Lane, LaneData, canonical_json, load_pins, prompt_sha256, sha256_hex
from evalpipe.skills import completion_prompt, draw
from evalpipe.skills.chat import ChatExample

TEMPLATE = completion_prompt("{body}")  # 'Question: {body}\nAnswer:' (the reply follows after one space)


def as_user_message(lane: str, ex, template: str) -> ChatExample:
    """A skill example as one user message, its body in `template` (the chat lanes' form for instruct models)."""
    return ChatExample(
        lane, ex.identity, [{"role": "user", "content": template.format(body=ex.body)}], ex.answer, meta=dict(ex.meta)
    )


@dataclass(frozen=True)
class SkillLane(Lane):
    seed: str = ""
    groups: tuple = ()  # (group label, items, generator(rng) -> Example or ChatExample), in id order
    template: str = TEMPLATE  # the prompt's form, hashed into the pins (a chat lane's user-message template)

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
            template_sha256=sha256_hex(self.template),
            extra={"groups": {label: count for label, count, _ in self.groups}},
        )


_CACHE: dict[str, tuple[Item, ...]] = {}


def lane_examples(lane: SkillLane) -> list[tuple[str, object]]:
    """(group, Example) in id order: each group's examples from its own seeded stream, interleaved round-robin
    (ids 0, 1, 2 are the first of groups 1, 2, 3), so that `--num-examples N` runs a balanced slice."""
    per_group, seen = [], set()
    for label, count, generator in lane.groups:
        rng = random.Random(f"{lane.seed}|{label}")
        examples = []
        while len(examples) < count:
            ex = draw(generator, rng, "heldout")
            if ex.identity not in seen:
                seen.add(ex.identity)
                examples.append((label, ex))
        per_group.append(examples)
    return [pair for round_ in itertools.zip_longest(*per_group) for pair in round_ if pair is not None]


def _generate(lane: SkillLane) -> list[Item]:
    """Completion lanes send `ex.prompt`; chat lanes the example's messages (its chat template switches are the
    lane's `chat_template_kwargs`)."""
    items = []
    for i, (label, ex) in enumerate(lane_examples(lane)):
        prompt = ex.messages if lane.api == "chat" else ex.prompt
        items.append(Item(i, prompt, ex.meta["expected"], prompt_sha256(prompt), group=label))
    return items


def skill_lane(
    name: str,
    description: str,
    grader: str,
    max_tokens: int,
    seed: str,
    groups: list[tuple[str, int, Callable]],
    headline: str,
    notes: str = "",
) -> SkillLane:
    return SkillLane(
        name=name,
        description=description,
        api="completions",
        params={"temperature": 0.0, "top_p": 1.0, "seed": 0, "max_tokens": max_tokens, "stop": ["Question:"]},
        concurrency=64,
        repeats=1,
        grader=grader,
        headline=headline,
        notes=notes,
        seed=seed,
        groups=tuple(groups),
    )


def chat_skill_lane(
    name: str,
    description: str,
    grader: str,
    params: dict,
    seed: str,
    repeats: int,
    groups: list[tuple[str, int, Callable]],
    template: str,
    headline: str,
    notes: str = "",
) -> SkillLane:
    return SkillLane(
        name=name,
        description=description,
        api="chat",
        params=params,
        concurrency=64,
        repeats=repeats,
        grader=grader,
        headline=headline,
        notes=notes,
        seed=seed,
        groups=tuple(groups),
        template=template,
    )
