"""`evalpipe run` exit codes a script can act on, against the scripted server: permanent 500s and a server killed
mid-run both exit 4 (not 0) with the count and the exact `--resume` command, which then finishes the run; the
resume takes the endpoint from the manifest unless --base-url overrides it."""

from __future__ import annotations

import shlex
import subprocess
import time

from tests.support.core_helpers import DATA_DIR, evalpipe_cmd, load_run, only_run_dir, run_cli, run_lane
from tests.support.scripted_server import answer_table, set_config, start_scripted_server, stop_scripted_server

EXIT_ERRORS_REMAIN = 4


def resume_command(stderr: str) -> list[str]:
    """The command the run printed after "Retry just those with:" / "continue with:"."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(("Retry just those with:", "continue with:")):
            command = lines[i + 1].split("#", 1)[0].strip()
            assert command.startswith("evalpipe run --resume "), command
            return shlex.split(command)
    raise AssertionError(f"no resume command in:\n{stderr}")


def run_printed(command: list[str], *extra: str) -> subprocess.CompletedProcess:
    assert command[:2] == ["evalpipe", "run"]
    return run_cli(*command[1:], "--no-progress", *extra)


def test_permanent_500s_exit_4_then_the_printed_resume_finishes_the_run(tmp_path):
    answers = answer_table("gsm8k", DATA_DIR)
    base_url, proc = start_scripted_server(mode="error500", answers=answers)
    try:
        r = run_lane("gsm8k", base_url, tmp_path, "--num-examples", 4, "--max-retries", 1)
        assert r.returncode == EXIT_ERRORS_REMAIN, r.stderr
        assert "4 of 4 planned items have no successful response (InternalServerError x4)" in r.stderr
        run_dir = only_run_dir(tmp_path, "gsm8k")
        command = resume_command(r.stderr)
        assert command == ["evalpipe", "run", "--resume", str(run_dir)]  # no --base-url: the manifest has it
        _, summary, _ = load_run(run_dir)
        assert summary["n_errors"] == 4 and summary["accuracy"] == 0.0

        set_config(base_url, mode="correct", spec={"accept_length": 2.5})
        done = run_printed(command)
        assert done.returncode == 0, done.stderr
        records, summary, manifest = load_run(run_dir)
        assert summary["n_errors"] == 0 and summary["n_records"] == 4 and summary["accuracy"] == 1.0
        assert all(rec["endpoint"] == base_url for rec in records)
        # the summary table shows the accept length, and is not cut at 80 columns although stdout is a pipe
        header = next(line for line in done.stdout.splitlines() if "accuracy" in line and "partial" in line)
        assert "accept len" in header and len(header) > 80
        row = done.stdout.splitlines()[done.stdout.splitlines().index(header) + 2]
        assert "2.50" in row and "100.00%" in row
    finally:
        stop_scripted_server(proc)


def test_server_killed_mid_run_exits_4_and_resumes_on_a_new_address(tmp_path):
    answers = answer_table("gsm8k", DATA_DIR)
    base_url, proc = start_scripted_server(mode="correct", answers=answers, delay_s=0.05)
    n = 40
    out = tmp_path / "out"
    try:
        run = subprocess.Popen(
            evalpipe_cmd(
                "run",
                "gsm8k",
                "--base-url",
                base_url,
                "--out",
                out,
                "--num-examples",
                n,
                "--concurrency",
                2,
                "--max-retries",
                1,
                "--retry-backoff",
                "0.01",
                "--no-progress",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline:
            found = list(out.glob("gsm8k/*/responses.jsonl"))
            if found and len(found[0].read_text().splitlines()) >= 6:
                break
            time.sleep(0.02)
        proc.kill()  # the server dies mid-run
        proc.wait()
        stdout, stderr = run.communicate(timeout=120)
    finally:
        stop_scripted_server(proc)
    assert run.returncode == EXIT_ERRORS_REMAIN, stderr
    run_dir = only_run_dir(out, "gsm8k")
    records, summary, _ = load_run(run_dir)
    assert len(records) == n and 0 < summary["n_errors"] < n - 5
    assert f"{summary['n_errors']} of {n} planned items have no successful response (APIConnectionError" in stderr
    command = resume_command(stderr)

    new_url, proc = start_scripted_server(mode="correct", answers=answers)  # back up on another port
    try:
        r = run_printed(command)  # the recorded endpoint is gone: the run cannot start (exit 1), nothing written
        assert r.returncode == 1 and "cannot reach" in r.stderr, r.stderr
        r = run_printed(command, "--base-url", new_url)
        assert r.returncode == 0, r.stderr
    finally:
        stop_scripted_server(proc)
    records, summary, manifest = load_run(run_dir)
    assert summary["n_errors"] == 0 and summary["n_records"] == n and summary["partial"] is False
    retried = [rec for rec in records if rec["endpoint"] == new_url]
    assert len(retried) == manifest["resumes"][-1]["superseded_error_records"] == summary_errors(stderr) > 0


def test_new_run_defaults_to_the_address_serve_listens_on(tmp_path):
    from evalpipe.harness.client import DEFAULT_BASE_URL

    serve_help = " ".join(run_cli("serve", "--help").stdout.split())
    port = DEFAULT_BASE_URL.rsplit(":", 1)[1].split("/")[0]
    assert DEFAULT_BASE_URL == f"http://127.0.0.1:{port}/v1"
    assert f"[default: {port};" in serve_help and "binds. [default: 127.0.0.1]" in serve_help
    r = run_cli("run", "arith", "--out", tmp_path, "--num-examples", 1, "--max-retries", 0, "--no-progress")
    # whether or not a server listens there on this machine, the run went to that address
    said = r.stdout + r.stderr + "".join(p.read_text() for p in tmp_path.rglob("manifest.json"))
    assert DEFAULT_BASE_URL in said or f"127.0.0.1:{port}" in said, said
    help_text = run_cli("run", "--help").stdout
    assert DEFAULT_BASE_URL in help_text
    for lane in ("gsm8k 64", "aime26 1", "aime26-x16 64", "arith 64", "retrieval", "copy"):
        assert lane in " ".join(help_text.split()), help_text  # every lane's concurrency default
    for line in (
        "0    every planned item has a non-error record",
        "4    finished, but some items ended as error",
        "130  interrupted by Ctrl-C",
    ):
        assert line in help_text, help_text


def summary_errors(stderr: str) -> int:
    """The count the run printed: "N of M planned items have no successful response"."""
    line = next(line for line in stderr.splitlines() if "planned items have no successful response" in line)
    return int(line.split("evalpipe run: ", 1)[1].split(" of ", 1)[0])
