"""`evalpipe serve --speculative block` through real HTTP and the real `openai` client: every choice (and the final
stream chunk) carries a consistent `spec` object, /get_server_info reports the speculation settings and server-wide
totals, and a simulated-acceptance server says so everywhere (and `evalpipe run`'s check refuses it). Acceptance is
exact by default; a lossy top-k server says so in its ready line, its server info and every choice, and `evalpipe
run` scores it while its summary and `evalpipe compare` show the lossy rule."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest

from evalpipe.engine.runner import ModelRunner
from evalpipe.harness.server_facts import lossy_acceptance, simulation_reason
from tests.support.core_helpers import only_run_dir, run_cli, run_lane
from tests.support.server_harness import ServerProcess
from tests.support.spec_helpers import compare_with_tie_rule, plain_greedy

BLOCK = 4


def start_server(*args: str) -> ServerProcess:
    """A server on one torch thread: on the shared 2-core machine, two threads per process under load made each
    forward ~30x slower (measured: 45 s vs 2.4 s for the same 24-token request)."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return ServerProcess(*args)
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before


def check_spec(spec: dict, n_tokens: int, block: int) -> None:
    assert spec is not None, "every choice must carry spec statistics"
    hist = spec["accept_histogram"]
    assert len(hist) == block + 1
    assert sum(hist) == spec["verify_steps"]
    assert sum(i * h for i, h in enumerate(hist)) == spec["accepted_drafts"]
    assert spec["draft_tokens"] == block * spec["verify_steps"]
    assert spec["verify_steps"] >= 1
    assert spec["accept_length"] == pytest.approx(n_tokens / spec["verify_steps"])


@pytest.fixture(scope="module")
def server():
    srv = start_server(
        "--speculative", "block", "--block-size", str(BLOCK), "--drafter", "layerskip:2", "--max-batch", "8"
    )
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_choices_and_stream_carry_consistent_spec(server, client):
    model = client.models.list().data[0].id
    done = client.completions.create(
        model=model,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0.7,
        seed=5,
        n=2,
        extra_body={"return_token_ids": True},
    )
    assert len(done.choices) == 2
    total = 0
    for choice in done.choices:
        data = choice.model_dump()
        check_spec(data["spec"], len(data["token_ids"]), BLOCK)
        assert data["spec"]["simulate_acc_len"] is None
        assert data["spec"]["accept"] == {"rule": "exact", "lossy": False} and data["spec"]["lossy"] is False
        total += len(data["token_ids"])
    assert done.usage.completion_tokens == total

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count to ten"}],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    token_chunks = [c for c in chunks if c.choices]
    final = token_chunks[-1].choices[0].model_dump()
    assert final["finish_reason"] is not None
    n_tokens = sum(len(c.choices[0].model_dump().get("token_ids") or []) for c in token_chunks)
    assert n_tokens == chunks[-1].usage.completion_tokens
    check_spec(final["spec"], n_tokens, BLOCK)

    # the streamed greedy answer of the speculating server equals plain one-row greedy decoding of the same prompt
    # ids on an in-process runner (same default weights), and the non-streamed answer repeats it
    prompt_ids = next(
        c.choices[0].model_dump()["prompt_token_ids"]
        for c in token_chunks
        if c.choices[0].model_dump().get("prompt_token_ids")
    )
    streamed = [t for c in token_chunks for t in (c.choices[0].model_dump().get("token_ids") or [])]
    plain, margins = plain_greedy(
        ModelRunner("evalpipe-tiny-dsv4", max_seqs=2, max_seq_len=256), prompt_ids, len(streamed)
    )
    compare_with_tie_rule(streamed, plain, margins, "HTTP speculative vs in-process plain greedy")
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to ten"}], max_tokens=10, temperature=0
    )
    assert again.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in token_chunks)

    info = httpx.get(server.base + "/get_server_info", timeout=30).json()
    spec = info["speculative"]
    assert (spec["mode"], spec["block_size"], spec["drafter"], spec["simulate_acc_len"]) == (
        "block",
        BLOCK,
        "layerskip:2",
        None,
    )
    assert spec["accept"] == {"rule": "exact", "lossy": False}  # acceptance is exact unless asked otherwise
    assert lossy_acceptance(info) is None
    totals = info["internal_states"]["speculative_totals"]  # server-wide averages move while serving
    assert totals["requests"] >= 4  # 2 choices + 2 chats (plus the readiness probe)
    assert sum(totals["accept_histogram"]) == totals["verify_steps"]
    assert sum(i * h for i, h in enumerate(totals["accept_histogram"])) == totals["accepted_drafts"]
    assert totals["avg_accept_length"] == pytest.approx(totals["completion_tokens"] / totals["verify_steps"])
    assert info["server_args"]["speculative"] == "block"
    assert simulation_reason(info) is None
    ready = next(line for line in server.output().splitlines() if "ready at" in line)
    assert f"speculation block G={BLOCK} drafter layerskip:2" in ready, ready


