"""`evalpipe ab`: arm bookkeeping, refusals, the receipt fairness check (preflight against scripted stand-in
servers), and a real A/B on the native engine (tiny model, 12 arith items, max_tokens 16, order ABBA)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evalpipe.ab.arms import arm_labels, comparison_pairs, declared_flags, merge_args
from evalpipe.launchers.base import group_members
from evalpipe.launchers.flags import parse_serve_args
from tests.support.cli_fork_server import alive, run_forked

PY = sys.executable
FAKE = str(Path(__file__).resolve().parents[1] / "support" / "fake_engine_server.py")
REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("EVALPIPE_DATA_DIR") or REPO.parent / "shared" / "data")


def evalpipe(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real CLI in the checkout with tests/support/cli_fork_server.run_forked. On a timeout (ours or pytest's)
    SIGTERM it first so that it stops its servers, then SIGKILL it a minute later if it is still there."""
    env = {**os.environ, "EVALPIPE_DATA_DIR": str(DATA_DIR)}
    return run_forked(list(args), env=env, cwd=str(REPO), timeout=timeout, term_grace=60)


def test_arm_order_and_pairs():
    labels = arm_labels("ABBA")
    assert labels == [("A", "A1"), ("B", "B1"), ("B", "B2"), ("A", "A2")]
    assert comparison_pairs(labels) == [
        ("ab", "A1", "B1"),
        ("ab", "A2", "B2"),
        ("boot", "A1", "A2"),
        ("boot", "B1", "B2"),
    ]
    assert comparison_pairs(arm_labels("AB")) == [("ab", "A1", "B1")]
    assert comparison_pairs(arm_labels("AABB")) == [
        ("ab", "A1", "B1"),
        ("ab", "A2", "B2"),
        ("boot", "A1", "A2"),
        ("boot", "B1", "B2"),
    ]


def test_common_and_arm_arguments_merge_around_passthrough():
    assert merge_args(["--engine", "sglang", "--", "--nnodes", "2"], ["--speculative", "off", "--", "--x", "1"]) == [
        "--engine",
        "sglang",
        "--speculative",
        "off",
        "--",
        "--nnodes",
        "2",
        "--x",
        "1",
    ]
    assert merge_args(["--tp", "8"], ["--speculative", "off"]) == ["--tp", "8", "--speculative", "off"]


def test_declared_flags_are_what_differs_between_the_arms():
    a, _ = parse_serve_args(shlex.split("--engine sglang --model M --tp 8 --speculative off --mem-fraction-static 0.8"))
    b, given = parse_serve_args(
        shlex.split(
            "--engine sglang --model M --tp 8 --speculative dspark --draft-model D --mem-fraction-static 0.7 "
            "--set-env SGLANG_ENABLE_SPEC_V2=True"
        )
    )
    assert declared_flags(a, b) == ["speculative", "draft_model", "--mem-fraction-static", "SGLANG_ENABLE_SPEC_V2"]
    assert declared_flags(a, a) == []
    assert {"engine", "model", "tp", "speculative", "draft_model", "set_env", "extra_args"} <= given


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lanes", "nope", "--a", "", "--b", ""], "unknown lane"),
        (["--lanes", "gsm8k", "--a", "", "--b", "", "--order", "AAC"], "--order"),
        (["--lanes", "gsm8k", "--a", "--speculative dspark", "--b", ""], "arm A:"),
        (["--lanes", "gsm8k", "--a", "", "--b", "--engine sglang"], "arm B: sglang needs --model"),
        (["--lanes", "gsm8k", "--a", "--dry-run", "--b", ""], "set by `evalpipe ab` itself"),
        (["--lanes", "gsm8k", "--a", "--tp 'unclosed", "--b", ""], "--a:"),
    ],
)
def test_bad_input_is_a_usage_error(args, message, tmp_path):
    result = evalpipe("ab", *args, "--out", str(tmp_path / "ab"), timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "ab").exists()


def _fake_arm(info: dict) -> str:
    engine_command = f"{shlex.quote(PY)} {shlex.quote(FAKE)} --fake-info-json {shlex.quote(json.dumps(info))}"
    return f"--engine-command {shlex.quote(engine_command)}"


