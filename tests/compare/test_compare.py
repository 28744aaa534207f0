"""`evalpipe compare` on run folders built here with known flips, checked against statistics computed by hand.

The run folders follow the format `evalpipe run` writes (responses.jsonl with the required keys,
summary.json, manifest.json with start/end snapshots), so compare is exercised on what it will read.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from evalpipe.commands.compare import command as compare_cmd
from evalpipe.harness.records import REQUIRED_KEYS
from tests.support.core_helpers import run_cli

N_Q = 40
GAINED = [3, 8, 12, 17, 21, 30, 33]  # B right, A wrong
LOST = [25]  # A right, B wrong
A_RIGHT = set(range(0, N_Q, 2)) | set(LOST)
A_RIGHT -= set(GAINED)
B_RIGHT = (A_RIGHT | set(GAINED)) - set(LOST)
TRUNCATED_B = [5, 7]  # wrong in both arms, B ran out of tokens
DIVERGE_AT = {3: 4, 8: 2, 12: 6, 17: 1, 21: 3, 25: 5, 30: 2, 33: 7, 5: 8, 7: 8}


def snapshot(
    prompt_stream="ab" * 32,
    dataset="cd" * 32,
    packages=("numpy==2.4.6", "torch==2.13.0"),
    server_spec=None,
    max_tokens=64,
):
    return {
        "captured_at": 1.0,
        "code": {"evalpipe_version": "0.1.0", "git_commit": "deadbeef", "git_dirty": False},
        "packages": list(packages),
        "python": {"python": "3.11.2"},
        "dataset": {"path": "/data/gsm8k/test.jsonl", "sha256": dataset, "selected_id_list_sha256": "ef" * 32},
        "prompts": {"template_sha256": "01" * 32, "prompt_stream_sha256_selected": prompt_stream},
        "lane": {
            "spec": {"name": "gsm8k", "api": "completions"},
            "overrides": {"max_tokens": max_tokens},
            "effective": {"params": {"temperature": 0.0, "max_tokens": max_tokens}, "repeats": 1, "arm": "x"},
        },
        "endpoint": {"base_url": "http://127.0.0.1:1/v1", "api": "completions", "model": "tiny"},
        "server": {"server_info": {"speculative": server_spec}},
    }


def record(arm, qid, rep, correct, *, truncated=False, tokens=None, spec=None, logprobs=None, answer=None):
    rec = {k: None for k in REQUIRED_KEYS}
    toks = tokens if tokens is not None else [100 + qid, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    rec.update(
        schema_version=1,
        run_id=f"run-{arm}",
        arm=arm,
        lane="gsm8k",
        question_id=qid,
        repeat_index=rep,
        request_seq=qid,
        prompt_sha256=f"{qid:064x}",
        request={"max_tokens": 64},
        response_text=" ".join(map(str, toks)),
        finish_reason="length" if truncated else "stop",
        truncated=truncated,
        error=None,
        attempts=[{"start": 0, "end": 1, "error": None}],
        usage={"prompt_tokens": 50, "completion_tokens": len(toks)},
        latency_s=0.1 + 0.01 * qid,
        spec=spec,
        output_token_ids=toks,
        logprobs=logprobs,
        extracted_answer=answer if answer is not None else (qid if correct else -9999999 if truncated else qid + 1),
        expected_answer=qid,
        correct=bool(correct) and not truncated,
        grade_status="truncated" if truncated else "ok",
    )
    return rec


def write_run(path: Path, arm: str, records: list[dict], *, n_planned=None, partial=False, **snap_kw) -> Path:
    path.mkdir(parents=True)
    with open(path / "responses.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    n_planned = n_planned if n_planned is not None else len(records)
    n_correct = sum(r["correct"] for r in records)
    (path / "summary.json").write_text(
        json.dumps(
            {
                "lane": "gsm8k",
                "arm": arm,
                "n_planned": n_planned,
                "n_records": len(records),
                "n_correct": n_correct,
                "accuracy": n_correct / n_planned,
                "partial": partial,
            }
        )
    )
    snap = snapshot(**snap_kw)
    (path / "manifest.json").write_text(
        json.dumps(
            {"run_id": f"run-{arm}", "arm": arm, "lane": "gsm8k", "start": snap, "end": snap, "consistent": True}
        )
    )
    return path


def greedy_records(arm: str) -> list[dict]:
    recs = []
    for q in range(N_Q):
        right = q in (A_RIGHT if arm == "A" else B_RIGHT)
        toks = [100 + q] + list(range(1, 10))
        spec = None
        lps = None
        if arm == "B":
            if q in DIVERGE_AT:
                pos = DIVERGE_AT[q]
                toks = toks[:pos] + [999] + toks[pos + 1 :]
            spec = {
                "verify_steps": 4,
                "accepted_drafts": 6,
                "accept_length": len(toks) / 4,
                "accept_histogram": [1, 1, 1, 1],
            }  # drafts 0..3 once each -> lengths 1..4
        if q == 3:  # logprobs on both arms: A chose token 4 (pos 4) with -0.10; B's 999 had -0.15 in A's top list
            lps = {
                "tokens": [str(t) for t in toks],
                "token_logprobs": [-0.01] * len(toks),
                "top_logprobs": [{str(t): -0.01} for t in toks],
            }
            if arm == "A":
                lps["token_logprobs"][4] = -0.10
                lps["top_logprobs"][4] = {"4": -0.10, "999": -0.15}
            else:
                lps["token_logprobs"][4] = -0.12
        recs.append(
            record(arm, q, 0, right, truncated=(arm == "B" and q in TRUNCATED_B), tokens=toks, spec=spec, logprobs=lps)
        )
    return recs


def hand_mcnemar(b: int, c: int) -> float:
    n, k = b + c, min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def hand_percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def hand_bootstrap(d: list[float], seed: int, n_resamples: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(n_resamples):
        idx = rng.integers(0, len(d), size=len(d))
        diffs.append(sum(d[i] for i in idx) / len(d))
    return hand_percentile(diffs, 0.025), hand_percentile(diffs, 0.975)


@pytest.fixture(scope="module")
def greedy_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("greedy")
    a = write_run(root / "A", "spec_off", greedy_records("A"))
    b = write_run(
        root / "B",
        "spec_on",
        greedy_records("B"),
        packages=("numpy==2.4.6", "torch==2.14.0"),
        server_spec={"algorithm": "block", "block_size": 3},
    )
    out = root / "cmp"
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--out", str(out), "--margin", "5", "--intended", "server.*"]
    )
    assert res.exit_code == 0, res.output
    return a, b, out, res.output, json.loads((out / "compare.json").read_text())


def test_accuracy_and_denominators(greedy_pair):
    _, _, _, _, cmp = greedy_pair
    acc = cmp["accuracy"]
    assert acc["denominator_a"] == acc["denominator_b"] == N_Q
    assert acc["a"] == pytest.approx(len(A_RIGHT) / N_Q)
    assert acc["b"] == pytest.approx(len(B_RIGHT) / N_Q)
    assert acc["diff"] == pytest.approx((len(GAINED) - len(LOST)) / N_Q)


def test_exact_mcnemar_matches_binomial_formula(greedy_pair):
    g = greedy_pair[4]["greedy"]
    assert (g["b_only"], g["a_only"]) == (len(GAINED), len(LOST))
    expected = hand_mcnemar(len(GAINED), len(LOST))
    assert expected == pytest.approx(18 / 256)
    assert g["mcnemar_p"] == pytest.approx(expected, abs=1e-12)


def test_paired_bootstrap_matches_plain_loop(greedy_pair):
    g = greedy_pair[4]["greedy"]
    bs = g["bootstrap"]
    assert (bs["n_resamples"], bs["seed"]) == (10_000, 0)
    d = [float(q in B_RIGHT) - float(q in A_RIGHT) for q in range(N_Q)]
    lo, hi = hand_bootstrap(d, seed=0, n_resamples=10_000)
    assert bs["ci_low"] == pytest.approx(lo, abs=1e-12)
    assert bs["ci_high"] == pytest.approx(hi, abs=1e-12)
    # margin 5 pt: Tango's interval decides (the bootstrap is a secondary figure)
    iv = g["interval"]
    assert iv["method"].startswith("Tango")
    expected = "non-inferior" if iv["low"] > -0.05 else ("inferior" if iv["high"] < -0.05 else "inconclusive")
    assert g["verdict"] == expected


def test_flip_list_is_complete(greedy_pair):
    flips = greedy_pair[4]["flips"]
    assert [f["question_id"] for f in flips] == sorted(GAINED + LOST)
    by_id = {f["question_id"]: f for f in flips}
    assert all(by_id[q]["direction"] == "gained" for q in GAINED)
    assert by_id[25]["direction"] == "lost"
    assert by_id[25]["answer_a"] == 25 and by_id[25]["answer_b"] == 26
    assert by_id[3]["tokens_a"] == 10 and by_id[3]["finish_reason_b"] == "stop"
    assert by_id[3]["divergence_position"] == 4


def test_agreement_divergence_and_logprob_gap(greedy_pair):
    cmp = greedy_pair[4]
    ag = cmp["agreement"]
    assert ag["n_pairs"] == N_Q
    assert ag["n_identical"] == N_Q - len(DIVERGE_AT)
    assert ag["basis_counts"] == {"token_ids": N_Q}
    assert ag["first_divergence_min"] == 1 and ag["first_divergence_max"] == 8
    flip3 = next(f for f in cmp["flips"] if f["question_id"] == 3)
    assert flip3["logprob_gap"] == pytest.approx(-0.10 - (-0.15))


def test_rates_spec_speed(greedy_pair):
    cmp = greedy_pair[4]
    tr = cmp["rates"]["truncated"]
    assert (tr["n_a"], tr["n_b"]) == (0, len(TRUNCATED_B))
    assert tr["diff"] == pytest.approx(len(TRUNCATED_B) / N_Q)
    assert cmp["rates"]["invalid"]["n_b"] == 0  # truncated records are "truncated", not "invalid"
    assert cmp["spec"]["a"]["n_records_with_spec"] == 0
    sb = cmp["spec"]["b"]
    assert sb["accept_length_mean"] == pytest.approx(10 / 4)
    assert sb["accept_length_token_weighted"] == pytest.approx(10 / 4)
    assert sb["histogram"] == {"1": N_Q, "2": N_Q, "3": N_Q, "4": N_Q}
    sp = cmp["speed"]["a"]
    assert sp["latency_median_s"] == pytest.approx(float(np.median([0.1 + 0.01 * q for q in range(N_Q)])))


def test_manifest_differences_listed_and_flagged(greedy_pair):
    md = greedy_pair[4]["manifest_diff"]
    rows = {d["key"]: d for d in md["differences"]}
    assert rows["packages.torch"]["a"] == "2.13.0" and rows["packages.torch"]["b"] == "2.14.0"
    assert rows["packages.torch"]["intended"] is False
    spec_rows = [k for k in rows if k.startswith("server.")]
    assert spec_rows and all(rows[k]["intended"] for k in spec_rows)
    assert md["n_unintended"] == 1
    assert "UNINTENDED" in greedy_pair[3]


def test_report_html_is_self_contained(greedy_pair):
    html = (greedy_pair[2] / "report.html").read_text()
    assert html.count("src='data:image/png;base64,") >= 3
    assert "id='flips'" in html
    # nothing fetched from elsewhere: no external images, stylesheets or scripts
    assert "src='http" not in html and 'src="http' not in html and "<link" not in html and "<script" not in html


def test_report_renders_in_headless_chromium(greedy_pair, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian package `chromium`); the HTML render check needs it")
    report = greedy_pair[2] / "report.html"
    env = dict(os.environ, HOME=str(tmp_path))
    proc = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    dom = proc.stdout
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert dom.count('src="data:image/png;base64,') >= 3, dom[:2000]
    flips = dom.split('id="flips"')[1].split("</table>")[0]
    assert flips.count("<tr>") == 1 + len(GAINED) + len(LOST)  # header + one row per flip


def _set_server(run: Path, server: dict, captured_at: float) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    for snap in (manifest["start"], manifest["end"]):
        snap["server"], snap["captured_at"] = server, captured_at
    (run / "manifest.json").write_text(json.dumps(manifest))


def _native_server(spec: str, port: int) -> dict:
    """A server section as `evalpipe run` records it from `evalpipe serve` (spec off or block)."""
    argv = ["evalpipe", "serve", "--port", str(port), "--speculative", spec]
    return {
        "server_info": {
            "launch": {"argv": argv, "command": " ".join(argv)},
            "server_args": {"argv": argv, "speculative": spec, "port": port},
            "speculative": {"mode": spec, "drafter": "layerskip:3" if spec == "block" else None},
        }
    }


@pytest.fixture(scope="module")
def all_wrong_pair(tmp_path_factory):
    """0/40 vs 0/40, spec off vs spec on, compared without --out from another directory."""
    root = tmp_path_factory.mktemp("allwrong") / "gsm8k"
    a = write_run(root / "spec_off-1", "spec_off", [record("A", q, 0, False) for q in range(N_Q)])
    b = write_run(root / "spec_on-1", "spec_on", [record("B", q, 0, False) for q in range(N_Q)])
    _set_server(a, _native_server("off", 30001), 1.0)
    _set_server(b, _native_server("block", 30002), 2.0)
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        res = CliRunner().invoke(compare_cmd, [str(a), str(b), "--resamples", "200", "--intended", "server.*spec*"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output
    out = root / "compare" / "spec_off-1__vs__spec_on-1"  # beside the inputs, not ./results/compare
    assert not (elsewhere / "results").exists()
    return res.output, json.loads((out / "compare.json").read_text()), (out / "report.html").read_text()


def test_verdict_on_all_wrong_arms_says_it_carries_no_information(all_wrong_pair):
    output, cmp, html = all_wrong_pair
    g = cmp["greedy"]
    assert g["both_wrong"] == N_Q and g["informative"] is False
    assert "carries no information" in g["verdict_note"]
    assert "no information" in output and "carries no information" in output
    assert "carries no information" in html


def test_restating_command_lines_are_volatile_not_unintended(all_wrong_pair):
    output, cmp, html = all_wrong_pair
    md = cmp["manifest_diff"]
    assert md["n_unintended"] == 0, md["differences"]
    assert {d["key"] for d in md["differences"]} == {
        "server.server_info.server_args.speculative",
        "server.server_info.speculative.mode",
        "server.server_info.speculative.drafter",
    }
    for key in (
        "server.server_info.launch.argv",
        "server.server_info.launch.command",
        "server.server_info.server_args.argv",
        "server.server_info.server_args.port",
        "captured_at",
    ):
        assert key in md["volatile_keys_ignored"], md["volatile_keys_ignored"]
        assert key in html and key not in output  # the report lists them; the terminal folds them into a count
    assert f"{len(md['volatile_keys_ignored'])} volatile key(s) ignored (listed in compare.json)" in output
    assert "UNINTENDED" not in output


def test_report_html_reads_as_prose(all_wrong_pair, greedy_pair):
    _, _, html = all_wrong_pair
    assert "id='no-flips'" in html and "No flips" in html and "id='flips'" not in html
    assert "not marked intended:" not in html and "intended:</li>" not in html  # no dangling list lead-in
    full = (greedy_pair[2] / "report.html").read_text()
    assert "not marked intended:</" not in full and "(see Manifest differences)" in full
    agreement = full.split("id='agreement'")[1].split("</table>")[0]
    for raw in ("share_identical", "basis_counts", "n_identical_tokens_but_text_differs"):
        assert raw not in agreement
    assert "share identical" in agreement and "compared on (pairs per basis)" in agreement
    assert "token ids: 40" in agreement


def test_refuses_mismatched_prompt_stream(tmp_path):
    a = write_run(tmp_path / "A", "spec_off", greedy_records("A"))
    b = write_run(tmp_path / "B", "spec_on", greedy_records("B"), prompt_stream="99" * 32)
    proc = run_cli("compare", a, b, "--out", tmp_path / "o", "--resamples", "200", timeout=120)
    assert proc.returncode != 0
    assert "refusing to compare" in proc.stderr and "prompt-stream hashes differ" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "compare.json").exists()
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o"), "--force", "--resamples", "200", "--no-html"]
    )
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert cmp["forced"] is True
    assert any("prompt-stream hashes differ" in r for r in cmp["forced_over"])


def test_forced_comparison_of_two_lanes_pairs_by_question(tmp_path):
    """An lm-eval import of a lane's task has a lane of its own; forced, it still pairs by question and repeat."""
    a = write_run(tmp_path / "A", "run", greedy_records("A"))
    b = write_run(tmp_path / "B", "lmeval", [{**r, "lane": "lm-eval/gsm8k_gen"} for r in greedy_records("A")])
    manifest = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**manifest, "lane": "lm-eval/gsm8k_gen"}))
    res = CliRunner().invoke(compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o"), "--no-html"])
    assert res.exit_code != 0 and "lanes differ" in res.output, res.output
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o"), "--force", "--resamples", "200", "--no-html"]
    )
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert any("lanes differ" in r for r in cmp["forced_over"])
    assert cmp["paired_keys"] == N_Q and cmp["keys_only_in_a"] == cmp["keys_only_in_b"] == []
    assert cmp["agreement"]["n_identical"] == N_Q and cmp["flips"] == []


