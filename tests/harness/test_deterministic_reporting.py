"""The server's deterministic mode (`evalpipe serve --deterministic`) is recorded and reported: /get_server_info of a
real native server, then `evalpipe run` (manifest, summary, every record, audit), `repeat`, `qualify` and `compare`
against it; SGLang's own report (`enable_deterministic_inference`) read from a scripted stand-in; a server that says
nothing is unknown, never guessed.

One native server (tiny model, CPU, --deterministic) and one scripted server for the module."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from click.testing import CliRunner

from evalpipe.cli import main
from evalpipe.harness.audit import audit_run
from evalpipe.harness.server_facts import determinism_note, deterministic_label, deterministic_mode
from tests.support.core_helpers import DATA_DIR, only_run_dir, run_lane
from tests.support.scripted_server import set_config, start_scripted_server, stop_scripted_server
from tests.support.server_harness import ServerProcess

RUN_ARGS = ("--num-examples", "2", "--max-tokens", "4")


@pytest.fixture(scope="module")
def native():
    server = ServerProcess("--deterministic")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted():
    base_url, proc = start_scripted_server(mode="wrong")
    yield base_url
    stop_scripted_server(proc)


@pytest.fixture(scope="module")
def native_runs(native, tmp_path_factory):
    """Two `evalpipe run arith` folders against the deterministic native server (the same questions twice)."""
    out = tmp_path_factory.mktemp("native-runs")
    dirs = []
    for arm in ("first", "second"):
        r = run_lane("arith", native.base + "/v1", out / arm, "--arm", arm, *RUN_ARGS)
        assert r.returncode == 0, r.stdout + r.stderr
        dirs.append(only_run_dir(out / arm, "arith"))
    return dirs


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_flag_reaches_get_server_info_and_the_ready_line(native):
    info = httpx.get(native.base + "/get_server_info", timeout=30).json()
    assert info["deterministic"] is True and info["server_args"]["deterministic"] is True
    assert deterministic_mode(info) is True
    ready = next(line for line in native.output().splitlines() if "ready at" in line)
    assert ", deterministic, loaded in" in ready


def test_a_run_records_it_in_the_manifest_the_summary_and_every_record(native_runs):
    run_dir = native_runs[0]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["start"]["server"]["deterministic"] is True and manifest["end"]["server"]["deterministic"] is True
    assert json.loads((run_dir / "summary.json").read_text())["server_deterministic"] is True
    records = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["server_deterministic"] is True for r in records)
    report = audit_run(run_dir, data_dir=DATA_DIR)
    assert report.ok, [(c.name, c.problems) for c in report.checks if c.problems]


def test_audit_fails_a_record_whose_mode_the_manifest_does_not_say(native_runs, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("manifest.json", "summary.json"):
        (copy / name).write_text((native_runs[0] / name).read_text())
    lines = (native_runs[0] / "responses.jsonl").read_text().splitlines()
    edited = json.loads(lines[1])
    edited["server_deterministic"] = False
    (copy / "responses.jsonl").write_text("\n".join([lines[0], json.dumps(edited)]) + "\n")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop("responses_sha256", None)  # only the mode differs, not the pinned hash
    (copy / "manifest.json").write_text(json.dumps(manifest))
    records = next(c for c in audit_run(copy, data_dir=DATA_DIR).checks if c.name == "records")
    assert records.problems == ["record 2: server_deterministic=False, the manifest's server snapshots say True"]


def test_compare_of_two_deterministic_runs_says_a_difference_is_a_bug(native_runs, tmp_path):
    result = cli("compare", str(native_runs[0]), str(native_runs[1]), "--out", str(tmp_path / "cmp"), "--no-html")
    assert result.exit_code == 0, result.output
    compared = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert compared["deterministic"]["a"] is True and compared["deterministic"]["b"] is True
    assert "a greedy output difference between lossless settings is a bug, not noise" in result.output


def test_compare_against_a_server_that_does_not_say_warns_of_batch_shape_noise(native_runs, scripted, tmp_path):
    r = run_lane("arith", scripted, tmp_path / "peer", "--arm", "peer", *RUN_ARGS)
    assert r.returncode == 0, r.stdout + r.stderr
    peer = only_run_dir(tmp_path / "peer", "arith")
    assert json.loads((peer / "summary.json").read_text())["server_deterministic"] is None
    result = cli("compare", str(native_runs[0]), str(peer), "--out", str(tmp_path / "cmp"), "--no-html")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["deterministic"]["b"] is None
    assert "deterministic not on everywhere (on, unknown)" in " ".join(result.output.split())


def test_repeat_prints_and_writes_the_mode(native, tmp_path):
    result = cli(
        "repeat",
        "--base-url",
        native.base + "/v1",
        "--repeats",
        "2",
        "--fixtures",
        "arithmetic",
        "--conditions",
        "serial",
        "--out",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    assert "server deterministic: on" in result.output and "is a bug, not noise" in result.output
    run_dir = next((tmp_path / "repeat").iterdir())
    assert json.loads((run_dir / "repeat.json").read_text())["server"]["deterministic"] is True
    records = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    assert records and all(r["server_deterministic"] is True for r in records)


def test_seeded_batch_shape_gives_one_completion_on_the_keyed_server(native, tmp_path):
    """The same seeded T = 1 request alone and among 7 others (seeded_batch_1, seeded_batch_8): one completion."""
    result = cli(
        "repeat",
        "--base-url",
        native.base + "/v1",
        "--repeats",
        "2",
        "--fixtures",
        "open_short",
        "--max-tokens",
        "16",
        "--conditions",
        "seeded_batch_1,seeded_batch_8",
        "--out",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    run_dir = next((tmp_path / "repeat").iterdir())
    pooled = json.loads((run_dir / "repeat.json").read_text())["groups"]["open_short"]["seeded_batch_shape"]
    assert pooled["n"] == 4 and pooled["n_errors"] == 0 and pooled["distinct"] == 1, pooled
    records = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    fillers = {tuple(r["output_token_ids"]) for r in records if r["condition"] == "seeded_batch_8_filler"}
    assert len(fillers) > 1  # the fillers, seeded otherwise, are other samples


def test_qualify_prints_and_writes_the_mode(native, tmp_path):
    result = cli("qualify", "--base-url", native.base + "/v1", "--out", str(tmp_path / "q"), "--gates", "auth")
    assert result.exit_code == 0, result.output
    assert "server deterministic: on" in result.output and "deterministic on" in result.output
    qualified = json.loads((tmp_path / "q" / "qualify.json").read_text())
    assert qualified["endpoint"]["deterministic"] is True
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["start"]["server"]["deterministic"] is True and manifest["consistent"] is True


@pytest.mark.parametrize("reported", [True, False])
def test_sglangs_own_report_is_read(scripted, tmp_path, reported):
    """SGLang puts its server arguments at the top of /get_server_info; the stand-in reports the same key."""
    set_config(scripted, server_info={"enable_deterministic_inference": reported, "tp_size": 1})
    try:
        r = run_lane("arith", scripted, tmp_path, *RUN_ARGS)
    finally:
        set_config(scripted, server_info={"scripted": True})
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = only_run_dir(tmp_path, "arith")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["start"]["server"]["deterministic"] is reported
    records = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    assert records and all(r["server_deterministic"] is reported for r in records)


def test_the_mode_is_read_never_guessed():
    rng = random.Random()
    noise = {f"key_{rng.randrange(10**6)}": rng.random() for _ in range(5)}
    assert deterministic_mode({**noise, "deterministic": True}) is True
    assert deterministic_mode({**noise, "enable_deterministic_inference": False}) is False
    for silent in (None, {}, noise, [True], {"deterministic": "true"}, {"deterministic": 1}):
        assert deterministic_mode(silent) is None  # only a JSON boolean is a report
    # vLLM reports nothing: the environment its launcher gave it decides, read as vLLM reads it
    assert deterministic_mode(noise, vllm_env={"VLLM_BATCH_INVARIANT": "1"}) is True
    assert deterministic_mode(noise, vllm_env={"VLLM_BATCH_INVARIANT": "0"}) is False
    assert deterministic_mode(noise, vllm_env={}) is False  # launched without it: vLLM's default, off
    assert deterministic_mode(noise, vllm_env={"VLLM_BATCH_INVARIANT": "yes"}) is None  # vLLM would fail on it
    assert [deterministic_label(v) for v in (True, False, None)] == ["on", "off", "unknown"]
    assert "is a bug, not noise" in determinism_note([True, True])
    for modes in ([True, False], [True, None], [], [False]):
        assert "batch-shape variance" in determinism_note(modes)


def test_bench_writes_the_mode(native, tmp_path):
    args = ["--base-url", native.base + "/v1", "--input-len", "4", "--output-len", "4", "--rounds", "1"]
    result = cli("bench", *args, "--warmup", "0", "--concurrency", "1", "--out", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "b" / "bench.json").read_text())["server"]["deterministic"] is True
