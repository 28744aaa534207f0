"""Gate `kv-pressure` against `evalpipe serve` with a small pool (the default model, --max-batch 2 --max-seq-len 1024:
a 2,048-token pool it reports in /get_server_info), and against the scripted stand-in honest and with two planted
faults (a stale page answering a reused prefix, a live sequence's pages evicted under concurrency); plus reasons
shown whole however long the server's message is."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.qualify.test_qualify import SCRIPTED_INFO, gates, qualify
from tests.support.scripted_server import set_config, start_scripted_server, stop_scripted_server
from tests.support.server_harness import ServerProcess

POOL = 2 * 1024  # --max-batch 2 x --max-seq-len 1024


@pytest.fixture(scope="module")
def small_pool():
    server = ServerProcess("--max-batch", "2", "--max-seq-len", "1024", model="evalpipe-skills-dsv4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def scripted():
    base_url, proc = start_scripted_server(mode="skills", server_info={**SCRIPTED_INFO, "max_total_num_tokens": POOL})
    yield base_url
    stop_scripted_server(proc)


def test_kv_pressure_passes_on_the_native_server_with_a_small_pool(small_pool, tmp_path):
    info = httpx.get(small_pool.base + "/get_server_info", timeout=30).json()
    assert info["kv_pool"] == {"tokens": POOL, "pages": POOL // 64, "page_tokens": 64}
    code, result, output = qualify(small_pool.base + "/v1", tmp_path / "q", "--gates", "kv-pressure")
    g = gates(result)["kv-pressure"]
    notes = g["notes"]
    assert code == 0 and g["verdict"] == "pass", (g["reason"], output)
    assert notes["pool_tokens"] == POOL and notes["pool_source"] == "server info"
    assert notes["serial_tokens"] >= 1.2 * POOL and notes["requests"] >= 3
    kinds = [r["kind"] for r in g["records"]]
    n = notes["requests"]
    assert kinds == ["kv-pressure-serial"] * n + ["kv-pressure-concurrent"] * n + ["kv-pressure-reuse"]
    serial = [r for r in g["records"] if r["kind"] == "kv-pressure-serial"]
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in serial)  # cold: a fresh tag each
    assert notes["reuse_cached_tokens"] > 0
    # the pool really was overfilled: the first prompt's pages were evicted before the concurrent round re-sent it
    first_again = next(r for r in g["records"] if r["id"] == "concurrent 0")
    assert first_again["usage"]["prompt_tokens_details"]["cached_tokens"] < serial[0]["usage"]["prompt_tokens"]


def test_kv_pressure_passes_on_an_honest_stand_in_and_fails_on_each_planted_fault(scripted, tmp_path):
    args = ("--gates", "kv-pressure", "--max-context", "1024")
    code, result, output = qualify(scripted, tmp_path / "honest", *args)
    g = gates(result)["kv-pressure"]
    assert code == 0 and g["verdict"] == "pass", (g["reason"], output)
    n = g["notes"]["requests"]
    assert g["notes"]["pool_source"] == "server info" and g["notes"]["exact_answers"] == f"{n}/{n}"
    for fault, where in (("stale_cache", "reuse of"), ("evict_live", "concurrent")):
        set_config(scripted, faults=[fault])
        try:
            code, result, output = qualify(scripted, tmp_path / fault, *args)
        finally:
            set_config(scripted, faults=[])
        g = gates(result)["kv-pressure"]
        assert code == 4 and g["verdict"] == "fail", output
        failed = [r for r in g["records"] if r["verdict"] == "fail"]
        assert failed and all(r["kind"] != "kv-pressure-serial" for r in failed)
        assert any(r["id"].startswith(where) for r in failed) and "same as serial: " in g["reason"], g["reason"]
        if fault == "stale_cache":  # the stale answer still claims a cache hit: the output comparison catches it
            reuse = g["records"][-1]
            assert reuse["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert [c["name"] for c in reuse["checks"] if not c["ok"]] == ["same as serial"]


def test_kv_pressure_without_a_pool_size_says_where_one_comes_from(tmp_path):
    base_url, proc = start_scripted_server(mode="skills", server_info=SCRIPTED_INFO)
    try:
        code, result, output = qualify(base_url, tmp_path / "q", "--gates", "kv-pressure", "--max-context", "1024")
    finally:
        stop_scripted_server(proc)
    g = gates(result)["kv-pressure"]
    assert code == 4 and g["requests"] == 0 and "give --kv-pool-tokens N" in g["reason"]
    assert "vllm:cache_config_info" in g["reason"]


def test_a_gate_s_reason_is_the_server_s_whole_message(tmp_path):
    """A refusal longer than any old cut (300 characters per error, 400 per reason, 200 on the progress line) shows
    whole in qualify.json, the progress line and the table."""
    message = "the tool-call parser refuses this request: " + " ".join(f"step{i}" for i in range(150)) + " END"
    assert len(message) > 900
    base_url, proc = start_scripted_server(mode="error400", error_message=message)
    try:
        code, result, output = qualify(base_url, tmp_path / "q", "--gates", "retrieval", "--max-context", "600")
    finally:
        stop_scripted_server(proc)
    g = gates(result)["retrieval"]
    assert code == 4 and message in g["reason"], g["reason"]
    assert json.loads((tmp_path / "q" / "qualify.json").read_text())["gates"][0]["reason"] == g["reason"]
    assert output.count(message) == 2  # the gate's progress line and the table, each whole
