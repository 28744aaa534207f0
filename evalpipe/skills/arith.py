"""Skill `arith`: GSM8K-style word problems of 2-4 operations with operands of up to 3 digits.

The story names one operation per day; the worked answer takes the days in order, one line each in GSM8K's answer
format (`a + b = <<a+b=c>>c`), then `#### N`. Each line first works the operation digit by digit (`worked_digits`),
so every digit of a result depends on a few nearby digits: a model this small learns single-digit steps, not
multi-digit carries in one token. Distractor sentences are added until every operand of the story lies
more than WINDOW (64) tokens (bytes) before the answer line that uses it, so a window-64 model's compressed
attention layers, not its sliding window, must carry it. Every operand has at most 3 digits (a product or quotient
only of a running value up to 999); running values stay in [0, 9999]; division is always exact.
"""

from __future__ import annotations

import random

from evalpipe.skills import WINDOW, Example, completion_prompt
from evalpipe.skills.words import DAYS, FILLER_SENTENCES, ITEMS, NAMES

OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
MAX_VALUE = 9999


def _op_sentence(op: str, x: int, pron: str, item: str, rng: random.Random) -> str:
    if op == "+":
        verb = rng.choice(["buys", "finds", "gets"])
        return f"{pron} {verb} {x} more {item}."
    if op == "-":
        verb = rng.choice(["gives away", "sells", "loses"])
        return f"{pron} {verb} {x} {item}."
    if op == "*":
        return f"{pron} ends up with {x} times as many {item}."
    return f"{pron} splits the {item} into {x} equal groups and keeps one group."


