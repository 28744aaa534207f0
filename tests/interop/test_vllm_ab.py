"""`evalpipe ab --engine vllm --order AB` against a real vLLM (CPU build): speculation off vs ngram with 3 draft
tokens, two fresh boots, fair receipts, 100% token-identical greedy outputs, and the accept length from /metrics
on the speculative arm. The measured result is printed (pytest shows it even when capturing). The ABBA order's
repeats and their receipt checks are engine-independent: tests/ab/test_ab.py boots them four times natively."""

from __future__ import annotations

import json
import shlex

from tests.support.cli_fork_server import alive
from tests.support.vllm_peer import (
    BOOT_TIMEOUT_S,
    DATA_DIR,
    ENGINE_ARGS,
    PASSTHROUGH,
    evalpipe,
    make_model,
    require_vllm,
)

N_QUESTIONS = 10
MAX_TOKENS = 32


def test_vllm_ab_spec_off_vs_ngram(tmp_path, capsys):
    require_vllm()
    model = make_model(tmp_path / "tiny-llama")
    common = shlex.join([*ENGINE_ARGS, "--model", str(model), "--", *PASSTHROUGH])
    out = tmp_path / "ab"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--order",
        "AB",
        "--common",
        common,
        "--a",
        "--speculative off",
        "--b",
        "--speculative ngram --spec-steps 3",
        "--num-examples",
        str(N_QUESTIONS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--out",
        str(out),
        "--data-dir",
        str(DATA_DIR),
        "--ready-timeout",
        str(BOOT_TIMEOUT_S),
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    index = json.loads((out / "ab.json").read_text())
    assert index["status"] == "done" and index["warnings"] == [], index
    assert index["declared_flags"] == ["speculative", "spec_steps"]
    assert [arm["label"] for arm in index["arms"]] == ["A1", "B1"]

    pids = []
    for arm in index["arms"]:
        receipt = json.loads((out / arm["receipt"]).read_text())
        assert receipt["engine"] == "vllm" and receipt["engine_version"] == "0.32.0"
        assert receipt["started_at"] < receipt["ready_at"] < receipt["stopped_at"]
        config = receipt["server_info"]["vllm_config"]["speculative_config"]
        metrics = arm["spec_metrics"]
        if arm["side"] == "A":
            assert config is None and metrics is None  # no speculation, no speculative counters
        else:
            assert config["method"] == "ngram" and config["num_speculative_tokens"] == 3
            assert metrics["level"] == "run" and metrics["drafts"] > 0 and metrics["mean_accept_length"] > 1.0
        summary = json.loads((out / arm["runs"]["gsm8k"] / "summary.json").read_text())
        assert summary["n_records"] == N_QUESTIONS and summary["n_errors"] == 0 and not summary["manifest_changed"]
        pids.append(receipt["pid"])
    assert len(set(pids)) == 2 and not any(alive(pid) for pid in pids)  # two fresh servers, both gone

    assert [(c["arm"], c["against"]) for c in index["receipt_checks"]] == [("B1", "A1")]
    assert all(check["ok"] for check in index["receipt_checks"]), index["receipt_checks"]

    lines = []
    for pair in index["comparisons"]:
        assert "error" not in pair, pair.get("error")
        ties = pair["ties"]
        assert ties["n_pairs"] == N_QUESTIONS and ties["n_identical"] == N_QUESTIONS, ties  # token-identical
        accept = {side: pair["spec"][side]["accept_length_run_level"] for side in ("a", "b")}
        for side, label in (("a", pair["a"]), ("b", pair["b"])):
            assert (accept[side] is not None and accept[side] > 1.0) == label.startswith("B")
        lines.append(
            f"{pair['a']} vs {pair['b']} ({pair['kind']}): identical {ties['n_identical']}/{ties['n_pairs']}, "
            "accept length (run-level /metrics) "
            + " vs ".join("off" if accept[s] is None else f"{accept[s]:.3f}" for s in ("a", "b"))
        )
    with capsys.disabled():
        print(
            "\nvLLM 0.32 CPU AB, gsm8k x",
            N_QUESTIONS,
            "max_tokens",
            MAX_TOKENS,
            "spec off vs ngram 3:\n  " + "\n  ".join(lines),
        )
