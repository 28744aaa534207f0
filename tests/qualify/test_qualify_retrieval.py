"""The retrieval gate's prompt forms and its fill in the server's tokens, against the scripted server's /tokenize (a
planted subword tokenizer: 4 bytes a token, the chat rendered as ChatML), and without one (filled by bytes).

The default model's side (a byte-level tokenizer: the completion form, counted by the native server's /tokenize)
is checked in test_qualify.py's native test."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from evalpipe.cli import main
from evalpipe.qualify.retrieval import FIT_SLACK
from evalpipe.skills.retrieval import REPLY_ROOM
from tests.support.scripted_server import set_config, start_scripted_server, stop_scripted_server

MAX_CONTEXT = 600
ARGS = [
    "--gates",
    "retrieval",
    "--max-context",
    str(MAX_CONTEXT),
    "--retrieval-depths",
    "3",
    "--needles-per-depth",
    "1",
]


@pytest.fixture(scope="module")
def scripted():
    base_url, proc = start_scripted_server(mode="skills", bytes_per_token=4)
    yield base_url
    stop_scripted_server(proc)


def retrieval_gate(base_url: str, out, *args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(
        main, ["qualify", "--base-url", base_url, "--out", str(out), *ARGS, *args], catch_exceptions=False
    )
    gate = json.loads((out / "qualify.json").read_text())["gates"][0]
    return result.exit_code, gate


def test_auto_takes_the_chat_form_and_fills_the_context_in_the_server_s_tokens(scripted, tmp_path):
    set_config(scripted, bytes_per_token=4, faults=[])
    code, gate = retrieval_gate(scripted, tmp_path / "q")
    assert code == 0 and gate["verdict"] == "pass", gate["reason"]
    notes = gate["notes"]
    assert notes["prompt_form"] == "chat" and "renders the model's chat template" in notes["prompt_form_reason"]
    assert notes["fill"].startswith("tokens")
    budget = MAX_CONTEXT - REPLY_ROOM
    assert budget * (1 - FIT_SLACK) <= notes["longest_prompt_tokens"] <= budget
    for rec in gate["records"]:
        (message,) = rec["body"]["messages"]
        assert message["content"].endswith("\nReply with the code only.") and "prompt" not in rec["body"]
        rendered = f"<|im_start|>user\n{message['content']}<|im_end|>\n<|im_start|>assistant\n"
        assert rec["prompt_tokens"] == -(-len(rendered.encode()) // 4) + 1  # what the server counted, as sent
    # at 4 bytes a token the deepest prompts hold about four times the bytes of a byte-level fill
    assert max(rec["prompt_bytes"] for rec in gate["records"]) > 3 * MAX_CONTEXT


def test_a_lost_needle_fails_the_chat_form_on_the_answer(scripted, tmp_path):
    set_config(scripted, bytes_per_token=4, faults=["lose_needle"])
    try:
        code, gate = retrieval_gate(scripted, tmp_path / "q", "--prompt-form", "chat")
    finally:
        set_config(scripted, faults=[])
    assert code == 4 and gate["notes"]["prompt_form_reason"] == "--prompt-form chat"
    assert {c["name"] for rec in gate["records"] for c in rec["checks"] if not c["ok"]} == {"exact answer"}


def test_the_completion_form_is_counted_too_and_without_tokenize_the_fill_is_bytes(scripted, tmp_path):
    set_config(scripted, bytes_per_token=4)
    code, gate = retrieval_gate(scripted, tmp_path / "c", "--prompt-form", "completions")
    assert code == 0 and gate["notes"]["prompt_form"] == "completions" and gate["notes"]["fill"].startswith("tokens")
    assert all(rec["body"]["prompt"].endswith("\nAnswer:") for rec in gate["records"])
    assert all(rec["prompt_tokens"] == -(-rec["prompt_bytes"] // 4) + 1 for rec in gate["records"])

    set_config(scripted, bytes_per_token=None)  # the server now answers /tokenize with 404
    try:
        code, gate = retrieval_gate(scripted, tmp_path / "b")
    finally:
        set_config(scripted, bytes_per_token=4)
    notes = gate["notes"]
    assert code == 0 and notes["prompt_form"] == "completions" and "no chat" in notes["prompt_form_reason"]
    assert notes["fill"].startswith("bytes") and notes["longest_prompt_tokens"] is None
    assert all(rec["prompt_tokens"] is None and rec["prompt_bytes"] <= MAX_CONTEXT for rec in gate["records"])