def test_refuses_partial_run_and_other_protocol(tmp_path):
    a = write_run(tmp_path / "A", "spec_off", greedy_records("A"))
    b = write_run(tmp_path / "B", "spec_on", greedy_records("B")[:30], n_planned=N_Q, partial=True)
    c = write_run(tmp_path / "C", "spec_on", greedy_records("B"), max_tokens=128)
    d = write_run(tmp_path / "D", "spec_on", greedy_records("B"), dataset="00" * 32)
    for other, needle in ((b, "is partial"), (c, "lane protocols differ"), (d, "dataset hashes differ")):
        res = CliRunner().invoke(compare_cmd, [str(a), str(other), "--out", str(tmp_path / "o")])
        assert res.exit_code != 0 and needle in res.output, res.output
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o"), "--force", "--resamples", "200", "--no-html"]
    )
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "o" / "compare.json").read_text())
    assert cmp["paired_keys"] == 30 and len(cmp["keys_only_in_a"]) == 10
    assert cmp["accuracy"]["denominator_b"] == N_Q  # missing items stay in the denominator


# ---------------------------------------------------------------------------------------------- repeated lane

REP_A = {"q0": [1, 0, 1], "q1": [0, 0, 0], "q2": [1, 1, 1]}
REP_B = {"q0": [1, 1, 1], "q1": [0, 1, 1], "q2": [1, 1, 0]}


