"""`evalpipe bench`: exact per-event token counts, the decode-rate formula recomputed from bench.json,
warm-up dropped, cache flushed between rounds; against a scripted streaming peer and the native engine."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from evalpipe.commands.bench import command as bench_cmd  # noqa: E402
from evalpipe.commands.run import command as run_cmd  # noqa: E402
from evalpipe.harness.bench import inputs_sha256, make_inputs  # noqa: E402
from tests.support.bench_peer import start_peer  # noqa: E402

GROUPS = [3, 1, 2, 4, 1, 5]  # tokens per streamed event: a chunk counter would see 6, not 16


def formula(req: dict) -> float:
    ev = req["events"]
    return (req["completion_tokens"] - ev[0][1]) / (ev[-1][0] - ev[0][0])


def test_bench_against_scripted_peer(tmp_path):
    with start_peer(stream_groups=GROUPS, event_delay_s=0.03, accept_length=2.5) as (base_url, stats):
        res = CliRunner().invoke(
            bench_cmd,
            [
                "--base-url",
                base_url,
                "--input-len",
                "12",
                "--output-len",
                "16",
                "--rounds",
                "3",
                "--warmup",
                "1",
                "--concurrency",
                "2",
                "--out",
                str(tmp_path / "b"),
            ],
        )
        assert res.exit_code == 0, res.output
        peer = stats()
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    reqs = bench["requests"]
    assert len(reqs) == (1 + 3) * 2
    assert sum(r["warmup"] for r in reqs) == 2
    kept = [r for r in reqs if not r["warmup"]]
    for r in kept:
        assert [n for _, n in r["events"]] == GROUPS  # exact counts per event, not one per chunk
        assert r["completion_tokens"] == sum(GROUPS)
        assert r["first_event_tokens"] == GROUPS[0]
        assert r["count_source"] == ["token_ids"] and not r["usage_mismatch"]
        assert r["decode_tokens_per_s"] == pytest.approx(formula(r), rel=1e-12)
        assert r["ttft_s"] == r["events"][0][0] and r["total_s"] >= r["t_last"]
        assert r["accept_length"] == 2.5
    values = bench["results"]["decode_tokens_per_s"]["values"]
    assert values == [r["decode_tokens_per_s"] for r in kept]  # warm-up dropped, every measured value kept
    assert bench["results"]["decode_tokens_per_s"]["median"] == pytest.approx(statistics.median(values))
    for r in kept:  # receipt times are increasing; the round's aggregate is its tokens over its wall time
        assert all(t1 > t0 for (t0, _), (t1, _) in zip(r["events"], r["events"][1:]))
    for rnd in bench["rounds"]:
        assert rnd["completion_tokens"] == 2 * sum(GROUPS)
        assert rnd["aggregate_tokens_per_s"] == pytest.approx(rnd["completion_tokens"] / rnd["wall_s"])
    cfg = bench["config"]
    assert cfg["token_id_range"] == [100, 512] and cfg["input_ids_sha256"] == inputs_sha256(
        make_inputs(0, 2, 12, 100, 512)
    )
    assert bench["server"]["flush_cache_offered"] is True
    assert peer["flushes"] == 1 + 4  # the probe, then one before each of the 4 rounds
    # the printed table: each metric's median, min, max and count as bench.json has them (not every value)
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:6]]
        for line in res.output.splitlines()
        if line.count("│") == 6
    }
    for name in ("decode_tokens_per_s", "ttft_s", "total_s", "aggregate_tokens_per_s", "accept_length"):
        vals = bench["results"][f"{name}_values"] if name == "accept_length" else bench["results"][name]["values"]
        median = (
            bench["results"]["accept_length_median"] if name == "accept_length" else bench["results"][name]["median"]
        )
        assert rows[name] == [f"{median:.4g}", f"{min(vals):.4g}", f"{max(vals):.4g}", str(len(vals))], rows
    assert (
        len(bench["results"]["ttft_s"]["values"]) == 6
        and len(bench["results"]["aggregate_tokens_per_s"]["values"]) == 3
    )


@pytest.fixture(scope="module")
def pair_peer():
    """One peer streaming two events of two tokens, for the tests below that need no other setting."""
    with start_peer(stream_groups=[2, 2]) as peer:
        yield peer


def test_bench_refuses_a_stream_without_token_counts(pair_peer, tmp_path):
    """A server whose chunks carry neither token_ids nor cumulative usage cannot be measured honestly."""
    base_url, _ = pair_peer
    res = CliRunner().invoke(
        bench_cmd,
        [
            "--base-url",
            base_url,
            "--input-len",
            "4",
            "--output-len",
            "4",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert res.exit_code == 0, res.output  # token_ids present: fine
    import asyncio

    from evalpipe.harness.bench import BenchConfig, BenchError, run_bench

    cfg = BenchConfig(
        base_url=base_url,
        input_len=4,
        output_len=4,
        rounds=1,
        warmup=0,
        extra_body={"return_token_ids": False, "stream_options": {"include_usage": True}},
    )
    with pytest.raises(BenchError, match="exact per-event token counts"):
        asyncio.run(run_bench(cfg))


def test_bench_refuses_when_the_servers_token_ids_cannot_be_known(tmp_path):
    """No vocab_size and no /tokenize: drawing ids from a guessed range would be rejected (vLLM: "Token id 29894
    is out of vocabulary"), so the bench stops before any request and says how to give the range."""
    with start_peer(vocab_size=None) as (base_url, stats):
        args = ["--base-url", base_url, "--input-len", "4", "--output-len", "4", "--rounds", "1", "--warmup", "0"]
        res = CliRunner().invoke(bench_cmd, [*args, "--out", str(tmp_path / "b")])
        assert res.exit_code == 1 and "cannot tell which token ids" in res.output and "--token-id-range" in res.output
        assert stats()["requests"] == 0 and not (tmp_path / "b" / "bench.json").exists()
        res = CliRunner().invoke(bench_cmd, [*args, "--token-id-range", "20", "40", "--out", str(tmp_path / "c")])
        assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "c" / "bench.json").read_text())["config"]
    assert config["token_id_range"] == [20, 40] and config["token_id_range_source"] == "--token-id-range"