def test_preflight_refuses_an_undeclared_difference_and_stops_both_servers(tmp_path):
    common = "--engine sglang --model some/model --random-seed 0 --set-env FAKE_SHARED=1"
    a = _fake_arm({"mem_fraction_static": 0.8, "speculative_algorithm": None})
    b = _fake_arm({"mem_fraction_static": 0.7, "speculative_algorithm": "DSPARK"})
    out = tmp_path / "ab"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--common",
        common,
        "--a",
        a,
        "--b",
        b,
        "--preflight",
        "--out",
        str(out),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "receipt differs beyond the declared flags ['engine_command']" in result.stderr
    assert "server setting mem_fraction_static: A=0.8 B=0.7" in result.stderr
    assert "server setting speculative_algorithm: A=None B='DSPARK'" in result.stderr
    index = json.loads((out / "ab.json").read_text())
    assert index["status"] == "refused" and [arm["status"] for arm in index["arms"]] == ["done", "refused"]
    assert (out / "report.html").read_text().count("mem_fraction_static") >= 1
    for arm in ("A1", "B1"):
        receipt = json.loads((out / "arms" / arm / "receipt.json").read_text())
        assert receipt["stopped_at"] and not alive(receipt["pid"]) and not group_members(receipt["pid"])
        assert receipt["env_set"] == {"FAKE_SHARED": "1"}

    # The same pair passes when the differences are allowed explicitly.
    out2 = tmp_path / "ab2"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--common",
        common,
        "--a",
        a,
        "--b",
        b,
        "--preflight",
        "--allow-diff",
        "mem_fraction_static",
        "--allow-diff",
        "speculative_*",
        "--out",
        str(out2),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out2 / "ab.json").read_text())
    assert index["status"] == "done" and index["preflight"] is True
    assert [c["ok"] for c in index["receipt_checks"]] == [True]


def _native_speculation_available() -> bool:
    from evalpipe.commands.serve import command as serve_command

    native = getattr(serve_command, "native", serve_command)
    return any(p.name == "speculative" for p in native.params)


# The ABBA mechanics on short prompts: 12 arith items (about 40 byte-level tokens each, where a GSM8K five-shot
# prompt is about 2,440) keep four boots inside a minute on the 2-core CI machine; EVALPIPE_AB_TEST_QUESTIONS=N
# changes the count.
AB_QUESTIONS = int(os.environ.get("EVALPIPE_AB_TEST_QUESTIONS", "12"))


@pytest.fixture(scope="module")
def abba(tmp_path_factory):
    """One native A/B, order ABBA (four boots), shared by the tests that read it: (out folder, result, a, b)."""
    if _native_speculation_available():
        a, b = "--speculative off", "--speculative block --block-size 5"
    else:  # speculation not wired into `evalpipe serve`: two identical arms (boot-to-boot variation only)
        a, b = "", ""
    out = tmp_path_factory.mktemp("abba") / "ab"
    result = evalpipe(
        "ab",
        "--lanes",
        "arith",
        "--common",
        "--model evalpipe-tiny-dsv4 --max-tokens-per-step 2048",
        "--a",
        a,
        "--b",
        b,
        "--order",
        "ABBA",
        "--num-examples",
        str(AB_QUESTIONS),
        "--max-tokens",
        "16",
        "--out",
        str(out),
        "--ready-timeout",
        "300",
        "--fail-on",
        "inconclusive,not-evaluable",
        timeout=1800,
    )
    return out, result, a, b


