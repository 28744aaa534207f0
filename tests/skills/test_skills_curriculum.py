"""The skills added for the curriculum model (boxed arithmetic, its thinking form, drawn tool calls), read back by the
real parsers and graders, their held-out split, and the training recipes' schedule (training/curriculum.py)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from evalpipe.engine.tokenizer import SPECIAL_TOKENS, ByteTokenizer
from evalpipe.lanes import get_lane, sgl_eval_adapter
from evalpipe.lanes.skill_lane import lane_examples
from evalpipe.server.tool_calls import ToolCallSplitter
from evalpipe.skills import WINDOW, arith, boxed, copy_text, draw, retrieval, split_of, tools
from tests.skills.test_skills import _check_columns, _eval_steps
from training import curriculum, data

TOK = ByteTokenizer()


def test_the_boxed_prompt_is_sgl_evals_math_prompt():
    rng = random.Random("prompt")
    for _ in range(5):
        problem = arith.generate(rng).body
        assert boxed.math_prompt(problem) == sgl_eval_adapter.render_prompt(
            sgl_eval_adapter.prompt_template("math"), problem=problem
        )


@pytest.mark.parametrize("thinking", [False, True])
def test_boxed_replies_are_graded_right_by_the_ns_grader_and_their_steps_hold(thinking):
    rng = random.Random(f"boxed|{thinking}")
    math_equal = sgl_eval_adapter.math_equal()
    for _ in range(40):
        ex = boxed.generate(rng, thinking=thinking)
        value = ex.meta["expected"]
        # the text the server returns: the reply's tokens decoded (`</think>` is a visible special)
        reply_ids = TOK.encode(ex.reply)
        text = TOK.decode(reply_ids)
        assert text == ex.reply
        pred = sgl_eval_adapter.search_boxed(text)
        assert pred == str(value) and math_equal(str(value), pred)
        assert not math_equal(str(value + 1), pred)
        assert _eval_steps(text) == value
        for line in text.split(boxed.THINK_END)[0].splitlines()[: -1 if not thinking else None]:
            if "<<" in line:
                _check_columns(line)
        prompt = data.encode(ex).ids[: data.encode(ex).n_prompt]
        think_id = SPECIAL_TOKENS.index("<think>")
        assert (prompt[-1] == think_id) == thinking  # the template opens the thinking block
        assert reply_ids.count(SPECIAL_TOKENS.index("</think>")) == (1 if thinking else 0)
        if thinking:  # the answer follows the thinking block, which holds every worked line
            thought, answer = text.split(boxed.THINK_END)
            assert answer == boxed.boxed_line(value) and "<<" in thought


def test_boxed_items_share_the_arith_split_so_training_never_sees_a_lane_problem():
    lane = get_lane("chat-arith-boxed")
    examples = lane_examples(lane)
    identities = {ex.identity for _, ex in examples}
    assert len(identities) == 300 and {split_of(i) for i in identities} == {"heldout"}
    rng = random.Random("boxed|train")
    for gen in (boxed.generate, boxed.generate_thinking, arith.generate):
        drawn = {draw(gen, rng, "train").identity for _ in range(400)}
        assert not identities & drawn
    think = lane_examples(get_lane("chat-arith-boxed-think"))
    assert [ex.meta["problem"] for _, ex in think] == [ex.meta["problem"] for _, ex in examples]


def test_tool_calls_are_read_back_by_the_servers_parser_with_the_arguments_of_the_ask():
    rng = random.Random("tools")
    names, lengths = set(), set()
    for _ in range(300):
        ex = tools.generate(rng)
        want = ex.meta["expected"]
        ids = TOK.encode(ex.reply)
        splitter = ToolCallSplitter(decode=TOK.decode, marker=TOK.tool_call_token_id)
        content, _ = splitter.feed(ids, TOK.decode(ids), final=True)
        (call,) = splitter.calls()
        assert content == "" and call["function"]["name"] == want["name"]
        assert json.loads(call["function"]["arguments"]) == want["arguments"]
        spec = next(t["function"] for t in ex.tools if t["function"]["name"] == want["name"])
        assert list(want["arguments"]) == spec["parameters"]["required"]
        ask = ex.messages[0]["content"]
        for key, value in want["arguments"].items():
            kind = spec["parameters"]["properties"][key]["type"]
            assert isinstance(value, int if kind == "integer" else str) and f"{key} {value}" in ask
            if tools.PARAMETERS[key] == "code":
                lengths.add(len(value))
        assert len({t["function"]["name"] for t in ex.tools}) == len(ex.tools) >= 2
        names.add(want["name"])
        rendered = TOK.decode(TOK.apply_chat_template(ex.messages, tools=ex.tools))
        assert all(json.dumps(t["function"]) in rendered for t in ex.tools)
    assert len(names) > 150 and min(lengths) == 1 and max(lengths) == tools.CODE_LENGTHS[1]


def test_copy_lead_in_moves_the_string_across_block_boundaries_and_keeps_the_identity():
    rng = random.Random("lead")
    starts = set()
    for _ in range(400):
        ex = copy_text.generate(rng, length=rng.randint(4, 60), lead=48)
        assert ex.body.endswith("Copy the text exactly: " + ex.answer) and ex.identity == f"copy|{ex.answer}"
        starts.add(len(TOK.encode_prompt(ex.prompt)) - len(ex.answer))
    assert {s % 16 for s in starts} == set(range(16))  # every phase of the 16-token blocks
    plain = copy_text.generate(random.Random(1), length=50)
    assert plain.body == "Copy the text exactly: " + plain.answer


def test_retrieval_codes_of_any_length():
    rng = random.Random("digits")
    for digits in (3, 7, 10):
        ex = retrieval.generate(rng, after=100, digits=digits)
        assert len(ex.answer) == digits and ex.answer.isdigit() and ex.answer[0] != "0"


def test_v1_recipe_repeats_the_data_stream_of_the_models_trained_before_the_curriculum():
    """The digest was computed with training/data.py of 67358d5 (before recipes existed), same arguments."""
    h = hashlib.sha256()
    it = iter(data.BatchStream(0, 4096, 4096, 3, recipe="v1"))
    for _ in range(8):
        b = next(it)
        h.update(b["input_ids"].numpy().tobytes())
        h.update(b["labels"].numpy().tobytes())
    assert h.hexdigest() == "bd599c9edfd6ec3bb59487d0db16fb6ac8359dfd87128616cd207f4658ced9a4"


def test_v2_schedule_starts_inside_the_window_and_reaches_every_depth():
    v2 = curriculum.RECIPES["v2"]
    assert [v2.stage_at(p).until for p in (0.0, 0.199, 0.2, 0.49, 0.5, 0.99, 1.0, 7.0)] == [
        0.2,
        0.2,
        0.5,
        0.5,
        1.0,
        1.0,
        1.0,
        1.0,
    ]
    assert all(set(s.weights) <= set(curriculum.PARTS) for r in curriculum.RECIPES.values() for s in r.stages)
    rng = random.Random("v2")
    first, last = v2.stages[0], v2.stages[-1]
    in_window = 0
    for _ in range(300):
        ex = v2.generator(first, "copy-window")(rng)
        source = 1 + ex.prompt.rindex(ex.answer)  # token position of the first source character (after BOS)
        # character i is predicted at position n_prompt + i (the reply starts with a space): its source is in view
        assert data.encode(ex).n_prompt - source < WINDOW
        r = v2.generator(first, "retrieval")(rng)
        assert r.meta["depth"] <= 5 * WINDOW and 3 <= len(r.answer) <= 6
        in_window += r.group == "in-window"
    assert 110 < in_window < 190  # half of the first stage's needles are inside the window
    deep = [draw(v2.long_example(rng, last, data.LONG_AFTER[1]), rng, "train") for _ in range(200)]
    depths = [ex.meta["depth"] for ex in deep]
    assert min(depths) < 1024 and max(depths) > 3500  # spread over the whole context, not piled at one end
    assert sum(d > 2048 for d in depths) > 60  # uniform in depth: the deep half is not rare
    assert all(len(data.encode(ex)) <= data.LONG_BUCKETS[-1] for ex in deep)
    shorts = [data.sample_short(rng, recipe=v2, stage=s) for s in v2.stages for _ in range(150)]
    assert all(len(e) <= data.SHORT_BUCKETS[-1] for e in shorts)  # no short example is dropped for its length
    assert {"boxed", "boxed-think", "tools"} <= {e.skill for e in shorts}


def test_v3_keeps_v2s_ranges_and_weights_copy_up():
    """v3 = v2's stage ranges with copying weighted up: in-window copy leads the first stage, strings across the
    window are the largest part after it; every stage's short examples fit the buckets."""
    v2, v3 = curriculum.RECIPES["v2"], curriculum.RECIPES["v3"]
    assert [s.until for s in v3.stages] == [0.15, 0.5, 1.0]
    for a, b in zip(v2.stages, v3.stages):
        assert (a.copy_window, a.copy_length, a.copy_lead, a.long_after) == (
            b.copy_window,
            b.copy_length,
            b.copy_lead,
            b.long_after,
        )

    def share(stage, part):
        return stage.weights[part] / sum(stage.weights.values())

    assert share(v3.stages[0], "copy-window") > 1.5 * share(v2.stages[0], "copy-window")
    assert max(v3.stages[1].weights, key=v3.stages[1].weights.get) == "copy"
    rng = random.Random("v3")
    drawn = [data.sample_short(rng, recipe=v3, stage=v3.stages[0]) for _ in range(300)]
    assert 0.3 < sum(e.skill == "copy" for e in drawn) / len(drawn) < 0.65  # copy-window examples are skill copy
    assert all(len(e) <= data.SHORT_BUCKETS[-1] for e in drawn)