@pytest.fixture(scope="module")
def native_server():
    from tests.support.server_harness import ServerProcess

    # One intra-op thread: on a shared 2-core machine, OpenMP threads spinning against other processes made each
    # tiny-model request 30-50x slower (8 tokens: 0.27 s with 1 thread, 8-15 s with 2 under load).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        srv = ServerProcess("--max-seq-len", "256")
    try:
        yield srv
    finally:
        srv.stop()


def test_bench_against_native_engine(native_server, tmp_path):
    res = CliRunner().invoke(
        bench_cmd,
        [
            "--base-url",
            native_server.base + "/v1",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--rounds",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert res.exit_code == 0, res.output
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    kept = [r for r in bench["requests"] if not r["warmup"]]
    assert len(kept) == 1 and bench["results"]["n_errors"] == 0
    for r in kept:
        assert r["completion_tokens"] == 4  # ignore_eos honoured
        assert sum(n for _, n in r["events"]) == 4
        assert r["decode_tokens_per_s"] == pytest.approx(formula(r), rel=1e-12)
    assert bench["config"]["token_id_range_source"].startswith("server vocab_size")


def test_repeat_against_native_engine(native_server, tmp_path):
    """Distinct completions counted by `evalpipe repeat` equal those recomputed from its own records."""
    from collections import Counter

    from evalpipe.commands.repeat import command as repeat_cmd

    res = CliRunner().invoke(
        repeat_cmd,
        [
            "--base-url",
            native_server.base + "/v1",
            "--repeats",
            "2",
            "--fixtures",
            "arithmetic",
            "--conditions",
            "serial,burst,logprobs",
            "--out",
            str(tmp_path),
        ],
    )
    assert res.exit_code == 0, res.output
    run_dir = next((tmp_path / "repeat").iterdir())
    result = json.loads((run_dir / "repeat.json").read_text())
    recs = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    groups = result["groups"]["arithmetic"]
    assert set(groups) == {"serial", "burst", "logprobs"}
    for cond, g in groups.items():
        mine = [r for r in recs if r["question_id"] == f"arithmetic/{cond}"]
        assert len(mine) == 2 and all(isinstance(r["output_token_ids"], list) for r in mine)
        assert g["distinct"] == len(Counter(tuple(r["output_token_ids"]) for r in mine))
        assert g["mode_basis"] == "token_ids"
    assert groups["serial"]["distinct"] == 1  # batch 1 on CPU, same kernels each time: greedy is reproducible
    assert all(r["logprobs"] for r in recs if r["condition"] == "logprobs")
    assert groups["serial"]["mode_correct"] is False  # random weights: the control catches a model that cannot add


@pytest.fixture(scope="module")
def slow_peer():
    """One peer for both Ctrl-C cases: one token per event, an event every 0.1 s."""
    with start_peer(stream_groups=[1, 1, 1, 1], event_delay_s=0.1) as peer:
        yield peer


@pytest.mark.parametrize("processes", [1, 2])
def test_bench_ctrl_c_keeps_finished_rounds(slow_peer, tmp_path, processes):
    """SIGINT to a real `evalpipe bench` writes a partial bench.json with the rounds already measured, exit 130;
    with client worker processes too (a round in flight in the workers does not hold the interrupt)."""
    import signal
    import subprocess
    import time

    from tests.support.core_helpers import interruptible_evalpipe_cmd

    base_url, stats = slow_peer
    before = stats()["requests"]  # the shared peer's count before this bench
    proc = subprocess.Popen(
        interruptible_evalpipe_cmd(
            "bench",
            "--base-url",
            base_url,
            "--input-len",
            "4",
            "--output-len",
            "4",
            "--rounds",
            "100",
            "--warmup",
            "0",
            "--concurrency",
            "2",
            "--client-processes",
            str(processes),
            "--out",
            str(tmp_path / "b"),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while stats()["requests"] - before < 3 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert bench["partial"] is True and 2 <= len(bench["requests"]) < 100 * 2
    assert all(r["decode_tokens_per_s"] == pytest.approx(formula(r)) for r in bench["requests"])


def test_bench_refuses_clearly_before_any_request(tmp_path):
    """A base URL without /v1 gets a hint, and a shape over the listed max_model_len is refused up front
    (it used to send every request, print 'see bench.json' and fail with 'no measured request succeeded')."""
    with start_peer(max_model_len=20) as (base_url, stats):
        args = ["--input-len", "12", "--output-len", "16", "--rounds", "1", "--out", str(tmp_path / "b")]
        no_v1 = CliRunner().invoke(bench_cmd, ["--base-url", base_url[: -len("/v1")], *args])
        too_long = CliRunner().invoke(bench_cmd, ["--base-url", base_url, *args])
        run_no_v1 = CliRunner().invoke(
            run_cmd,
            [
                "gsm8k",
                "--base-url",
                base_url[: -len("/v1")],
                "--num-examples",
                "1",
                "--out",
                str(tmp_path / "r"),
                "--no-progress",
            ],
        )
        peer = stats()
    assert run_no_v1.exit_code == 1 and f"did you mean --base-url {base_url} ?" in run_no_v1.output, run_no_v1.output
    assert no_v1.exit_code == 1 and f"did you mean --base-url {base_url} ?" in no_v1.output, no_v1.output
    assert too_long.exit_code == 1 and "exceeds the server's max_model_len 20" in too_long.output, too_long.output
    assert peer["requests"] == 0 and not (tmp_path / "b").exists()


def test_defaults_and_readme_example_fit_the_default_server():
    """`evalpipe bench` with no length flags, and docs/comparing.md's example, work against a default
    `evalpipe serve`."""
    import re

    from evalpipe.engine.config import ENGINE_DEFAULTS
    from evalpipe.harness.bench import BenchConfig

    limit = ENGINE_DEFAULTS.max_seq_len
    defaults = {p.name: p.default for p in bench_cmd.params}
    assert defaults["input_len"] == BenchConfig.input_len and defaults["output_len"] == BenchConfig.output_len
    assert defaults["input_len"] + defaults["output_len"] <= limit
    readme = (Path(__file__).resolve().parents[2] / "docs" / "comparing.md").read_text()
    examples = [line for line in readme.splitlines() if line.startswith("evalpipe bench ")]
    assert examples
    for line in examples:
        lengths = dict(re.findall(r"--(input-len|output-len) (\d+)", line))
        total = int(lengths.get("input-len", defaults["input_len"])) + int(
            lengths.get("output-len", defaults["output_len"])
        )
        assert total <= limit, line


def _same_across_processes(req: dict) -> tuple:
    """What a request record holds besides its times: the same whichever process read the stream."""
    keys = ("round", "slot", "warmup", "error", "finish_reason", "completion_tokens", "first_event_tokens", "n_events")
    keys += ("count_source", "usage_mismatch", "accept_length", "spec")
    return tuple(json.dumps(req[k]) for k in keys) + (tuple(n for _, n in req["events"]),)


def test_client_processes_give_the_same_records_as_one(tmp_path):
    """5 streams read by 3 worker processes (shares of 2, 2, 1 slots): every record equals the one-process run's
    but for its times, each slot's prompt is sent once per round, and the times obey the same formulas."""
    groups = [int(g) for g in np.random.default_rng().integers(1, 5, size=7)]
    with start_peer(stream_groups=groups, event_delay_s=0.01, accept_length=1.5) as (base_url, stats):
        benches = {}
        for n in (1, 3):
            args = ["--base-url", base_url, "--input-len", "6", "--output-len", str(sum(groups)), "--rounds", "2"]
            args += ["--concurrency", "5", "--client-processes", str(n), "--out", str(tmp_path / str(n))]
            res = CliRunner().invoke(bench_cmd, args)
            assert res.exit_code == 0, res.output
            benches[n] = json.loads((tmp_path / str(n) / "bench.json").read_text())
        per_prompt = stats()["per_prompt"]
    assert sorted(per_prompt.values()) == [2 * 3] * 5  # 5 prompts, each sent once per round (1 warm-up + 2) per run
    one, three = benches[1], benches[3]
    assert three["config"]["client_processes"] == 3 and one["config"]["client_processes"] == 1
    same = _same_across_processes
    assert [same(r) for r in three["requests"]] == [same(r) for r in one["requests"]]
    assert [r["slot"] for r in three["requests"]] == list(range(5)) * 3
    for r in three["requests"]:
        assert [n for _, n in r["events"]] == groups and r["accept_length"] == 1.5
        assert all(t1 > t0 for (t0, _), (t1, _) in zip(r["events"], r["events"][1:]))
        assert r["decode_tokens_per_s"] == pytest.approx(formula(r), rel=1e-12)
    for rnd in three["rounds"]:
        assert rnd["completion_tokens"] == 5 * sum(groups)
        # the round's wall time spans every stream of every worker: no stream outlasts it
        longest = max(r["total_s"] for r in three["requests"] if r["round"] == rnd["round"])
        assert longest <= rnd["wall_s"] < longest + 5
        assert rnd["aggregate_tokens_per_s"] == pytest.approx(rnd["completion_tokens"] / rnd["wall_s"])


def test_client_worker_failures_stop_the_bench_with_their_reason(pair_peer):
    """A worker's exception (here: a stream without exact token counts) and a worker killed mid-bench are reported
    by worker and reason, not lost."""
    import asyncio
    import signal

    from evalpipe.harness.bench import BenchConfig, BenchError, run_bench, stream_request
    from evalpipe.harness.bench_workers import ClientWorkers, WorkerFailed

    base_url, _ = pair_peer
    cfg = BenchConfig(
        base_url=base_url,
        input_len=4,
        output_len=4,
        rounds=1,
        warmup=0,
        concurrency=2,
        client_processes=2,
        extra_body={"return_token_ids": False, "stream_options": {"include_usage": True}},
    )
    with pytest.raises(BenchError, match=r"client worker 0: BenchError: .*exact per-event token counts"):
        asyncio.run(run_bench(cfg))
    with ClientWorkers(2, stream_request, None, 30.0, 2) as workers:
        workers.procs[1].kill()
        body = {"model": "peer-model", "prompt": [1, 2], "max_tokens": 4, "stream": True, "return_token_ids": True}
        with pytest.raises(WorkerFailed, match=f"client worker 1 exited with code -{int(signal.SIGKILL)}"):
            asyncio.run(workers.round(base_url + "/completions", [body, body]))
    assert all(not p.is_alive() for p in workers.procs)


def test_client_processes_out_of_range_are_refused_with_exit_2(pair_peer, tmp_path):
    base_url, stats = pair_peer
    before = stats()["requests"]  # the shared peer's count before these commands
    args = ["--base-url", base_url, "--input-len", "4", "--output-len", "4", "--rounds", "1", "--warmup", "0"]
    zero = CliRunner().invoke(bench_cmd, [*args, "--client-processes", "0", "--out", str(tmp_path / "a")])
    many = CliRunner().invoke(
        bench_cmd, [*args, "--concurrency", "2", "--client-processes", "3", "--out", str(tmp_path / "b")]
    )
    assert stats()["requests"] == before
    assert zero.exit_code == 2 and "--client-processes" in zero.output, zero.output
    assert many.exit_code == 2 and "3 processes for 2 streams: at most --concurrency" in many.output, many.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
