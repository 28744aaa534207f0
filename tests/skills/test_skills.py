"""The synthetic skills, their lanes and the training data: formats, the held-out split, the window distance."""

from __future__ import annotations

import json
import random
import re

import pytest

from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.lanes import get_lane
from evalpipe.lanes.grading import legacy_answer_value
from evalpipe.lanes.skill_lane import lane_examples
from evalpipe.skills import WINDOW, arith, chat, copy_text, draw, retrieval, split_of
from evalpipe.skills.arith import _min_operand_distance
from training import data


def _eval_steps(answer: str) -> int:
    """Re-derive the answer from its worked lines: every <<a op b=c>> must hold and chain into the next line."""
    value = None
    for a, op, b, c in re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>", answer):
        a, b, c = int(a), int(b), int(c)
        assert value is None or a == value, "each line starts from the previous result"
        assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] and (op != "/" or a % b == 0)
        value = c
    return value


def _check_columns(line: str) -> None:
    """Redo one worked line's digit columns by hand: each column's value, the carry or borrow it passes on, and the
    result they spell, which must be the line's `<<a op b=r>>` result."""
    a, op, b, columns, r = re.fullmatch(
        r".*?(\d+) ([-+*/]) (\d+): (.*); \1 \2 \3 = <<\1\2\3=(\d+)>>\5.*", line
    ).groups()
    a, b, r = int(a), int(b), int(r)
    cols = columns.split(", ")
    if op == "/":
        rem, quotient = 0, ""
        for d, col in zip(str(a), cols, strict=True):
            cur, q, left = (int(v) for v in re.fullmatch(rf"(\d+)/{b}=(\d) r(\d)", col).groups())
            assert cur == rem * 10 + int(d) and q == cur // b and left == cur % b
            rem, quotient = left, quotient + str(q)
        assert rem == 0 and int(quotient) == r
        return
    digits, carry = [], 0
    top, low = str(a)[::-1], str(b)[::-1]
    for i, col in enumerate(cols):
        x, e, c, v = (int(t) for t in re.fullmatch(rf"(\d+)\{op}(\d)\+?-?(\d)=(\d+)", col).groups())
        d = int(top[i]) if i < len(top) else 0
        assert c == carry
        if op == "+":
            assert (x, e) == (d, int(low[i]) if i < len(low) else 0) and v == x + e + c
            carry = v // 10
        elif op == "-":
            assert x in (d, d + 10) and e == (int(low[i]) if i < len(low) else 0) and 0 <= v == x - e - c <= 9
            carry = int(x >= 10)
        else:
            assert x == d and e == b and v == x * b + c
            carry = v // 10
        digits.append(str(v) if i == len(cols) - 1 else str(v % 10))
    assert len(cols) == max(len(top), len(low) if op != "*" else 0)
    assert int("".join(reversed(digits))) == r


@pytest.mark.parametrize(
    "op, a, b, columns, result",
    [
        ("+", 253, 95, "3+5+0=8, 5+9+0=14, 2+0+1=3", 348),
        ("+", 999, 1, "9+1+0=10, 9+0+1=10, 9+0+1=10", 1000),
        ("+", 12, 345, "2+5+0=7, 1+4+0=5, 0+3+0=3", 357),
        ("-", 253, 95, "13-5-0=8, 15-9-1=5, 2-0-1=1", 158),
        ("-", 1000, 999, "10-9-0=1, 10-9-1=0, 10-9-1=0, 1-0-1=0", 1),
        ("-", 5, 5, "5-5-0=0", 0),
        ("*", 257, 3, "7*3+0=21, 5*3+2=17, 2*3+1=7", 771),
        ("*", 808, 9, "8*9+0=72, 0*9+7=7, 8*9+0=72", 7272),
        ("/", 158, 2, "1/2=0 r1, 15/2=7 r1, 18/2=9 r0", 79),
        ("/", 12, 3, "1/3=0 r1, 12/3=4 r0", 4),
    ],
)
def test_worked_digits_are_the_columns_a_person_writes(op, a, b, columns, result):
    assert arith.worked_digits(op, a, b) == columns
    line = arith.worked_line(op, a, b)
    assert line == f"{a} {op} {b}: {columns}; {a} {op} {b} = <<{a}{op}{b}={result}>>{result}"
    _check_columns(line)


def test_column_check_rejects_a_wrong_column():
    line = arith.worked_line("+", 253, 95).replace("5+9+0=14", "5+9+0=13")
    with pytest.raises(AssertionError):
        _check_columns(line)


@pytest.mark.parametrize("seed", range(5))
def test_arith_is_exact_gsm8k_format_and_operands_lie_beyond_the_window(seed):
    rng = random.Random(seed)
    for _ in range(200):
        ex = arith.generate(rng)
        n = ex.meta["n_ops"]
        assert 2 <= n <= 4 and ex.group == f"{n}ops"
        assert ex.answer.splitlines()[-1] == f"#### {ex.meta['expected']}"
        assert _eval_steps(ex.answer) == ex.meta["expected"] == legacy_answer_value(ex.answer)
        for line in ex.answer.splitlines()[:-1]:
            _check_columns(line)
        operands = [int(x) for x in re.findall(r"<<\d+[-+*/](\d+)=", ex.answer)]
        assert len(operands) == n and all(1 <= x <= 999 for x in operands)
        for x in operands:
            assert f" {x} " in ex.body  # every operand is stated in the story
        days = re.findall(r"^On (\w+),", ex.answer, flags=re.M)
        assert (
            _min_operand_distance(
                ex.body,
                ex.answer.splitlines()[:-1],
                [
                    (op, int(a), int(b), int(c))
                    for a, op, b, c in re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>", ex.answer)
                ],
                days,
            )
            > WINDOW
        )