def test_simulated_server_reports_itself_everywhere():
    srv = start_server(
        "--speculative", "block", "--block-size", "5", "--simulate-acc-len", "3.5", "--max-seq-len", "256"
    )
    try:
        info = httpx.get(srv.base + "/get_server_info", timeout=30).json()
        assert info["speculative"]["simulate_acc_len"] == 3.5
        assert simulation_reason(info) is not None  # what `evalpipe run` checks before scoring
        body = httpx.post(
            srv.base + "/v1/completions",
            timeout=120,
            json={
                "prompt": "abc",
                # five verify steps (accept lengths 3, 4, 3, 4, 3: the simulated lengths alternate to a mean of 3.5),
                # the last one cut at max_tokens
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        ).json()
        spec = body["choices"][0]["spec"]
        assert spec["simulate_acc_len"] == 3.5
        check_spec(spec, len(body["choices"][0]["token_ids"]), 5)
        hist = spec["accept_histogram"]
        assert hist[2] + hist[3] == sum(hist)  # accept lengths 3 and 4 only (2 or 3 drafts + bonus)
        ready = next(line for line in srv.output().splitlines() if "ready at" in line)
        assert "speculation block G=5" in ready and "SIMULATED accept length 3.5" in ready, ready
    finally:
        assert srv.stop() == 0, srv.output()


def test_lossy_topk_server_reports_itself_and_is_scored_visibly(server, tmp_path):
    """The default tiny model behind `--spec-accept-topk 3`: lossy in the ready line, /get_server_info and every
    choice; `evalpipe run` scores it (exit 0) and its summary, then `evalpipe compare` against the exact server,
    show the lossy rule."""
    srv = start_server("--speculative", "block", "--spec-accept-topk", "3", "--max-batch", "8")
    try:
        assert "accept topk k=3 (LOSSY)" in srv.output()
        info = httpx.get(srv.base + "/get_server_info", timeout=30).json()
        assert info["speculative"]["accept"] == {
            "rule": "topk",
            "k": 3,
            "lossy": True,
            "applies_to": "greedy and sampled requests",
        }
        assert info["server_args"]["spec_accept_topk"] == 3
        assert simulation_reason(info) is None  # lossy is not simulated: it is scored
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        for temperature in (0.0, 0.8):
            done = client.completions.create(
                model=client.models.list().data[0].id,
                prompt="The quick brown fox",
                max_tokens=8,
                temperature=temperature,
                seed=3,
                extra_body={"return_token_ids": True},
            )
            spec = done.choices[0].model_dump()["spec"]
            check_spec(spec, len(done.choices[0].model_dump()["token_ids"]), 5)
            assert spec["lossy"] is True and spec["accept"]["rule"] == "topk" and spec["accept"]["k"] == 3

        args = ("--num-examples", "2", "--max-tokens", "6")
        exact_run = run_lane("arith", server.base + "/v1", tmp_path / "exact", *args, "--arm", "exact")
        lossy_run = run_lane("arith", srv.base + "/v1", tmp_path / "lossy", *args, "--arm", "topk3")
    finally:
        assert srv.stop() == 0, srv.output()
    assert exact_run.returncode == 0, exact_run.stderr
    assert lossy_run.returncode == 0, lossy_run.stderr  # scored, not refused
    assert "LOSSY" in lossy_run.stderr and "LOSSY" in lossy_run.stdout
    lossy_dir, exact_dir = only_run_dir(tmp_path / "lossy", "arith"), only_run_dir(tmp_path / "exact", "arith")
    summary = json.loads((lossy_dir / "summary.json").read_text())
    assert (summary["spec_lossy"], summary["n_records_lossy"]) == (True, 2)
    assert summary["server_lossy_acceptance"]["rule"] == "topk"
    records = [json.loads(line) for line in (lossy_dir / "responses.jsonl").read_text().splitlines()]
    assert all(r["spec"]["lossy"] is True and r["spec"]["accept"]["k"] == 3 for r in records)
    exact_summary = json.loads((exact_dir / "summary.json").read_text())
    assert (exact_summary["spec_lossy"], exact_summary["n_records_lossy"]) == (False, 0)
    assert exact_summary["server_lossy_acceptance"] is None
    audit = run_cli("audit", str(lossy_dir))
    assert audit.returncode == 0, audit.stdout + audit.stderr

    out = tmp_path / "cmp"
    compared = run_cli("compare", str(exact_dir), str(lossy_dir), "--out", str(out), "--no-html", "--resamples", "200")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "LOSSY acceptance in B" in compared.stdout and "topk (k=3): 2/2 responses" in compared.stdout
    spec = json.loads((out / "compare.json").read_text())["spec"]
    assert spec["a"]["lossy"] is False and spec["a"]["accept_rules"] == ["exact"]
    assert spec["b"]["lossy"] is True and spec["b"]["n_records_lossy"] == 2
    assert spec["b"]["server_lossy_acceptance"]["k"] == 3