def repeated_records(arm: str, outcomes: dict) -> list[dict]:
    recs = []
    for qi, (q, outs) in enumerate(outcomes.items()):
        for r, ok in enumerate(outs):
            rec = record(arm, qi, r, bool(ok))
            rec.update(question_id=q, lane="aime26-x16")
            recs.append(rec)
    return recs


def exact_permutation_p(oa: dict, ob: dict) -> float:
    """Enumerate every within-question relabelling (equally likely under the null)."""

    def stat(split):
        return np.mean([sum(bb) / len(bb) - sum(aa) / len(aa) for aa, bb in split])

    observed = stat([(oa[q], ob[q]) for q in oa])
    per_q = []
    for q in oa:
        pooled = oa[q] + ob[q]
        opts = []
        for idx_b in itertools.combinations(range(len(pooled)), len(ob[q])):
            bb = [pooled[i] for i in idx_b]
            aa = [pooled[i] for i in range(len(pooled)) if i not in idx_b]
            opts.append((aa, bb))
        per_q.append(opts)
    total = extreme = 0
    for combo in itertools.product(*per_q):
        total += 1
        extreme += abs(stat(combo)) >= abs(observed) - 1e-12
    return extreme / total


def test_repeated_lane_statistics(tmp_path):
    ra, rb = repeated_records("A", REP_A), repeated_records("B", REP_B)
    for recs in (ra, rb):
        for r in recs:
            r["lane"] = "gsm8k"  # the snapshot helper describes gsm8k; lane name only has to agree
    a = write_run(tmp_path / "A", "off", ra)
    b = write_run(tmp_path / "B", "on", rb)
    res = CliRunner().invoke(compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "o" / "compare.json").read_text())
    r = cmp["repeated_stats"]
    assert "greedy" not in cmp and cmp["repeated"] is True
    pa = {q: np.mean(v) for q, v in REP_A.items()}
    pb = {q: np.mean(v) for q, v in REP_B.items()}
    d = np.array([pb[q] - pa[q] for q in REP_A])
    assert r["diff"] == pytest.approx(d.mean())
    var = sum(np.var(REP_A[q], ddof=1) / 3 + np.var(REP_B[q], ddof=1) / 3 for q in REP_A)
    assert r["se_fixed_question"] == pytest.approx(math.sqrt(var) / 3)
    assert r["se_clustered"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(3))
    iv = r["interval"]  # t interval, Q - 1 = 2 df (t table: 4.302653), on the clustered SE; margin 1 pt (the default)
    assert iv["df"] == 2
    assert iv["ci_low"] == pytest.approx(d.mean() - 4.302653 * r["se_clustered"], abs=1e-5)
    assert iv["ci_high"] == pytest.approx(d.mean() + 4.302653 * r["se_clustered"], abs=1e-5)
    assert iv["verdict"] == (
        "non-inferior" if iv["ci_low"] > -0.01 else "inferior" if iv["ci_high"] < -0.01 else "inconclusive"
    )
    assert iv["verdict"] == "inconclusive"  # 3 questions: a wide interval
    assert f"non-inferiority at -1.0 pt: {iv['verdict']}" in res.output
    assert f"smallest detectable drop {r['power']['mde_pts']:.2f} pt" in res.output
    assert f"-1 pt needs {r['power']['questions_needed_for_margin']} questions at these repeats" in res.output
    exact = exact_permutation_p(REP_A, REP_B)
    assert r["permutation_test"]["p_value"] == pytest.approx(exact, abs=0.02)
    assert [q["rate_b"] for q in r["per_question"]] == [pb[q] for q in REP_A]
    html = (tmp_path / "o" / "report.html").read_text()
    assert "id='per-question'" in html and "data:image/png;base64," in html