def test_drill_is_one_checked_operation():
    rng = random.Random(0)
    for _ in range(300):
        ex = arith.drill(rng)
        assert _eval_steps(ex.answer) == ex.meta["expected"] and ex.answer.endswith(f"#### {ex.meta['expected']}")
        _check_columns(ex.answer.splitlines()[0])


def test_retrieval_needle_is_found_only_by_its_key_and_fits_the_context():
    rng = random.Random(1)
    tok = ByteTokenizer()
    for after in (0, 40, 150, 800, 1800, 3780, 10_000):
        ex = retrieval.generate(rng, after=after, before=0 if after > 3000 else None)
        value, key = ex.answer, ex.meta["key"]
        assert ex.prompt.count(value) == 1 and ex.body.count(f"secret code of the {key}") == 2
        assert re.fullmatch(r"\d{5}", value)
        assert len(tok.encode_prompt(ex.prompt)) + retrieval.REPLY_ROOM <= retrieval.MAX_CONTEXT
        assert ex.group == retrieval.depth_group(ex.meta["depth"])
    assert retrieval.generate(rng, after=0).group == "in-window"
    assert retrieval.generate(rng, after=3780, before=0).group == "deepest"


def test_copy_strings_are_longer_than_the_window():
    rng = random.Random(2)
    for _ in range(200):
        ex = copy_text.generate(rng)
        assert WINDOW < len(ex.answer) <= copy_text.LENGTHS[1] and ex.body.endswith(ex.answer)


def test_generators_are_seeded():
    for gen in (arith.generate, retrieval.generate, copy_text.generate, chat.generate):
        a = [gen(random.Random("s")) for _ in range(3)]
        b = [gen(random.Random("s")) for _ in range(3)]
        assert a == b


def test_chat_tool_calls_and_json_replies_are_well_formed():
    rng = random.Random(3)
    tok = ByteTokenizer()
    for _ in range(100):
        ex = chat.tool_call(rng)
        call = json.loads(ex.reply.removeprefix("<|tool_call|>"))
        assert call["name"] in {t["function"]["name"] for t in ex.tools}
        assert all(v in ex.messages[0]["content"] for v in call["arguments"].values())
        text = tok.decode(tok.apply_chat_template(ex.messages, tools=ex.tools))
        assert "Tools:\n" in text and json.dumps(ex.tools[0]["function"]) in text
        res = chat.tool_result(rng)
        rendered = tok.decode(tok.apply_chat_template(res.messages, tools=res.tools))
        assert res.meta["expected"] in rendered and res.meta["expected"] in res.reply
        js = chat.json_reply(rng)
        assert json.loads(js.reply) == js.meta["expected"]


def test_split_is_a_fixed_hash_and_training_never_sees_a_lane_item():
    """Held-out and training identities are disjoint by construction (sha256 bucket), whatever the seeds."""
    rng = random.Random("train|test")
    for name in ("arith", "retrieval", "copy"):
        lane = get_lane(name)
        examples = lane_examples(lane)
        identities = {ex.identity for _, ex in examples}
        assert len(identities) == len(examples) == len(lane.items())  # no duplicates inside a lane
        assert {split_of(i) for i in identities} == {"heldout"}
        for _, _, gen in lane.groups:
            drawn = [draw(gen, rng, "train").identity for _ in range(300)]
            assert {split_of(i) for i in drawn} == {"train"} and not identities & set(drawn)
    n_heldout = sum(split_of(arith.generate(rng).identity) == "heldout" for _ in range(3200))
    assert 130 < n_heldout < 270  # one identity bucket in 16 (expected 200)


def test_lane_groups_are_interleaved_and_balanced():
    items = get_lane("arith").items()
    assert len(items) == 1200 and [it.group for it in items[:6]] == ["2ops", "3ops", "4ops"] * 2
    assert {g: sum(it.group == g for it in items) for g in ("2ops", "3ops", "4ops")} == {
        g: 400 for g in ("2ops", "3ops", "4ops")
    }
    depths = [it.group for it in get_lane("retrieval").items()]
    assert len(depths) == 250 and depths[:5] == [g for _, g in retrieval.DEPTH_GROUPS]


def test_training_batches_mask_everything_but_the_answer():
    rng = random.Random(4)
    examples = [data.sample_short(rng) for _ in range(8)]
    batch = data.collate(examples)
    for i, e in enumerate(examples):
        answer = batch["labels"][i][batch["labels"][i] != -100].tolist()
        assert answer == e.ids[e.n_prompt :] and answer[-1] == data.TOKENIZER.eos_token_id
        prompt = batch["prompt_labels"][i][batch["prompt_labels"][i] != -100].tolist()
        assert prompt == e.ids[1 : e.n_prompt]
    stream = iter(data.BatchStream(0, batch_tokens=2048, long_tokens=4096, long_every=3))
    for k in range(6):
        b = next(stream)
        width = b["input_ids"].shape[1]
        bounds = data.LONG_BUCKETS if k % 3 == 2 else data.SHORT_BUCKETS
        assert width in bounds and b["input_ids"].shape[0] * width >= (4096 if k % 3 == 2 else 2048)