def test_native_ab_abba_four_fresh_boots_receipts_and_report(abba):
    """Native engine, tiny model, speculation off vs block, arith, max_tokens 16, order ABBA. A dozen questions with
    no flips cannot support -1 pt (and the tiny model may get all of them wrong: no information), so
    `--fail-on inconclusive,not-evaluable` ends the finished A/B with the gate's exit code 4."""
    out, result, a, b = abba
    n = AB_QUESTIONS
    assert result.returncode == 4, result.stderr[-4000:]
    assert "gate: arith A1 vs B1 is " in result.stderr
    index = json.loads((out / "ab.json").read_text())
    assert index["status"] == "done", index.get("error")
    assert index["fail_on"] == ["inconclusive", "not-evaluable"]
    assert [arm["label"] for arm in index["arms"]] == ["A1", "B1", "B2", "A2"]
    pids = []
    for arm in index["arms"]:
        receipt = json.loads((out / arm["receipt"]).read_text())
        assert receipt["engine"] == "native" and receipt["server_info"]["model"] == "evalpipe-tiny-dsv4"
        assert receipt["started_at"] < receipt["ready_at"] < receipt["stopped_at"]
        pids.append(receipt["pid"])
        summary = json.loads((out / arm["runs"]["arith"] / "summary.json").read_text())
        assert summary["n_planned"] == n and summary["n_records"] == n and summary["n_errors"] == 0
        assert summary["arm"] == arm["label"]
    assert len(set(pids)) == 4 and not any(alive(pid) for pid in pids)  # four fresh servers, all gone
    # B1 vs A1; B2 vs B1 and A1; A2 vs A1 and B1
    assert [(c["arm"], c["against"]) for c in index["receipt_checks"]] == [
        ("B1", "A1"),
        ("B2", "B1"),
        ("B2", "A1"),
        ("A2", "A1"),
        ("A2", "B1"),
    ]
    assert all(check["ok"] for check in index["receipt_checks"]), index["receipt_checks"]
    pairs = {(c["a"], c["b"]): c for c in index["comparisons"]}
    assert set(pairs) == {("A1", "B1"), ("A2", "B2"), ("A1", "A2"), ("B1", "B2")}
    for pair in pairs.values():
        assert "error" not in pair, pair.get("error")
        ties = pair["ties"]
        assert ties["n_pairs"] == n
        # greedy agreement is 100%, counting numerical ties (reported, never hidden)
        assert ties["n_real_differences"] == 0 and ties["n_undecided"] == 0, ties
        assert ties["agreement_with_ties"] == 1.0
        assert pair["agreement"]["n_pairs"] == n
        if a and pair["kind"] == "ab":  # speculation really ran on B: accept length above 1
            assert pair["spec"]["b"]["accept_length_mean"] > 1.0 and pair["spec"]["a"]["n_records_with_spec"] == 0
        assert (out / pair["report"]).is_file()
    assert "tie" in index["tie_rule"] and index["warnings"] == []
    report = (out / "report.html").read_text()
    for pair in pairs.values():
        assert pair["report"] in report
        # the table row itself carries the verdict and the smallest detectable drop (not only the embedded report)
        all_wrong = pair["greedy"]["both_wrong"] == n
        verdict = "not-evaluable" if all_wrong else "inconclusive"
        assert pair["verdict"] == verdict and pair["mde_pts"] > 1.0
        low, high = pair["greedy"]["interval"]["low"], pair["greedy"]["interval"]["high"]
        assert f"{verdict}</span> at -1 pt (95% CI [{100 * low:+.2f}, {100 * high:+.2f}] pts)" in report
        assert f"{pair['mde_pts']:.2f} pts" in report
        line = next(x for x in result.stdout.splitlines() if x.startswith(f"arith {pair['a']} vs {pair['b']}"))
        if all_wrong:
            assert f"no information: both arms answered all {n} questions wrong" in line
        else:
            assert f"{n} questions cannot support -1 pt" in line
        if not all_wrong and pair["greedy"]["a_only"] + pair["greedy"]["b_only"] == 0:
            assert f"needs {pair['greedy']['n_needed_if_no_flips']} questions if none flips" in line


def test_readme_dspark_ab_preflight_against_stand_in_servers(tmp_path):
    """docs/engines.md's SGLang DSpark A/B, preflight only, against a stand-in that reports its arguments as SGLang
    does: the speculation settings are explained by the declared flags; an unpinned random seed is not."""
    engine_command = f"--engine-command {shlex.quote(f'{shlex.quote(PY)} {shlex.quote(FAKE)}')}"
    common = (
        f"--engine sglang --model deepseek-ai/DeepSeek-V4-Flash --tp 8 --ep 8 --mem-fraction-static 0.8 "
        f"{engine_command}"
    )
    a = "--speculative off"
    b = "--speculative dspark --draft-model deepseek-ai/DeepSeek-V4-Flash-DSpark --block-size 7"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k,aime26",
        "--common",
        common + " --random-seed 0",
        "--a",
        a,
        "--b",
        b,
        "--preflight",
        "--out",
        str(tmp_path / "ok"),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "ok" / "ab.json").read_text())
    assert index["declared_flags"] == ["speculative", "block_size", "draft_model"]
    assert [c["ok"] for c in index["receipt_checks"]] == [True]
    receipt_b = json.loads((tmp_path / "ok" / "arms" / "B1" / "receipt.json").read_text())
    assert receipt_b["server_info"]["speculative_algorithm"] == "DSPARK"
    assert receipt_b["server_info"]["speculative_accept_threshold_acc"] == "1.0"

    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--common",
        common,
        "--a",
        a,
        "--b",
        b,
        "--preflight",
        "--out",
        str(tmp_path / "seed"),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 1 and "server setting random_seed" in result.stderr, result.stderr


