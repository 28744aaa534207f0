"""The chat lanes for instruct models (chat-copy, chat-retrieval): their pinned hashes, their messages, and exact
grading through `evalpipe run` against the scripted server (mode "skills" answers a copy with the text and a needle
with its code, formatted by `reply_format`), with accuracy per length and depth group."""

from __future__ import annotations

import pytest

from evalpipe.lanes import computed_pins, get_lane, load_pins
from tests.support.core_helpers import load_run, only_run_dir, run_lane
from tests.support.scripted_server import set_config, start_scripted_server, stop_scripted_server

N = 10  # two items of each of the five groups (the lanes interleave their groups)


@pytest.fixture(scope="module")
def scripted():
    base_url, proc = start_scripted_server(mode="skills")
    yield base_url
    stop_scripted_server(proc)


@pytest.mark.parametrize(
    "name, groups, instruction",
    [
        ("chat-copy", ["c16", "c32", "c64", "c128", "c256"], "\nReply with the text only."),
        ("chat-retrieval", ["d0", "d1k", "d3k", "d6k", "deepest"], "\nReply with the code only."),
    ],
)
def test_chat_lanes_match_their_pins_and_ask_for_the_answer_alone(name, groups, instruction):
    lane = get_lane(name)
    data = lane.load(None, allow_data_drift=False)
    assert not data.data_drift
    pins = computed_pins(lane, data)
    assert {k: v for k, v in load_pins(name).items() if k in pins} == pins
    assert lane.api == "chat" and lane.grader == "exact_text" and lane.params["temperature"] == 0.0
    assert "chat_template_kwargs" not in lane.params  # the model's own template, with its own defaults
    assert [it.group for it in data.items[:5]] == groups and len(data.items) == 200
    for it in data.items:
        (message,) = it.prompt
        assert message["role"] == "user" and message["content"].endswith(instruction)
        assert it.expected_answer in message["content"]
    if name == "chat-copy":
        bounds = dict(zip(groups, [(8, 16), (17, 32), (33, 64), (65, 128), (129, 256)]))
        assert all(bounds[it.group][0] <= len(it.expected_answer) <= bounds[it.group][1] for it in data.items)
    else:
        assert max(len(it.prompt[0]["content"].encode()) for it in data.items) <= 12000


@pytest.mark.parametrize("name", ["chat-copy", "chat-retrieval"])
def test_exact_grading_strips_surrounding_whitespace_only(scripted, tmp_path, name):
    """The same answers padded with whitespace all count; with a trailing period none does."""
    scores = {}
    for label, reply_format in [("padded", " \n{reply}\n "), ("decorated", "{reply}.")]:
        set_config(scripted, reply_format=reply_format)
        r = run_lane(name, scripted, tmp_path / label, "--num-examples", str(N))
        assert r.returncode == 0, r.stdout + r.stderr
        records, summary, manifest = load_run(only_run_dir(tmp_path / label, name))
        assert manifest["lane"] == name and len(records) == N
        assert all(rec["request"]["messages"] == get_lane(name).items()[rec["question_id"]].prompt for rec in records)
        assert all(
            rec["response_text"].strip() == rec["expected_answer"] + "." * (label == "decorated") for rec in records
        )
        scores[label] = summary
    padded, decorated = scores["padded"], scores["decorated"]
    assert padded["n_correct"] == N and decorated["n_correct"] == 0
    assert {g: v["n_correct"] for g, v in padded["by_group"].items()} == dict.fromkeys(
        get_lane(name).load(None, False).extra["groups"], 2
    )
    assert all(v["n_planned"] == 2 and v["n_correct"] == 0 for v in decorated["by_group"].values())