# ---------------------------------------------------------------------------------------------- bench folders


def write_bench(path: Path, values: list[float], input_sha: str = "aa") -> Path:
    path.mkdir(parents=True)
    reqs = [{"round": -1, "warmup": True, "decode_tokens_per_s": 1.0, "ttft_s": 9.0, "total_s": 9.0}]
    reqs += [
        {"round": i, "warmup": False, "decode_tokens_per_s": v, "ttft_s": 0.1 * (i + 1), "total_s": 1.0 + i}
        for i, v in enumerate(values)
    ]
    (path / "bench.json").write_text(
        json.dumps(
            {
                "kind": "bench",
                "config": {
                    "input_len": 16,
                    "output_len": 32,
                    "concurrency": 1,
                    "input_ids_sha256": input_sha,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                "requests": reqs,
            }
        )
    )
    return path


def test_bench_ratio_of_medians(tmp_path):
    va, vb = [100.0, 104.0, 98.0, 101.0, 60.0], [150.0, 149.0, 155.0, 151.0, 148.0]
    a, b = write_bench(tmp_path / "A", va), write_bench(tmp_path / "B", vb)
    res = CliRunner().invoke(compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "o" / "compare.json").read_text())["metrics"]["decode_tokens_per_s"]
    assert m["ratio"] == pytest.approx(150.0 / 100.0)
    assert m["values_a"] == va  # warm-up dropped, low outlier kept
    rng = np.random.default_rng(0)
    ia = rng.integers(0, 5, size=(10_000, 5))
    ib = rng.integers(0, 5, size=(10_000, 5))
    ratios = [float(np.median([vb[j] for j in ib[r]]) / np.median([va[j] for j in ia[r]])) for r in range(10_000)]
    assert m["ci_low"] == pytest.approx(hand_percentile(ratios, 0.025))
    assert m["ci_high"] == pytest.approx(hand_percentile(ratios, 0.975))
    assert "data:image/png;base64," in (tmp_path / "o" / "report.html").read_text()
    assert "measured value(s) in an arm" not in res.output
    # separated samples: the throughput verdict and its MDE (power.ratio_mde_pct on the log values' spread)
    assert m["verdict"] == "higher" and m["samples_overlap"] is False
    se = math.sqrt(math.pi / 2) * math.sqrt(np.var(np.log(va), ddof=1) / 5 + np.var(np.log(vb), ddof=1) / 5)
    assert m["mde_pct"] == pytest.approx(100 * (math.exp((1.959964 + 0.841621) * se) - 1), rel=1e-5)
    assert "[bold]higher[/]" not in res.output and "higher; smallest detectable change" in res.output
    assert f"{m['mde_pct']:.1f}%" in res.output and "overlap" not in res.output
    # overlapping samples: no measurable change, and the call for a fixed-input, warmed, repeated comparison
    near = [99.0, 103.0, 97.0, 102.0, 101.0]
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(write_bench(tmp_path / "B4", near)), "--out", str(tmp_path / "o4"), "--no-html"]
    )
    m = json.loads((tmp_path / "o4" / "compare.json").read_text())["metrics"]["decode_tokens_per_s"]
    assert m["verdict"] == "no measurable change" and m["samples_overlap"] is True
    assert "no measurable change" in res.output
    assert (
        "samples of A and B overlap: attributing a gain needs a fixed-input, warmed, repeated comparison" in res.output
    )
    gated = CliRunner().invoke(compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o5"), "--fail-on", "inferior"])
    assert gated.exit_code == 2 and "not bench folders" in gated.output
    few = CliRunner().invoke(
        compare_cmd,
        [
            str(write_bench(tmp_path / "A2", va[:2])),
            str(write_bench(tmp_path / "B2", vb[:3])),
            "--out",
            str(tmp_path / "o3"),
            "--no-html",
        ],
    )
    assert few.exit_code == 0 and "only 2 measured value(s) in an arm" in few.output, few.output
    c = write_bench(tmp_path / "C", vb, input_sha="bb")
    res = CliRunner().invoke(compare_cmd, [str(a), str(c), "--out", str(tmp_path / "o2")])
    assert res.exit_code != 0 and "input_ids_sha256" in res.output


# ---------------------------------------------------------------------------------------------- real run folders


def test_compare_on_folders_written_by_evalpipe_run(tmp_path):
    """Two real `evalpipe run` subprocesses against scripted peers (always right vs. mixed), then compare."""
    from tests.support.scripted_server import answer_table, scripted_server

    answers = answer_table("gsm8k")
    dirs = {}
    for arm, mode in (("spec_off", "correct"), ("spec_on", "mixed")):
        with scripted_server(
            mode=mode,
            answers=answers,
            fail_first=0,
            spec={"verify_steps": 2, "accept_histogram": [0, 2]} if mode == "mixed" else None,
        ) as url:
            proc = run_cli(
                "run",
                "gsm8k",
                "--base-url",
                url,
                "--num-examples",
                "30",
                "--arm",
                arm,
                "--out",
                tmp_path,
                "--max-retries",
                "0",
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr[-3000:]
        dirs[arm] = next((tmp_path / "gsm8k").glob(f"{arm}-*"))
    res = CliRunner().invoke(
        compare_cmd,
        [
            str(dirs["spec_off"]),
            str(dirs["spec_on"]),
            "--out",
            str(tmp_path / "c"),
            "--resamples",
            "1000",
            "--intended",
            "server.*",
            "--intended",
            "base_url",
        ],
    )
    assert res.exit_code == 0, res.output
    cmp = json.loads((tmp_path / "c" / "compare.json").read_text())
    recs = {
        arm: {r["question_id"]: r for r in map(json.loads, (d / "responses.jsonl").read_text().splitlines())}
        for arm, d in dirs.items()
    }
    summary_b = json.loads((dirs["spec_on"] / "summary.json").read_text())
    assert cmp["accuracy"]["b"] == pytest.approx(summary_b["accuracy"])
    assert cmp["accuracy"]["a"] == 1.0
    expected_flips = sorted(
        q for q in recs["spec_off"] if recs["spec_off"][q]["correct"] != recs["spec_on"][q]["correct"]
    )
    assert [f["question_id"] for f in cmp["flips"]] == expected_flips and expected_flips
    assert cmp["greedy"]["mcnemar_p"] == pytest.approx(hand_mcnemar(0, len(expected_flips)))
    assert cmp["rates"]["truncated"]["n_b"] == summary_b["n_truncated"]
    assert cmp["spec"]["b"]["accept_length_token_weighted"] is not None


def test_holm_adjustment_by_hand():
    from evalpipe.compare.stats import holm

    # sorted p: 0.01 (x3) = 0.03, 0.02 (x2) = 0.04, 0.04 (x1) = 0.04; None stays None
    adj = holm([0.04, 0.01, None, 0.02])
    assert adj[2] is None
    assert [adj[0], adj[1], adj[3]] == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])


