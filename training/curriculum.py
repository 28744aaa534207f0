"""Training recipes: what the default model is trained on, as a schedule over training progress, in one place.

A recipe is a list of stages; a stage holds from the end of the one before it until `until` (a fraction of the run's
planned optimizer steps) and says which skill parts the short batches mix, with what weights, and the length ranges
of the copy strings, the retrieval depths and codes, and the long (deep retrieval) batches. `v1` is the recipe of
the models trained before the curriculum (one stage: the mixture and ranges they used, drawn in the same order, so a
v1 data stream repeats theirs); `v2` teaches copying from the window outwards:

1. copy strings inside the sliding window (up to 52 characters, so each copied character is within 64 tokens of
   its source); needles inside the window (half of them) or a few notes before the question; short codes;
2. strings that cross the window and the compressed blocks (CSA every 4 tokens, HCA every 16; a random lead-in moves
   the string across block boundaries), needles up to 2,048 tokens deep (in long batches), codes of 3-8 digits;
3. everything: strings of 8-256 characters, needles at every depth to the full 4,096-token context (drawn uniformly
   in depth, not log-uniformly), codes of 3-10 digits, and the chat skills (boxed arithmetic, its thinking form,
   drawn tool calls) throughout.

`v3` keeps v2's stages and ranges and weights copying up (see its note).

The receipt records the recipe's name and its full table (`describe`).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from evalpipe.skills import WINDOW, Example, arith, boxed, chat, copy_text, retrieval, tools


@dataclass(frozen=True)
class Stage:
    until: float  # this stage holds while progress (fraction of planned steps) < until
    weights: dict  # short-mixture part -> weight (normalised when drawn)
    copy_window: tuple = (8, copy_text.LENGTHS[0])  # `copy-window` string lengths
    copy_length: tuple = copy_text.LENGTHS  # `copy` string lengths
    copy_lead: int = 0  # largest lead-in before a copy question (0: none)
    retrieval_after: tuple = (8, 630)  # filler bytes after the needle in short batches
    retrieval_spacing: str = "log"  # "log": log-uniform in [lo, hi]; "linear": uniform
    retrieval_in_window: float = 0.0  # share of short-batch needles with no filler after them (inside the window)
    code_digits: tuple = (5, 5)  # retrieval code lengths
    long_after: tuple = (512, 3900)  # filler bytes after the needle in long batches
    long_spacing: str = "log"


def _draw_after(rng: random.Random, span: tuple, spacing: str) -> int:
    lo, hi = span
    if spacing == "linear":
        return rng.randint(lo, hi)
    return int(round(2 ** rng.uniform(math.log2(max(1, lo)), math.log2(max(1, hi)))))


def _retrieval(rng: random.Random, stage: Stage, after: int, before=None) -> Example:
    digits = rng.randint(*stage.code_digits) if stage.code_digits[0] != stage.code_digits[1] else stage.code_digits[0]
    return retrieval.generate(rng, after=after, before=before, digits=digits)


# part name -> stage -> generator(rng). The v1 parts draw exactly as the v1 models' data stream did.
PARTS: dict[str, Callable[[Stage], Callable[[random.Random], object]]] = {
    "arith": lambda st: arith.generate,
    "calc": lambda st: arith.drill,
    "copy-short": lambda st: lambda rng: copy_text.generate(rng, length=rng.randint(8, copy_text.LENGTHS[0])),
    "copy": lambda st: (
        copy_text.generate
        if (st.copy_length, st.copy_lead) == (copy_text.LENGTHS, 0)
        else lambda rng: copy_text.generate(rng, length=rng.randint(*st.copy_length), lead=st.copy_lead)
    ),
    "copy-window": lambda st: (
        lambda rng: copy_text.generate(rng, length=rng.randint(*st.copy_window), lead=st.copy_lead)
    ),
    "retrieval": lambda st: (
        (lambda rng: retrieval.generate(rng, after=int(2 ** rng.uniform(3, 9.3)), before=rng.randint(0, 256)))
        if st.code_digits == (5, 5) and st.retrieval_after == (8, 630)
        else lambda rng: _retrieval(
            rng,
            st,
            0 if rng.random() < st.retrieval_in_window else _draw_after(rng, st.retrieval_after, st.retrieval_spacing),
            before=rng.randint(0, 256),
        )
    ),
    "chat": lambda st: chat.generate,
    "boxed": lambda st: boxed.generate,
    "boxed-think": lambda st: boxed.generate_thinking,
    "tools": lambda st: tools.generate,
}


@dataclass(frozen=True)
class Recipe:
    name: str
    stages: tuple
    note: str = ""
    _gens: dict = field(default_factory=dict, compare=False, repr=False)

    def stage_at(self, progress: float) -> Stage:
        """The stage in force at `progress` (fraction of planned steps; past the end, the last stage)."""
        return next((s for s in self.stages if progress < s.until), self.stages[-1])

    def generator(self, stage: Stage, part: str) -> Callable:
        key = (self.stages.index(stage), part)
        if key not in self._gens:
            self._gens[key] = PARTS[part](stage)
        return self._gens[key]

    def sample_part(self, rng: random.Random, stage: Stage) -> Callable:
        """A part's generator drawn by the stage's weights (one rng.random(), as the v1 stream drew it)."""
        total = sum(stage.weights.values())
        r, acc = rng.random(), 0.0
        for name, weight in stage.weights.items():
            acc += weight / total
            if r < acc:
                return self.generator(stage, name)
        return self.generator(stage, name)

    def long_example(self, rng: random.Random, stage: Stage, cap: int) -> Callable:
        """The generator of one long batch's examples: a depth drawn once per example group from the stage's
        long range (its top clipped to `cap` bytes)."""
        lo, hi = stage.long_after
        hi = min(hi, cap)
        after = _draw_after(rng, (min(lo, hi), hi), stage.long_spacing)
        if stage.long_spacing == "log" and stage.code_digits == (5, 5):
            return lambda r: retrieval.generate(r, after=after)
        return lambda r: _retrieval(r, stage, after)

    def reweighted(self, spec: str) -> "Recipe":
        """The recipe with every stage's weights replaced by `name=weight,...` (names checked against the parts
        the recipe uses)."""
        weights = {k: float(v) for k, v in (part.split("=") for part in spec.split(",") if part)}
        known = {name for s in self.stages for name in s.weights}
        unknown = set(weights) - known
        if unknown:
            raise ValueError(f"unknown mixture parts {sorted(unknown)}; recipe {self.name} has {sorted(known)}")
        if sum(weights.values()) <= 0:
            raise ValueError("the mixture weights must add up to more than 0")
        ordered = {k: weights.get(k, 0.0) for k in sorted(known, key=lambda n: list(PARTS).index(n))}
        return replace(
            self,
            stages=tuple(replace(s, weights=dict(ordered)) for s in self.stages),
            note=self.note + f" (reweighted: {spec})",
            _gens={},
        )

    def describe(self) -> dict:
        return {"recipe": self.name, "note": self.note, "stages": [asdict(s) for s in self.stages]}


V1 = Recipe(
    "v1",
    (Stage(1.0, {"arith": 0.30, "calc": 0.08, "copy-short": 0.07, "copy": 0.08, "retrieval": 0.15, "chat": 0.32}),),
    note="the mixture of the models trained before the curriculum (issue 13's default model)",
)

_V2_CHAT = {"boxed": 0.08, "boxed-think": 0.06, "tools": 0.08, "chat": 0.10}
V2 = Recipe(
    "v2",
    (
        Stage(
            0.2,
            {"arith": 0.14, "calc": 0.06, "copy-window": 0.26, "copy": 0.04, "retrieval": 0.18, **_V2_CHAT},
            copy_window=(4, WINDOW - 12),
            copy_length=(WINDOW - 16, WINDOW + 32),
            copy_lead=16,
            retrieval_after=(0, 2 * WINDOW),
            retrieval_spacing="linear",
            retrieval_in_window=0.5,
            code_digits=(3, 6),
            long_after=(64, 1024),
        ),
        Stage(
            0.5,
            {"arith": 0.16, "calc": 0.05, "copy-window": 0.08, "copy": 0.22, "retrieval": 0.17, **_V2_CHAT},
            copy_window=(4, WINDOW - 12),
            copy_length=(WINDOW - 16, 3 * WINDOW),
            copy_lead=48,
            retrieval_after=(0, 600),
            retrieval_in_window=0.15,
            code_digits=(3, 8),
            long_after=(256, 2048),
            long_spacing="linear",
        ),
        Stage(
            1.0,
            {"arith": 0.18, "calc": 0.04, "copy-window": 0.04, "copy": 0.18, "retrieval": 0.16, **_V2_CHAT},
            copy_window=(4, WINDOW - 12),
            copy_length=(8, 4 * WINDOW),
            copy_lead=48,
            retrieval_after=(0, 600),
            retrieval_in_window=0.15,
            code_digits=(3, 10),
            long_after=(8 * WINDOW, 3900),
            long_spacing="linear",
        ),
    ),
    note="copy curriculum: in-window strings first, then across the window and compressed blocks, then every depth",
)

_V3_CHAT = {"boxed": 0.06, "boxed-think": 0.05, "tools": 0.06, "chat": 0.08}
V3 = Recipe(
    "v3",
    tuple(
        replace(stage, until=until, weights=weights)
        for stage, until, weights in zip(
            V2.stages,
            (0.15, 0.5, 1.0),
            (
                {"arith": 0.10, "calc": 0.05, "copy-window": 0.45, "copy": 0.04, "retrieval": 0.12, **_V3_CHAT},
                {"arith": 0.12, "calc": 0.04, "copy-window": 0.08, "copy": 0.34, "retrieval": 0.14, **_V3_CHAT},
                {"arith": 0.16, "calc": 0.03, "copy-window": 0.04, "copy": 0.28, "retrieval": 0.15, **_V3_CHAT},
            ),
        )
    ),
    note="v2's stages with copy weighted up: in-window copy dominates the first 15% (copy-only training learned it in "
    "about 300 steps of 32,768 tokens on the H200), strings across the window a third of the mix after it (their "
    "loss still fell after 480 copy-only steps: benchmarks/gpu_results/2026-12-03/copy_probe.json)",
)

RECIPES = {r.name: r for r in (V1, V2, V3)}
DEFAULT_RECIPE = "v3"  # the shipped default model's (evalpipe/models/evalpipe-skills-dsv4/receipt.json)
