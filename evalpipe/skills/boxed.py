"""Skill `boxed`: the arith word problems asked in sgl-eval's own math prompt, answered with the worked lines and a
final `\\boxed{N}`, either plainly or inside a thinking block (`<think>` opened by the chat template, the worked
lines, `</think>`, then the boxed answer).

The user message is sgl-eval's `math` prompt (NeMo-Skills' generic math prompt) filled with the story, so the
chat-arith-boxed lanes and `sgl-eval run --from-dataset` send the model exactly this text. Each example keeps the
identity of the arith problem it is built from: its split is the arith problem's, so a held-out boxed item is never
a training arith item in either format.
"""

from __future__ import annotations

import random

from evalpipe.skills import arith
from evalpipe.skills.chat import ChatExample

# NeMo-Skills' generic math prompt as sgl-eval 0.1.0 renders it (no few-shot examples);
# tests/skills/test_skills_curriculum.py
# checks it against sgl-eval's own rendering
MATH_PROMPT = (
    "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{{}}.\n\n{problem}"
)
THINK_END = "</think>"


def math_prompt(problem: str) -> str:
    return MATH_PROMPT.format(problem=problem)


def boxed_line(value: int) -> str:
    return f"The answer is \\boxed{{{value}}}."


def generate(rng: random.Random, thinking: bool = False, n_ops: int | None = None) -> ChatExample:
    """One arith problem as a boxed chat question; with `thinking`, the worked lines are the thinking block (the
    template opens `<think>`; the reply closes it before the boxed answer)."""
    ex = arith.generate(rng, n_ops=n_ops)
    steps = ex.answer.rsplit("\n#### ", 1)[0]
    value = ex.meta["expected"]
    reply = f"{steps}{THINK_END}{boxed_line(value)}" if thinking else f"{steps}\n{boxed_line(value)}"
    return ChatExample(
        "boxed-think" if thinking else "boxed",
        ex.identity,
        [{"role": "user", "content": math_prompt(ex.body)}],
        reply,
        template_kwargs={"thinking": True} if thinking else {},
        meta={**ex.meta, "problem": ex.body, "group": ex.group},
    )


def generate_thinking(rng: random.Random, n_ops: int | None = None) -> ChatExample:
    return generate(rng, thinking=True, n_ops=n_ops)