def _next_op(value: int, rng: random.Random) -> tuple[str, int]:
    """A random operation and operand that keep the running value an integer in [0, MAX_VALUE]."""
    while True:
        op = rng.choice("+-*/")
        if op == "+" and value < MAX_VALUE:
            return op, rng.randint(1, min(999, MAX_VALUE - value))
        if op == "-" and value > 0:
            return op, rng.randint(1, min(999, value))
        if op == "*" and 2 <= value <= 999:  # products and quotients only of operands up to 3 digits
            return op, rng.randint(2, min(9, MAX_VALUE // value))
        if op == "/" and 2 <= value <= 999:
            divisors = [d for d in range(2, 10) if value % d == 0]
            if divisors:
                return op, rng.choice(divisors)


def _apply(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def worked_digits(op: str, a: int, b: int) -> str:
    """The operation as single-digit columns, read in the order a person writes them.

    `+`, `-`, `*` go from the units up, with the carry (borrow) of the column before: `3+5+0=8, 5+9+0=14, 2+0+1=3`
    for 253 + 95, `13-5-0=8, 15-9-1=5, 2-0-1=1` for 253 - 95 (a borrowing column shows its top digit plus 10),
    `7*3+0=21, 5*3+2=17, 2*3+1=7` for 257 * 3; the result is the last column's value, then the other columns' units
    digits from the last to the first. `/` is long division from the top digit: `1/2=0 r1, 15/2=7 r1, 18/2=9 r0`
    for 158 / 2, the quotient digits in order. Leading zeros of a result are dropped.
    """
    top = [int(d) for d in reversed(str(a))]
    if op == "/":
        columns, rem = [], 0
        for d in reversed(top):
            cur = rem * 10 + d
            columns.append(f"{cur}/{b}={cur // b} r{cur % b}")
            rem = cur % b
        return ", ".join(columns)
    if op == "*":
        columns, carry = [], 0
        for d in top:
            columns.append(f"{d}*{b}+{carry}={d * b + carry}")
            carry = (d * b + carry) // 10
        return ", ".join(columns)
    low = [int(d) for d in reversed(str(b))]
    width = max(len(top), len(low))
    top, low = top + [0] * (width - len(top)), low + [0] * (width - len(low))
    columns, carry = [], 0
    for d, e in zip(top, low):
        if op == "+":
            columns.append(f"{d}+{e}+{carry}={d + e + carry}")
            carry = (d + e + carry) // 10
        else:
            borrow = int(d < e + carry)
            columns.append(f"{d + 10 * borrow}-{e}-{carry}={d + 10 * borrow - e - carry}")
            carry = borrow
    return ", ".join(columns)


def worked_line(op: str, a: int, b: int) -> str:
    """`a op b: <columns>; a op b = <<a op b=r>>r`, the worked form of one operation."""
    r = _apply(op, a, b)
    return f"{a} {op} {b}: {worked_digits(op, a, b)}; {a} {op} {b} = <<{a}{op}{b}={r}>>{r}"


def generate(rng: random.Random, n_ops: int | None = None) -> Example:
    n_ops = n_ops or rng.randint(2, 4)
    name, pron = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    start = rng.randint(10, 999)
    first_day = rng.randint(0, len(DAYS) - n_ops)
    days = DAYS[first_day : first_day + n_ops]
    steps, value = [], start
    for _ in range(n_ops):
        op, x = _next_op(value, rng)
        result = _apply(op, value, x)
        steps.append((op, value, x, result))
        value = result

    story = [f"On {day}, {_op_sentence(op, x, pron.lower(), item, rng)}" for day, (op, _, x, _) in zip(days, steps)]
    question = f"How many {item} does {name} have at the end?"
    lines = [f"On {day}, {name} has {worked_line(op, a, x)} {item}." for day, (op, a, x, r) in zip(days, steps)]
    answer = "\n".join(lines) + f"\n#### {value}"

    fillers = list(FILLER_SENTENCES)
    rng.shuffle(fillers)
    for _ in range(rng.randint(0, 2)):  # a few distractors between the days, for variety
        story.insert(rng.randint(0, len(story)), fillers.pop())
    sentences = [f"{name} has {start} {item}."] + story
    while _min_operand_distance(_body(sentences, question), lines, steps, days) <= WINDOW:
        sentences.append(fillers.pop())  # more distractors before the question push every operand further
    identity = f"arith|{name}|{item}|{start}|{days[0]}|" + "|".join(f"{op}{x}" for op, _, x, _ in steps)
    return Example(
        "arith",
        identity,
        _body(sentences, question),
        answer,
        group=f"{n_ops}ops",
        meta={"n_ops": n_ops, "ops": [OPS[s[0]] for s in steps], "expected": value},
    )


def drill(rng: random.Random) -> Example:
    """One bare operation in the answer format (`worked_line`, then `#### c`): the arithmetic alone, taught
    inside the window (a training drill; the arith lane never asks it)."""
    value = rng.randint(10, 999)
    op, x = _next_op(value, rng)
    result = _apply(op, value, x)
    return Example(
        "calc",
        f"calc|{value}{op}{x}",
        f"What is {value} {op} {x}?",
        f"{worked_line(op, value, x)}\n#### {result}",
        group="1ops",
        meta={"n_ops": 1, "ops": [OPS[op]], "expected": result},
    )


def _body(sentences: list[str], question: str) -> str:
    return " ".join(sentences) + " " + question


def _min_operand_distance(body: str, lines: list[str], steps: list, days: list[str]) -> int:
    """Bytes from each operand in the story to the place its answer line writes it (the smallest such gap)."""
    prompt = completion_prompt(body) + " "
    gaps = []
    for k, (op, a, x, _) in enumerate(steps):
        line_start = len(prompt) + sum(len(line) + 1 for line in lines[:k])
        day_at = prompt.index(f"On {days[k]}, ")
        where = prompt.index(f" {x} ", day_at) + 1
        gaps.append(line_start + lines[k].index(f"{a} {op} {x}") + len(f"{a} {op} ") - where)
    start_at = prompt.index(f" has {steps[0][1]} ") + 5
    gaps.append(len(prompt) + lines[0].index(f" has {steps[0][1]} ") + 5 - start_at)
    return min(gaps)