def test_stream_draws_from_the_stage_the_trainer_set():
    stream = data.BatchStream(3, batch_tokens=4096, long_tokens=4096, long_every=0, recipe="v2")
    assert stream.stage() is stream.recipe.stages[0]
    stream.set_progress(0.75)
    assert stream.stage() is stream.recipe.stages[-1]
    rng = random.Random(0)
    early = [data.sample_short(rng, recipe=stream.recipe, stage=stream.recipe.stages[0]) for _ in range(400)]
    late = [data.sample_short(rng, recipe=stream.recipe, stage=stream.recipe.stages[-1]) for _ in range(400)]
    copy_len = [len(e.ids) - e.n_prompt - 1 for e in early if e.skill == "copy"]
    assert copy_len and max(copy_len) <= WINDOW + 32
    assert max(len(e.ids) - e.n_prompt - 1 for e in late if e.skill == "copy") > 2 * WINDOW


def test_reweighting_checks_the_parts():
    v2 = curriculum.RECIPES["v2"].reweighted("copy=1,arith=1")
    assert all(s.weights["copy"] == 1 and s.weights["tools"] == 0 for s in v2.stages)
    rng = random.Random(0)
    assert {data.sample_short(rng, recipe=v2).skill for _ in range(50)} == {"copy", "arith"}
    with pytest.raises(ValueError, match="unknown mixture parts"):
        curriculum.RECIPES["v1"].reweighted("tools=1")
    with pytest.raises(ValueError, match="more than 0"):
        curriculum.RECIPES["v2"].reweighted("copy=0")


class _StageProbe(data.BatchStream):
    """Yields the stage a data worker sees, instead of batches."""

    def __iter__(self):
        while True:
            yield torch.tensor(self.stage().until, dtype=torch.float64)


def test_forked_data_workers_see_the_progress_the_trainer_sets():
    import time

    stream = _StageProbe(0, 1024, 1024, 0, recipe="v2")
    loader = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=1, prefetch_factor=1))
    assert float(next(loader)) == 0.2
    stream.set_progress(0.6)
    deadline = time.monotonic() + 30
    while float(next(loader)) != 1.0:  # batches already queued keep their stage; later ones follow the trainer
        assert time.monotonic() < deadline