def test_refuses_a_run_or_bench_compared_with_itself(tmp_path):
    """The same folder twice (a pasted path) used to print a clean 'non-inferior, 100% identical' verdict."""
    a = write_run(tmp_path / "A", "spec_off", greedy_records("A"))
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    bench = write_bench(tmp_path / "bench", [100.0, 101.0])
    for x, y, why in ((a, a, "same run"), (a, copy, "same run"), (bench, bench, "same bench")):
        res = CliRunner().invoke(compare_cmd, [str(x), str(y), "--out", str(tmp_path / "o"), "--no-html"])
        assert res.exit_code == 1 and "refusing to compare" in res.output and why in res.output, res.output
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(a), "--out", str(tmp_path / "o"), "--no-html", "--force", "--resamples", "200"]
    )
    assert res.exit_code == 0, res.output
    assert any("same run" in r for r in json.loads((tmp_path / "o" / "compare.json").read_text())["forced_over"])


def test_repeated_interval_decides_non_inferiority():
    """The clustered interval's verdict on many questions: B two points worse on every question is inferior at a
    one-point margin; the same rates on both arms are non-inferior; an all-wrong pair is not informative."""
    from evalpipe.compare.stats import compare_repeated

    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))  # fresh outcomes every run
    a = {f"q{i}": rng.integers(0, 2, 50).astype(float) for i in range(400)}
    same = compare_repeated(a, {q: v.copy() for q, v in a.items()}, n_permutations=200, margin_pts=1.0)
    assert same["interval"]["verdict"] == "non-inferior" and same["diff"] == 0.0
    worse = {q: np.where(np.arange(50) < 5, 0.0, v) for q, v in a.items()}  # 5 of 50 forced wrong per question
    r = compare_repeated(a, worse, n_permutations=200, margin_pts=1.0)
    assert r["diff"] < -0.01 and r["interval"]["ci_high"] < -0.01 and r["interval"]["verdict"] == "inferior"
    none = compare_repeated({"q": np.zeros(4)}, {"q": np.zeros(4)}, n_permutations=10, margin_pts=1.0)
    assert none["informative"] is False and none["interval"]["verdict"] == "not-evaluable"
    assert r["interval"]["df"] == 399 and r["power"]["repeats_per_question"] == 50
    assert 0 < r["power"]["mde_pts"] and r["power"]["variance_basis"] == "observed"
    # all right in both arms is informative, but sd(d_i) = 0 must not shrink the interval to a point: two questions
    # cannot support -1 pt, 400 can (the SE comes from the exact bound on the minority outcome)
    for q, verdict in ((2, "inconclusive"), (400, "non-inferior")):
        right = {f"q{i}": np.ones(16) for i in range(q)}
        r = compare_repeated(right, {k: v.copy() for k, v in right.items()}, n_permutations=10, margin_pts=1.0)
        assert r["informative"] and r["interval"]["ci_low"] < 0 < r["interval"]["ci_high"]
        assert r["interval"]["verdict"] == verdict and "bound" in r["power"]["variance_basis"]


