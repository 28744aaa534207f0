"""`evalpipe qualify`: every gate but retrieval passes against `evalpipe serve` with the default model (which finds
needles but does not copy whole codes); against the
scripted stand-in each gate fails for its own reason with exit 4 (keys mishandled, a lost needle, an early stop,
leaked tool protocol); bad input exits 2 and an unreachable endpoint 3; a reference recorded on one boot matches
20/20 on a fresh boot of the same settings, and another model is reported as a divergence.

One native server and one scripted server for the module; the scripted server's faults change at runtime."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalpipe.cli import main
from evalpipe.skills.words import NOTE_WORDS
from tests.support.core_helpers import run_cli
from tests.support.scripted_server import free_port, set_config, start_scripted_server, stop_scripted_server
from tests.support.server_harness import ServerProcess

KEYS = ("qualify-key-one", "qualify-key-two")
KEY_ARGS = [a for k in KEYS for a in ("--api-key", k)]
SCRIPTED_INFO = {
    "tokenizer": {"kind": "byte"},
    "engine": {"max_tokens_per_step": 32},
    "page_size": 16,
    "sliding_window": 8,
    "compress_rates": {"csa": 4},
}
FAST = ["--max-context", "600", "--soak-duration", "0.5", "--retrieval-depths", "3", "--needles-per-depth", "1"]


@pytest.fixture(scope="module")
def scripted():
    base_url, proc = start_scripted_server(mode="skills", api_keys=list(KEYS), server_info=SCRIPTED_INFO)
    yield base_url
    stop_scripted_server(proc)


@pytest.fixture(scope="module")
def native():
    server = ServerProcess(*KEY_ARGS, model="evalpipe-skills-dsv4")
    yield server
    server.stop()


def qualify(base_url: str, out: Path, *args: str) -> tuple[int, dict | None, str]:
    """In-process `evalpipe qualify` (the real command); (exit code, qualify.json or None, output)."""
    result = CliRunner().invoke(
        main, ["qualify", "--base-url", base_url, "--out", str(out), *args], catch_exceptions=False
    )
    path = out / "qualify.json"
    return result.exit_code, json.loads(path.read_text()) if path.exists() else None, result.output


def gates(result: dict) -> dict:
    return {g["gate"]: g for g in result["gates"]}


def test_every_gate_passes_against_a_correct_stand_in(scripted, tmp_path):
    set_config(scripted, faults=[])
    code, result, output = qualify(scripted, tmp_path / "q", *KEY_ARGS, *FAST)
    assert code == 0, output
    by = gates(result)
    assert set(by) == {"auth", "retrieval", "boundaries", "mixed", "structured", "soak"}
    assert all(g["verdict"] == "pass" and g["requests"] > 0 for g in by.values())
    # what each gate actually exercised
    assert by["auth"]["requests"] == 4 * 4  # 2 keys + missing + wrong, on 4 routes
    assert by["boundaries"]["notes"]["lengths"] == [3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33]
    structured = by["structured"]["records"]
    assert {r["stream"] for r in structured} == {True, False} and {r["mode"] for r in structured} == {"serial", "C8"}
    call = next(r for r in structured if r["id"] == "serial tool_choice named streamed")
    assert call["output"]["finish_reason"] == "stop" and json.loads(call["output"]["tool_calls"][0]["arguments"])
    call = next(r for r in structured if r["id"] == "serial tool_choice auto plain")
    assert call["output"]["finish_reason"] == "tool_calls" and call["verdict"] == "pass"
    drawn = by["structured"]["notes"]["drawn_tools"]  # reported beside the verdict, not enforced
    assert drawn["sent"] >= 2 and drawn["exact"] == drawn["sent"] and drawn["first_miss"] is None, drawn
    assert by["soak"]["notes"]["failures"] == 0 and by["soak"]["notes"]["hangs"] == 0
    assert by["soak"]["notes"]["mem_available_mb"]["min"] > 0
    written = "".join(p.read_text() for p in (tmp_path / "q").iterdir())
    assert "qualify-key-" not in written  # no key in qualify.json, manifest.json or report.html
    assert "id='qualification'" in (tmp_path / "q" / "report.html").read_text()
    assert json.loads((tmp_path / "q" / "manifest.json").read_text())["consistent"] is True


@pytest.mark.parametrize(
    "fault, gate, reason",
    [
        ("any_key", "auth", "wrong GET /v1/models: refused: HTTP 200 with a wrong key"),
        ("open_route", "auth", "missing GET /get_server_info: refused: HTTP 200 without a key"),
        ("lose_needle", "retrieval", "exact answer: replied"),
        ("early_stop", "retrieval", "exact answer"),
        ("leak_tool_protocol", "structured", "no leaked tool protocol: found ['<|tool_call|>']"),
        ("drop_images", "vision", "logprobs 0 apart (not above the noise floor 0.0001): the image is ignored"),
        ("no_tools", "structured", "the model does not call tools: with tool_choice auto it answered all 4 requests"),
    ],
)
def test_each_fault_fails_its_gate_with_exit_4(scripted, tmp_path, fault, gate, reason):
    set_config(scripted, faults=[fault])
    try:
        code, result, output = qualify(scripted, tmp_path / "q", *KEY_ARGS, *FAST, "--gates", gate)
    finally:
        set_config(scripted, faults=[])
    assert code == 4, output
    g = gates(result)[gate]
    assert g["verdict"] == "fail" and reason in g["reason"], g["reason"]
    assert result["failed_gates"] == [gate] and result["exit_code"] == 4
    if fault == "early_stop":
        assert any(c["name"] == "normal stop" and not c["ok"] for r in g["records"] for c in r["checks"])


def test_bad_input_exits_2_and_no_connection_exits_3(scripted, tmp_path):
    assert qualify(scripted, tmp_path / "a", "--gates", "auth,nope")[0] == 2
    code, _, output = qualify(scripted, tmp_path / "b", *KEY_ARGS, "--reference", str(tmp_path / "missing.json"))
    assert code == 2 and "no such reference file" in output
    code, _, output = qualify(scripted, tmp_path / "r", *KEY_ARGS, "--receipt", str(tmp_path / "none.json"))
    assert code == 2 and "--receipt: cannot read the receipt" in output
    (tmp_path / "not-a-receipt.json").write_text("{}")
    code, _, output = qualify(scripted, tmp_path / "r2", *KEY_ARGS, "--receipt", str(tmp_path / "not-a-receipt.json"))
    assert code == 2 and "is not an `evalpipe serve` receipt" in output
    code, _, output = qualify(scripted, tmp_path / "c", "--api-key", "not-a-key", "--gates", "retrieval")
    assert code == 2 and "refused" in output
    code, _, output = qualify(f"http://127.0.0.1:{free_port()}/v1", tmp_path / "d", "--gates", "retrieval")
    assert code == 3 and "cannot reach" in output


@pytest.mark.parametrize(
    "fixture,problem",
    [
        ("a string", "fixture 0 is a str, not an object"),
        ({"body": "x", "first_token": {}, "text": ""}, "fixture 0 has no request body object"),
        ({"body": {}, "text": ""}, "fixture 0 has no first_token object"),
        ({"body": {}, "first_token": {}, "text": "", "token_ids": 5}, "fixture 0 has a token_ids that is not a list"),
    ],
)
def test_a_reference_with_a_malformed_fixture_exits_2_naming_the_file(scripted, tmp_path, fixture, problem):
    from evalpipe.qualify.reference import SCHEMA

    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"schema": SCHEMA, "fixtures": [fixture]}))
    code, result, output = qualify(scripted, tmp_path / "out", *KEY_ARGS, "--reference", str(ref))
    assert code == 2 and result is None
    assert str(ref) in output and problem in output


def test_native_server_passes_and_a_reference_matches_a_fresh_boot_but_not_another_model(native, tmp_path):
    ref = tmp_path / "ref.json"
    url = native.base + "/v1"
    # structured (below) runs beside the other gates: the server decodes both commands' requests side by side in its
    # batches, not one command's after the other's (the clean engine's greedy outputs do not depend on what shares
    # its batches: tests/engine/test_fault_matrix.py's batch-shape rows)
    with ThreadPoolExecutor(1) as pool:
        structured = pool.submit(qualify, url, tmp_path / "structured", *KEY_ARGS, "--gates", "structured")
        r = run_cli(
            "qualify",
            "--base-url",
            url,
            *KEY_ARGS,
            "--out",
            tmp_path / "boot1",
            "--record-reference",
            ref,
            "--gates",
            "auth,reference,retrieval,boundaries,mixed,soak",
            "--max-context",
            "768",
            "--max-tokens",
            "8",
            "--soak-duration",
            "0.5",
            "--soak-max-tokens",
            "8",
            "--retrieval-depths",
            "3",
            "--needles-per-depth",
            "1",
            timeout=600,
        )
        structured_run = structured.result()
    result = json.loads((tmp_path / "boot1" / "qualify.json").read_text())
    by = gates(result)
    # the default model retrieves: every gate passes, every retrieval request on every check (exact answer among them)
    assert r.returncode == 0 and result["failed_gates"] == [], r.stdout + r.stderr
    for name in ("auth", "reference", "retrieval", "boundaries", "mixed", "soak"):
        assert f"│ {name}" in r.stdout
    checks = [c for rec in by["retrieval"]["records"] for c in rec["checks"]]
    assert len(by["retrieval"]["records"]) == 3 and "exact answer" in {c["name"] for c in checks}
    assert all(c["ok"] for c in checks), by["retrieval"]["records"]
    notes = by["retrieval"]["notes"]  # a byte-level tokenizer: the completion form, filled by the server's /tokenize
    assert notes["prompt_form"] == "completions" and notes["fill"].startswith("tokens")
    longest_note = len("Note 999: the  near the  was counted 99 times.\n") + 2 * max(map(len, NOTE_WORDS))
    assert 768 - 32 - longest_note <= notes["longest_prompt_tokens"] <= 768 - 32  # the filler is whole notes
    assert by["boundaries"]["notes"]["sizes"] == {"chunk": [512], "page": [64], "window": [256], "compression": [4, 16]}
    assert by["mixed"]["notes"]["still_running_at_arrival"] > 0
    recorded = json.loads(ref.read_text())
    assert len(recorded["fixtures"]) == 20 and all(f["token_ids"] for f in recorded["fixtures"])
    assert "qualify-key-" not in ref.read_text()

    # structured: tool calls (auto, required, named), a tool result and a JSON-schema reply through xgrammar
    code, result, output = structured_run
    g = gates(result)["structured"]
    assert code == 0 and g["verdict"] == "pass" and g["failed"] == 0 and g["passed"] == len(g["records"]), output
    drawn = g["notes"]["drawn_tools"]  # drawn tools are reported, not enforced
    assert drawn["enforced"] is False and drawn["sent"] >= 2 and 0 <= drawn["exact"] <= drawn["sent"], drawn
    print("drawn tools against the default model:", drawn)

    # a fresh boot of the same settings, and the random tiny model (same API, other weights), started side by side
    with ThreadPoolExecutor(2) as pool:
        booting = [
            pool.submit(ServerProcess, *KEY_ARGS, model="evalpipe-skills-dsv4"),
            pool.submit(ServerProcess, *KEY_ARGS),
        ]
    servers = [b.result() for b in booting if b.exception() is None]
    try:
        assert len(servers) == 2, [b.exception() for b in booting]
        fresh, other = servers
        code, result, output = qualify(
            fresh.base + "/v1", tmp_path / "boot2", *KEY_ARGS, "--reference", str(ref), "--gates", "reference"
        )
        notes = gates(result)["reference"]["notes"]
        assert code == 0 and notes["first_token_agreement"] == "20/20" and notes["continuation_agreement"] == "20/20", (
            output
        )

        code, result, output = qualify(
            other.base + "/v1", tmp_path / "other", *KEY_ARGS, "--reference", str(ref), "--gates", "reference"
        )
    finally:
        for server in servers:
            server.stop()
    g = gates(result)["reference"]
    assert code == 4 and g["verdict"] == "fail" and g["notes"]["reference_model"] == "evalpipe-skills-dsv4"
    assert g["notes"]["model"] == "evalpipe-tiny-dsv4" and g["notes"]["continuation_agreement"] != "20/20"
    diverged = [r["agreement"] for r in g["records"] if not r["agreement"]["continuation_agrees"]]
    assert diverged and all(a["first_divergence"] is not None for a in diverged)


def test_auth_gate_is_skipped_with_its_reason_when_no_key_is_given(tmp_path):
    """A server started without keys, qualified without --api-key: auth is skipped (no 0/0 failure) and says why;
    the other gates decide the exit code."""
    base_url, proc = start_scripted_server(mode="skills", server_info=SCRIPTED_INFO)
    try:
        code, result, output = qualify(base_url, tmp_path / "q", "--gates", "auth,retrieval", *FAST)
    finally:
        stop_scripted_server(proc)
    assert code == 0, output
    by = gates(result)
    assert by["auth"]["verdict"] == "skipped" and by["auth"]["requests"] == 0
    assert "no --api-key given" in by["auth"]["reason"] and "skipped" in output
    assert by["retrieval"]["verdict"] == "pass" and result["failed_gates"] == []


def test_the_sampling_gate_s_token_file_carries_no_key(native, tmp_path):
    code, result, output = qualify(
        native.base + "/v1", tmp_path / "s", *KEY_ARGS, "--gates", "sampling", "--sampling-tokens", "200"
    )
    assert code in (0, 4) and gates(result)["sampling"]["notes"]["tokens"] >= 200, output
    lines = (tmp_path / "s" / "sampling_tokens.jsonl").read_text().splitlines()
    assert len(lines) == gates(result)["sampling"]["requests"]
    written = "".join(p.read_text() for p in (tmp_path / "s").iterdir())
    assert "qualify-key-" not in written


def test_vision_passes_when_images_reach_the_model_and_skips_on_the_native_engine(scripted, native, tmp_path):
    """The scripted stand-in's reply depends on the whole message, image parts included (as a vision model's does);
    the native engine takes text only and refuses an image part with a 400 that names it: skipped, not failed."""
    set_config(scripted, faults=[])
    code, result, output = qualify(scripted, tmp_path / "s", *KEY_ARGS, "--gates", "vision")
    g = gates(result)["vision"]
    assert code == 0 and g["verdict"] == "pass" and g["requests"] == 5, output
    checks = {c["name"]: c for r in g["records"] for c in r["checks"]}
    assert (
        checks["same image, same output"]["ok"]
        and "outputs differ" in checks["differs from image B (checkerboard)"]["detail"]
    )
    code, result, output = qualify(native.base + "/v1", tmp_path / "n", *KEY_ARGS, "--gates", "vision")
    g = gates(result)["vision"]
    assert code == 0 and g["verdict"] == "skipped" and result["failed_gates"] == [], output
    refusal = "content part type 'image_url' is not supported (text only)"
    assert g["reason"] == f"skipped: the server refuses image content: HTTP 400: {refusal}"
    control, image = g["records"]
    assert control["status"] == 200 and image["status"] == 400 and image["image"] == "A (red disc)"


@pytest.mark.parametrize(
    "message, skips",
    [
        ("content part type 'image_url' is not supported (text only)", True),  # evalpipe serve
        ("<path> is not a multimodal model", True),  # vLLM 0.32 serving a text-only model
        ("Failed to load image: cannot identify image file <_io.BytesIO object>", False),  # vLLM, unreadable bytes
        ("scripted bad request", False),
    ],
)
def test_only_a_400_that_refuses_image_content_skips_the_vision_gate(message, skips):
    """Messages these servers gave (seen here), as the openai client reports them (its error text holds the body's
    repr); a 500 never skips."""
    from evalpipe.qualify.core import Outcome
    from evalpipe.qualify.vision import refuses_images, server_message

    body = {"error": {"message": message, "type": "BadRequestError", "code": 400}}
    refused = Outcome(False, 400, f"BadRequestError: Error code: 400 - {body}")
    assert server_message(refused) == message and refuses_images(refused) is skips
    assert not refuses_images(Outcome(False, 500, refused.error))