def test_lossy_sglang_thresholds_only_on_purpose_and_recorded(tmp_path):
    """`evalpipe ab` passes SGLang a lossy threshold only through --spec-accept-threshold-*: the argv carries it,
    the receipt and ab.json record it, a warning names it, and the stand-in's report of it is accepted."""
    engine_command = f"--engine-command {shlex.quote(f'{shlex.quote(PY)} {shlex.quote(FAKE)}')}"
    common = f"--engine sglang --model M --speculative dspark --draft-model D --random-seed 0 {engine_command}"
    out = tmp_path / "ab"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--common",
        common,
        "--a",
        "",
        "--b",
        "--spec-accept-threshold-single 0.5",
        "--preflight",
        "--out",
        str(out),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "ab.json").read_text())
    assert index["lossy_acceptance"] == {"A": None, "B": {"threshold_single": 0.5}}
    assert any("arm B asks for LOSSY acceptance" in w for w in index["warnings"])
    receipt_a = json.loads((out / "arms" / "A1" / "receipt.json").read_text())
    receipt_b = json.loads((out / "arms" / "B1" / "receipt.json").read_text())
    assert (
        receipt_a["lossy_acceptance"] is None
        and receipt_a["server_info"]["speculative_accept_threshold_single"] == "1.0"
    )
    assert receipt_b["lossy_acceptance"] == {"threshold_single": 0.5}
    argv = receipt_b["argv"]
    assert argv[argv.index("--speculative-accept-threshold-single") + 1] == "0.5"
    assert receipt_b["server_info"]["speculative_accept_threshold_single"] == "0.5"


def test_compare_by_hand_of_two_arms_of_one_ab_plan_takes_its_declared_flags(abba, tmp_path):
    """`evalpipe compare` of two run folders an A/B made (the ABBA plan's A1 and B1), without --intended: the
    plan's declared flags (read from its ab.json) mark the intended difference, in one line; the same folders
    copied out of the plan get no such line."""
    out, _, a, b = abba
    if not a:
        pytest.skip("native speculation is not wired into `evalpipe serve`: the plan declares no flags")
    index = json.loads((out / "ab.json").read_text())
    runs = {arm["label"]: out / arm["runs"]["arith"] for arm in index["arms"]}
    by_hand = evalpipe("compare", str(runs["A1"]), str(runs["B1"]), "--no-html", "--out", str(tmp_path / "cmp"))
    assert by_hand.returncode == 0, by_hand.stderr
    assert (
        f"both folders come from one `evalpipe ab` plan ({out / 'ab.json'}): its declared flags "
        "(speculative, block_size)" in " ".join(by_hand.stdout.split())
    )
    md = json.loads((tmp_path / "cmp" / "compare.json").read_text())["manifest_diff"]
    assert md["n_unintended"] == 0 and md["n_intended"] > 0 and md["intended_patterns"][0] == "*speculative*"
    for label in ("A1", "B1"):
        shutil.copytree(runs[label], tmp_path / "loose" / label)
    loose = evalpipe(
        "compare",
        str(tmp_path / "loose" / "A1"),
        str(tmp_path / "loose" / "B1"),
        "--no-html",
        "--out",
        str(tmp_path / "cmp2"),
    )
    assert loose.returncode == 0 and "evalpipe ab` plan" not in loose.stdout
    assert "differ only in speculation settings" in " ".join(loose.stdout.split())


def test_each_arms_deterministic_mode_is_printed_and_written(tmp_path):
    """vLLM reports no deterministic mode: each arm's comes from the VLLM_BATCH_INVARIANT its launcher set (the
    stand-in answers as a server that says nothing); ab.json, report.html and the printout carry it per arm."""
    engine_command = f"--engine-command {shlex.quote(f'{shlex.quote(PY)} {shlex.quote(FAKE)}')}"
    out = tmp_path / "ab"
    result = evalpipe(
        "ab",
        "--lanes",
        "gsm8k",
        "--common",
        f"--engine vllm --model M --random-seed 0 {engine_command}",
        "--a",
        "",
        "--b",
        "--deterministic",
        "--preflight",
        "--out",
        str(out),
        "--ready-timeout",
        "60",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "ab.json").read_text())
    assert [(a["label"], a["deterministic"]) for a in index["arms"]] == [("A1", False), ("B1", True)]
    assert [c["ok"] for c in index["receipt_checks"]] == [True]  # the declared flag explains the difference
    receipt_b = json.loads((out / "arms" / "B1" / "receipt.json").read_text())
    assert receipt_b["deterministic"] is True and receipt_b["env_set"] == {"VLLM_BATCH_INVARIANT": "1"}
    lines = result.stdout.splitlines()
    assert "arm A1: deterministic off" in lines and "arm B1: deterministic on" in lines
    assert any(line.startswith("deterministic not on everywhere (off, on)") for line in lines)
    assert "<td>on</td>" in (out / "report.html").read_text()