@pytest.mark.parametrize("other_difference", [False, True])
def test_speculation_only_difference_is_taken_as_intended_without_flags(tmp_path, other_difference):
    """Without --intended, arms that differ only in speculation settings get one line saying those are the intended
    difference; one more difference elsewhere (a package) and nothing is implied: every row stands as not intended."""
    a = write_run(tmp_path / "off", "off", [record("A", q, 0, q % 2) for q in range(10)])
    packages = ("numpy==2.4.7", "torch==2.13.0") if other_difference else ("numpy==2.4.6", "torch==2.13.0")
    b = write_run(tmp_path / "block", "block", [record("B", q, 0, q % 2) for q in range(10)], packages=packages)
    _set_server(a, _native_server("off", 30001), 1.0)
    _set_server(b, _native_server("block", 30002), 2.0)
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--resamples", "200", "--no-html", "--out", str(tmp_path / "cmp")]
    )
    assert res.exit_code == 0, res.output
    md = json.loads((tmp_path / "cmp" / "compare.json").read_text())["manifest_diff"]
    spec_keys = {
        "server.server_info.server_args.speculative",
        "server.server_info.speculative.mode",
        "server.server_info.speculative.drafter",
    }
    assert spec_keys <= {d["key"] for d in md["differences"]}
    if other_difference:
        assert md["intended_implied"] is None and md["n_unintended"] == len(spec_keys) + 1
        assert "UNINTENDED?" in res.output
    else:
        assert md["n_unintended"] == 0 and md["n_intended"] == len(spec_keys)
        assert "differ only in speculation settings (3 key(s)): taken as the intended difference" in res.output
        assert "UNINTENDED" not in res.output and "server_args.speculative" not in res.output
