"""Malformed input to the harness: every damaged, missing or foreign file gives an error that names the file (and the
line), exit 2, never a traceback (audit, compare, run --resume, import). And `--resume` takes the data folder from the
run's manifest: a run made with --data-dir resumes from another directory without the flag.

Run folders are real: `evalpipe run gsm8k` against the scripted server (a stand-in peer)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.support.core_helpers import DATA_DIR, evalpipe_cmd, load_run, only_run_dir, run_cli, run_lane
from tests.support.scripted_server import answer_table, set_config, start_scripted_server, stop_scripted_server

N = 5


@pytest.fixture(scope="module")
def server():
    base_url, proc = start_scripted_server(mode="correct", answers=answer_table("gsm8k", DATA_DIR))
    yield base_url
    stop_scripted_server(proc)


@pytest.fixture(scope="module")
def runs(server, tmp_path_factory):
    """Two finished gsm8k runs of N items, to be copied and damaged."""
    out = tmp_path_factory.mktemp("runs")
    for arm in ("a", "b"):
        r = run_lane("gsm8k", server, out / arm, "--num-examples", N, "--arm", arm)
        assert r.returncode == 0, r.stderr
    return {arm: only_run_dir(out / arm, "gsm8k") for arm in ("a", "b")}


def damaged(run, tmp_path, name, data: bytes, *, append=True):
    copy = tmp_path / f"{run.name}-damaged"
    shutil.copytree(run, copy)
    path = copy / name
    path.write_bytes((path.read_bytes() if append else b"") + data)
    return copy


def assert_bad_input(result, *needles):
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, out


LAST_LINE = N + 1  # the records are lines 1..N; the appended line is N + 1, then one more record follows it


@pytest.mark.parametrize(
    "garbage, why",
    [
        (b"\xff\xfe\x00not utf-8\n", "not UTF-8 (byte 0xff at column 1)"),
        (b'{"question_id": 5, "broken\n', "not valid JSON"),
        (b"[1, 2, 3]\n", "a JSON list, not an object"),
    ],
)
def test_a_bad_line_in_responses_is_named_by_audit_compare_and_resume(runs, tmp_path, server, garbage, why):
    first_record = (runs["a"] / "responses.jsonl").read_bytes().split(b"\n")[0] + b"\n"
    bad = damaged(runs["a"], tmp_path, "responses.jsonl", garbage + first_record)
    where = f"{bad / 'responses.jsonl'}:{LAST_LINE}: {why}"
    assert_bad_input(run_cli("audit", bad, "--no-progress"), where)
    assert_bad_input(run_cli("compare", bad, runs["b"], "--no-html", "--out", tmp_path / "cmp"), where)
    assert_bad_input(run_cli("compare", runs["b"], bad, "--no-html", "--out", tmp_path / "cmp"), where)
    assert_bad_input(run_cli("run", "--resume", bad, "--no-progress"), where, "fix or remove the line")


def test_a_torn_last_line_is_still_a_partial_run_not_bad_input(runs, tmp_path):
    torn = damaged(runs["a"], tmp_path, "responses.jsonl", b'{"question_id": 9, "resp')
    r = run_cli("compare", torn, runs["b"], "--no-html", "--out", tmp_path / "cmp")
    assert r.returncode == 1 and "the last line of responses.jsonl is cut off" in r.stderr, r.stderr
    audit = run_cli("audit", torn, "--no-progress")
    assert audit.returncode == 1 and "the last line of responses.jsonl is cut off" in audit.stdout


@pytest.mark.parametrize("name", ["manifest.json", "summary.json"])
@pytest.mark.parametrize(
    "data, why",
    [
        (b'{"run_id": "x",\n  "lane": \xe9\n}', "2: not UTF-8 (byte 0xe9)"),
        (b'{"run_id": "x",\n  "lane": }', "2: not valid JSON (Expecting value"),
    ],
)
def test_a_malformed_manifest_or_summary_is_named(runs, tmp_path, name, data, why):
    bad = damaged(runs["a"], tmp_path, name, data, append=False)
    where = f"{bad / name}:{why}"
    assert_bad_input(run_cli("audit", bad, "--no-progress"), where)
    assert_bad_input(run_cli("compare", bad, runs["b"], "--no-html", "--out", tmp_path / "cmp"), where)
    if name == "manifest.json":
        assert_bad_input(run_cli("run", "--resume", bad, "--no-progress"), where, "cannot resume")


def test_missing_and_foreign_folders_are_not_run_folders(runs, tmp_path):
    no_manifest = tmp_path / "no-manifest"
    shutil.copytree(runs["a"], no_manifest)
    (no_manifest / "manifest.json").unlink()
    msg = f"{no_manifest} is not a run folder (no manifest.json)"
    assert_bad_input(run_cli("compare", no_manifest, runs["b"], "--no-html", "--out", tmp_path / "cmp"), msg)
    assert_bad_input(run_cli("audit", no_manifest, "--no-progress"), msg)
    assert_bad_input(run_cli("run", "--resume", no_manifest, "--no-progress"), msg)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.json").write_text("{}")
    assert_bad_input(
        run_cli("compare", runs["a"], foreign, "--no-html", "--out", tmp_path / "cmp"),
        f"{foreign} is not a run folder (no manifest.json and no responses.jsonl)",
    )
    assert_bad_input(
        run_cli("import", "sgl-eval", foreign, "--out", tmp_path / "imp"), f"{foreign}: no output-rs<r>.jsonl"
    )
    assert_bad_input(
        run_cli("import", "lm-eval", runs["a"], "--out", tmp_path / "imp"),
        f"{runs['a']}: no lm-eval results_*.json here",
    )


def test_resume_takes_the_data_folder_from_the_manifest(server, tmp_path):
    """A run made with a relative --data-dir in one directory resumes from another, without the flag and with
    $EVALPIPE_DATA_DIR pointing elsewhere: the manifest's data folder is used, the protocol is unchanged."""
    made_in = tmp_path / "project"
    (made_in / "mydata" / "gsm8k").mkdir(parents=True)
    shutil.copy(DATA_DIR / "gsm8k" / "test.jsonl", made_in / "mydata" / "gsm8k" / "test.jsonl")
    env = dict(os.environ, EVALPIPE_DATA_DIR=str(tmp_path / "nowhere"))
    set_config(server, mode="error500")
    try:
        first = subprocess.run(
            evalpipe_cmd(
                "run",
                "gsm8k",
                "--base-url",
                server,
                "--data-dir",
                "mydata",
                "--num-examples",
                3,
                "--max-retries",
                0,
                "--out",
                "out",
                "--no-progress",
            ),
            cwd=made_in,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert first.returncode == 4, first.stderr
    finally:
        set_config(server, mode="correct")
    run_dir = only_run_dir(made_in / "out", "gsm8k")
    _, _, manifest = load_run(run_dir)
    assert manifest["start"]["dataset"]["path"] == str(made_in / "mydata" / "gsm8k" / "test.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = subprocess.run(
        evalpipe_cmd("run", "--resume", run_dir, "--no-progress"),
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    _, summary, manifest = load_run(run_dir)
    assert summary["n_errors"] == 0 and summary["accuracy"] == 1.0
    assert manifest["resume_start"]["dataset"]["path"] == manifest["start"]["dataset"]["path"]


def test_records_keep_a_bad_line_out_but_read_the_rest(tmp_path):
    """read_records: a non-UTF-8 line mid-file is a numbered bad line; a torn (unterminated) last line cut inside a
    UTF-8 sequence is a torn tail, as a killed writer leaves it."""
    from evalpipe.harness.records import read_records

    path = tmp_path / "responses.jsonl"
    path.write_bytes(b'{"a": 1}\n\xc3\x28\n{"a": 2}\n{"a": "\xc3')
    got = read_records(path)
    assert [r["a"] for r in got.records] == [1, 2] and got.bad_lines == [2] and got.torn_tail
    assert got.first_bad(path) == f"{path}:2: not UTF-8 (byte 0xc3 at column 1)"
    json.loads(json.dumps(got.why))  # plain strings only


def test_a_malformed_bench_json_is_named(tmp_path):
    for name, data in (("a", b'{"requests": [],\n "x": \xff}'), ("b", b'{"requests": []}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_bytes(data)
    assert_bad_input(
        run_cli("compare", tmp_path / "a", tmp_path / "b", "--no-html", "--out", tmp_path / "cmp"),
        f"{tmp_path / 'a' / 'bench.json'}:2: not UTF-8 (byte 0xff)",
    )


def test_a_record_without_a_required_key_is_named_by_audit_compare_and_resume(runs, tmp_path):
    """Audit validates the raw objects (a failed `records` check, exit 1); compare and --resume read Records, and
    name the line that cannot be one (exit 2)."""
    first = json.loads((runs["a"] / "responses.jsonl").read_bytes().split(b"\n")[0])
    del first["correct"]
    bad = damaged(runs["a"], tmp_path, "responses.jsonl", json.dumps(first).encode() + b"\n")
    audit = run_cli("audit", bad, "--no-progress")
    assert audit.returncode == 1 and f"record {LAST_LINE}: missing keys ['correct']" in audit.stdout, audit.stdout
    where = f"{bad / 'responses.jsonl'}:{LAST_LINE}: missing keys ['correct']"
    assert_bad_input(run_cli("compare", bad, runs["b"], "--no-html", "--out", tmp_path / "cmp"), where)
    assert_bad_input(run_cli("run", "--resume", bad, "--no-progress"), where, "fix or remove the line")


def test_a_record_without_the_optional_keys_reads_as_a_record_with_none_there(runs, tmp_path):
    """The keys records written before them lack (OPTIONAL_KEYS) read as None; a key that is not a field is left
    out of the Record and kept in the raw object."""
    from evalpipe.harness.records import OPTIONAL_KEYS, Record, read_records

    first = json.loads((runs["a"] / "responses.jsonl").read_bytes().split(b"\n")[0])
    older = {k: v for k, v in first.items() if k not in OPTIONAL_KEYS} | {"source": {"tool": "elsewhere"}}
    path = tmp_path / "responses.jsonl"
    path.write_text(json.dumps(older) + "\n")
    read = read_records(path)
    (rec,) = read.typed(path)
    assert all(getattr(rec, k) is None for k in OPTIONAL_KEYS)
    assert rec == Record.from_json(older) and not hasattr(rec, "source") and read.records[0]["source"]
    assert {k: v for k, v in rec.as_json().items() if k not in OPTIONAL_KEYS} == {
        k: v for k, v in older.items() if k != "source"
    }
