"""No secret leaves evalpipe: one unique API key is used for `serve`, `run`, `bench`, `ab` and `compare`, and it
appears in no response, no printed output and no file any of them wrote (run folders, manifests, receipts, server
logs, ab.json, compare.json, report.html). The A/B's own spec-off vs spec-on pair doubles as the check that a clean
pair has nothing "not marked intended" under `--intended 'server.*spec*'`."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import httpx
import pytest

from tests.support.cli_fork_server import run_forked
from tests.support.core_helpers import DATA_DIR
from tests.support.server_harness import ServerProcess

KEY = f"sk-scan-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served():
    srv = ServerProcess("--api-key", KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


def cli(*args, env_key: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, EVALPIPE_DATA_DIR=str(DATA_DIR))
    env.pop("EVALPIPE_API_KEY", None)
    if env_key:
        env["EVALPIPE_API_KEY"] = KEY
    r = run_forked(list(map(str, args)), env=env, cwd=os.getcwd(), timeout=timeout)
    assert r.returncode == 0, f"{args}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def written(served, tmp_path_factory):
    """Everything the commands wrote under one folder, and everything they printed."""
    root = tmp_path_factory.mktemp("secret-scan")
    url = served.base + "/v1"
    runs = root / "runs"
    printed = [
        cli(
            "run",
            "arith",
            "--base-url",
            url,
            "--api-key",
            KEY,
            "--num-examples",
            "2",
            "--max-tokens",
            "4",
            "--arm",
            "flag_key",
            "--out",
            runs,
            "--no-progress",
        ),
        cli(
            "run",
            "arith",
            "--base-url",
            url,
            "--num-examples",
            "2",
            "--max-tokens",
            "4",
            "--arm",
            "env_key",
            "--out",
            runs,
            "--no-progress",
            env_key=True,
        ),
        cli(
            "bench",
            "--base-url",
            url,
            "--api-key",
            KEY,
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--rounds",
            "1",
            "--warmup",
            "0",
            "--out",
            root / "bench",
        ),
        cli(
            "ab",
            "--lanes",
            "arith",
            "--order",
            "AB",
            "--num-examples",
            "2",
            "--max-tokens",
            "4",
            "--common",
            f"--api-key {KEY}",
            "--a",
            "--speculative off",
            "--b",
            "--speculative block",
            "--out",
            root / "ab",
        ),
    ]
    a, b = sorted((runs / "arith").iterdir())
    printed.append(cli("compare", a, b, "--out", root / "compare-runs", "--resamples", "200"))
    ab_a = next((root / "ab" / "arms" / "A1" / "runs" / "arith").iterdir())
    ab_b = next((root / "ab" / "arms" / "B1" / "runs" / "arith").iterdir())
    printed.append(
        cli("compare", ab_a, ab_b, "--out", root / "compare-ab", "--resamples", "200", "--intended", "server.*spec*")
    )
    return root, printed


def test_no_response_carries_the_key(served):
    with httpx.Client(base_url=served.base, headers=AUTH, timeout=60) as client:
        responses = [
            client.get("/get_server_info"),
            client.get("/server_info"),
            client.get("/get_model_info"),
            client.get("/v1/models"),
            client.get("/version"),
            client.get("/flush_cache"),
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}),
            client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}),
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": KEY}], "max_tokens": 2}),
            client.post("/v1/completions", json={"prompt": "x", "model": "nope"}),
            client.post("/v1/completions", content=b"{"),
            client.get("/nope"),
            client.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}x"}),
        ]
    info = responses[0].json()
    assert info["server_args"]["api_key"] == "<redacted>" and "--api-key" in info["launch"]["argv"]
    for resp in responses:
        assert KEY not in resp.text, (resp.request.url, resp.text[:500])


def test_the_key_is_in_no_file_and_no_output(served, written):
    root, printed = written
    files = [p for p in root.rglob("*") if p.is_file()]
    kinds = {p.name for p in files}
    for expected in (
        "responses.jsonl",
        "manifest.json",
        "summary.json",
        "bench.json",
        "receipt.json",
        "server.log",
        "ab.json",
        "report.html",
        "compare.json",
    ):
        assert expected in kinds, f"{expected} was not written: {sorted(kinds)}"
    leaked = [str(p.relative_to(root)) for p in files if KEY.encode() in p.read_bytes()]
    assert not leaked, f"the key is in {leaked}"
    for r in printed:
        assert KEY not in r.stdout and KEY not in r.stderr, r.args
    assert KEY not in served.output()  # the server's own log
    # where the key was given it is recorded as given, redacted
    manifest = json.loads(next((root / "runs" / "arith").glob("flag_key-*/manifest.json")).read_text())
    assert manifest["command_line"][manifest["command_line"].index("--api-key") + 1] == "<redacted>"
    ab = json.loads((root / "ab" / "ab.json").read_text())
    assert ab["args"]["common"] == "--api-key <redacted>"


def test_clean_spec_off_vs_on_pair_has_nothing_unintended(written):
    root, _ = written
    cmp = json.loads((root / "compare-ab" / "compare.json").read_text())
    md = cmp["manifest_diff"]
    assert md["n_unintended"] == 0, [d for d in md["differences"] if not d["intended"]]
    assert md["n_intended"] > 0  # the speculation settings themselves do differ
    # the servers' command lines restate the settings compared field by field: run manifests keep them as the
    # server reported them (redacted), and compare lists them as ignored (the per-engine volatile list)
    ignored = set(md["volatile_keys_ignored"])
    for arm in ("A1", "B1"):
        run = next((root / "ab" / "arms" / arm / "runs" / "arith").iterdir())
        info = json.loads((run / "manifest.json").read_text())["start"]["server"]["server_info"]
        assert KEY not in json.dumps(info) and "--speculative" in info["launch"]["argv"], info
    assert {"server.server_info.launch.argv", "server.server_info.server_args.argv"} <= ignored, sorted(ignored)
    assert {"captured_at", "endpoint.base_url"} <= ignored, sorted(ignored)
