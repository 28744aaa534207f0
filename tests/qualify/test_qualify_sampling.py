"""`evalpipe qualify --gates sampling` and the planted faults it exists to catch.

Statistics first, by simulation (categorical distributions drawn from a Dirichlet, truncated to the top K like a
server's logprobs): a correct sampler gives uniform PIT values and calibrated p-values; a sampler that takes the
argmax, or that resamples from p after rejecting a point-mass draft, fails. Then real `evalpipe serve` processes:
the gate passes on the window-64 model with speculation off and on (seed 2; the fault matrix's clean rows run seed 1),
and its p-values are recomputed from its folder alone. Its failures on the planted faults (`--debug-fault
greedy-sampling`, `residual-from-target` with the ngram drafter) are in test_fault_matrix.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from evalpipe.qualify.sampling import ALPHA, PitSample, hit_test, lookup_candidate, pit_tests, verdict
from tests.support.core_helpers import run_sampling_gate
from tests.support.server_harness import ServerProcess

K = 20
VOCAB = 40


def simulate(rng: np.random.Generator, n_seqs: int, length: int, sampler: str) -> PitSample:
    """Sequences over a VOCAB-token alphabet whose next-token distribution is a fresh Dirichlet draw per position;
    the server 'reports' the top K. sampler: 'exact', 'greedy', or 'residual-from-target' (an ngram draft d, the
    lookup candidate, accepted with probability p(d), and on rejection a fresh draw from p)."""
    sample = PitSample()
    names = [f"t{i}" for i in range(VOCAB)]
    for _ in range(n_seqs):
        tokens, logprobs, tops = [], [], []
        for _ in range(length):
            p = rng.dirichlet(np.full(VOCAB, 0.3))
            if sampler == "greedy":
                x = int(np.argmax(p))
            else:
                x = int(rng.choice(VOCAB, p=p))
                draft = lookup_candidate(tokens)
                if sampler == "residual-from-target" and draft is not None:
                    d = names.index(draft)
                    x = d if rng.random() < p[d] else int(rng.choice(VOCAB, p=p))
            order = np.argsort(-p)[:K]
            tops.append({names[i]: math.log(p[i]) for i in order})
            tokens.append(names[x])
            logprobs.append(math.log(p[x]))
        sample.add_response(tokens, logprobs, tops, rng)
    return sample


def test_pit_of_a_correct_sampler_is_uniform_and_its_p_values_are_calibrated():
    rng = np.random.default_rng(7)
    sample = simulate(rng, 100, 60, "exact")
    assert sample.in_tail > 0 and sample.logprob_mismatches == 0
    assert stats.kstest(sample.u, "uniform").pvalue > 0.001  # scipy's KS, not ours
    # across many small runs the gated p-values are uniform: a false-alarm rate of alpha, not more
    p_values = {key: [] for key in ("chi2_p", "collapse_p", "repeat_p")}
    for _ in range(150):
        tests = pit_tests(simulate(rng, 5, 40, "exact"), bins=10)
        for key in p_values:
            p_values[key].append(tests[key])
    for key, ps in p_values.items():
        assert stats.kstest(ps, "uniform").pvalue > 0.001, key
        assert np.mean(np.asarray(ps) < 0.05) < 0.12, key


def test_a_greedy_sampler_and_a_residual_from_target_verifier_fail():
    rng = np.random.default_rng(11)
    greedy = simulate(rng, 20, 50, "greedy")
    tests = pit_tests(greedy, bins=20)
    assert tests["collapse_z"] > 10 and tests["chi2_p"] < ALPHA
    assert "greedy collapse" in verdict(tests, greedy.informative)
    biased = simulate(rng, 40, 50, "residual-from-target")
    tests = pit_tests(biased, bins=20)
    assert tests["repeat_z"] > 4 and tests["repeat_p"] < ALPHA
    assert "context-repeat bias" in verdict(tests, biased.informative)


def test_pit_edge_cases():
    # the sampled token outside the top K lands uniformly inside the tail bin
    s = PitSample()
    s.add_position("z", -5.0, {"a": math.log(0.5), "b": math.log(0.25)}, v=0.5)
    assert s.u == [pytest.approx(0.875)] and s.in_tail == 1 and s.argmax_hits == 0
    # ties are ordered by text; the argmax hit is the first in that order
    s = PitSample()
    s.add_position("a", math.log(0.5), {"b": math.log(0.5), "a": math.log(0.5)}, v=0.0)
    assert s.u == [0.0] and s.argmax_hits == 1
    # reported mass above 1 (rounding) is clipped; a mismatching reported logprob is counted
    s = PitSample()
    s.add_position("b", math.log(0.9), {"a": math.log(0.6), "b": math.log(0.6)}, v=1.0)
    assert s.u == [1.0] and s.logprob_mismatches == 1
    # a sampled token a server adds beyond the top k (vLLM does) goes back to the tail, and is counted
    s = PitSample()
    s.add_response(
        ["z"],
        [math.log(0.01)],
        [{"a": math.log(0.5), "b": math.log(0.25), "z": math.log(0.01)}],
        np.random.default_rng(0),
        k=2,
    )
    assert s.in_tail == 1 and s.extra_entries_dropped == 1 and 0.75 <= s.u[0] <= 1.0
    # no variance (p_max = 1 everywhere): z = 0, p = 1; nothing sampled: no p-values
    assert hit_test(3, [1.0, 1.0, 1.0]) == (3.0, 0.0, 1.0)
    assert pit_tests(PitSample(), bins=20)["chi2_p"] is None
    # too few informative tokens is a failure with its reason, never a pass
    assert "informative tokens" in verdict({"chi2_p": 0.5, "collapse_p": 0.5, "repeat_p": 0.5}, informative=3.0)
    # the lookup candidate: latest earlier occurrence of the longest suffix (3 tokens), else the last token
    assert lookup_candidate(list("abcxabcyab")) == "c"
    assert lookup_candidate(list("abcab")) == "c" and lookup_candidate(list("abcabd")) == "d"
    assert lookup_candidate(list("xyz")) == "z" and lookup_candidate([]) is None


def test_lookup_candidate_is_what_the_native_ngram_drafter_proposes():
    from evalpipe.engine.spec.drafters import NgramDrafter

    rng = np.random.default_rng(3)
    drafter = NgramDrafter(max_ngram=3)
    for _ in range(300):
        ids = rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 30))).tolist()
        assert lookup_candidate(ids) == drafter.lookup(ids, 1)[0], ids


def qualify_sampling(server: ServerProcess, out: Path, tokens: int, seed: int) -> tuple[int, dict]:
    proc, gate = run_sampling_gate(server.base + "/v1", out, tokens, seed)
    assert gate["gate"] == "sampling"
    return proc.returncode, gate


# The window-64 model: over 1000 of its 1500 sampled tokens carry information (the default model is surer of its
# tokens: 232 and 294 informative tokens in the same 1500, so the gate has less power there)
@pytest.fixture(scope="module", params=["off", "block"])
def clean_server(request):
    server = ServerProcess(
        *(["--speculative", "block"] if request.param == "block" else []), model="evalpipe-skills-dsv4-w64"
    )
    yield server
    server.stop()


# The gate's run on each clean server: its token budget and seed. One seed per server: tests/engine/test_fault_matrix.py
# passes the same two servers through the gate at seed 1 and 500 tokens (its clean rows), so this seed is another
# draw, not a repeat. On a correct sampler the gate fails with probability at most 3 x ALPHA = 0.003 at any budget
# (Bonferroni over its three tests); the budget sets its power. At 600 tokens over 300 carry information (I = sum of
# 1 - p_max): a sampler that always takes the argmax scores I hits above their expectation against a standard
# deviation of at most sqrt(I), so collapse z >= sqrt(300) = 17, where ALPHA needs 3.3 (the fault matrix flags
# greedy-sampling at 400 tokens).
GATE_TOKENS, GATE_SEED, MIN_INFORMATIVE_HERE = 600, 2, 300


@pytest.fixture(scope="module")
def gated(clean_server, tmp_path_factory) -> tuple[int, dict, Path]:
    """The gate's run on the clean server: (exit code, the gate's result, its folder), read by both tests below."""
    folder = tmp_path_factory.mktemp("sampling") / f"q{GATE_SEED}"
    return (*qualify_sampling(clean_server, folder, GATE_TOKENS, GATE_SEED), folder)


def test_gate_passes_on_the_default_server_with_speculation_off_and_on(gated):
    code, gate, folder = gated
    notes = gate["notes"]
    assert code == 0 and gate["verdict"] == "pass", gate["reason"]
    assert notes["tokens"] >= GATE_TOKENS and notes["seed"] == GATE_SEED
    assert notes["informative_tokens"] > MIN_INFORMATIVE_HERE
    assert min(notes["chi2_p"], notes["collapse_p"], notes["repeat_p"]) >= ALPHA
    assert sum(notes["pit_histogram"]) == notes["tokens"] and notes["logprob_mismatches"] == 0
    assert notes["server_logprobs_mode"] == "raw_logprobs"
    assert "PIT histogram" in (folder / "report.html").read_text()


def recompute_from_files(folder: Path) -> dict:
    """The gate's three p-values from `qualify.json`'s settings and the tokens file alone, written out again here
    with numpy and scipy (the lookup candidate is the one tested against the native drafter above)."""
    notes = json.loads((folder / "qualify.json").read_text())["gates"][0]["notes"]
    u, hits, p_max, rep_hits, rep_p = [], 0, [], 0, []
    for line in (folder / notes["tokens_file"]).read_text().splitlines():
        resp = json.loads(line)
        for j, (tok, top, v) in enumerate(zip(resp["tokens"], resp["top_logprobs"], resp["v"])):
            if top is None:
                continue
            order = sorted(top, key=lambda t: (-top[t], t))
            probs = np.exp([top[t] for t in order])
            rank = order.index(tok) if tok in top else None
            before = probs[:rank].sum() if rank is not None else min(1.0, probs.sum())
            own = probs[rank] if rank is not None else 1.0 - min(1.0, probs.sum())
            u.append(min(1.0, before + v * own))
            hits += rank == 0
            p_max.append(probs[0])
            cand = lookup_candidate(resp["tokens"][:j])
            if cand in top:
                rep_p.append(math.exp(top[cand]))
                rep_hits += tok == cand

    def z_p(k, ps):
        ps = np.asarray(ps)
        return 2 * stats.norm.sf(abs((k - ps.sum()) / math.sqrt((ps * (1 - ps)).sum())))

    counts = np.histogram(u, bins=notes["bins"], range=(0, 1))[0]
    return {
        "tokens": len(u),
        "chi2_p": stats.chisquare(counts).pvalue,
        "collapse_p": z_p(hits, p_max),
        "repeat_p": z_p(rep_hits, rep_p),
        "notes": notes,
    }


def test_p_values_are_recomputed_from_the_folder_alone(gated):
    folder = gated[2]  # the gate run the test above reads
    again = recompute_from_files(folder)
    notes = again.pop("notes")
    assert again["tokens"] == notes["tokens"] >= GATE_TOKENS
    for key in ("chi2_p", "collapse_p", "repeat_p"):
        assert again[key] == pytest.approx(notes[key], rel=1e-9, abs=1e-300), key
    assert sum(notes["pit_histogram"]) == notes["tokens"]


def test_the_engine_sampler_hits_the_reported_argmax_at_the_rate_the_logprobs_say():
    """The greedy-collapse count on the engine's own sampler (`sample(sampling_probs(...))`, T = 1, top_p 1) against
    the distribution the server reports (`token_logprobs`), over 100,000 fresh draws: rows of random logits at the
    default model's vocabulary, a fifth of them with the top two logits tied exactly (ties are where a float32 vs
    bfloat16 or an argmax-order mismatch would show). A sampler or report off by 0.01 in p_max gives |z| > 20."""
    import torch

    from evalpipe.engine.sampling import generator_for, sample, sampling_probs, token_logprobs
    from evalpipe.engine.sampling_params import SamplingParams

    seed = int(np.random.default_rng().integers(1 << 31))
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, seed=seed)
    sampler = generator_for(params)
    hits, p_max = 0, []
    for _ in range(2):
        logits = torch.randn(50_000, 272, generator=gen) * torch.rand(50_000, 1, generator=gen) * 6
        tied = torch.rand(50_000, generator=gen) < 0.2
        top2 = logits.topk(2, dim=-1)
        logits[tied, top2.indices[tied, 1]] = top2.values[tied, 0]
        tokens = sample(sampling_probs(logits, params), sampler)
        reported = token_logprobs(logits, tokens, top_k=1)
        first = torch.tensor([top[0][0] for _, top in reported])  # the reported argmax (lowest id among ties)
        hits += int((tokens == first).sum())
        p_max += [math.exp(top[0][1]) for _, top in reported]
    _, z, p = hit_test(hits, p_max)
    assert abs(z) < 4.5, (seed, z)
    assert abs(np.mean(p_max) - 0.5) < 0.45  # a mix of sharp and flat rows, not a degenerate test


def test_the_collapse_statistic_is_standard_normal_under_the_null():
    """4,000 simulated gate runs of 12,000 tokens whose p_max spread like a language model's (Beta(0.8, 0.6)):
    z's mean is 0 within 4 standard errors, its sd 1 within 5% (4.5 standard errors of a sample sd), and the
    two-sided p-values are uniform (scipy's KS at 1e-4). Correct code fails about 2 runs in 10,000; with 2,000 runs
    the sd bound was 3.2 standard errors and the KS bound 1e-3, about 3 in 1,000."""
    rng, runs = np.random.default_rng(), 4000
    zs, ps = [], []
    for _ in range(runs):
        p_max = rng.beta(0.8, 0.6, 12_000)
        hits = int((rng.random(12_000) < p_max).sum())
        _, z, p = hit_test(hits, p_max)
        zs.append(z)
        ps.append(p)
    assert abs(np.mean(zs)) < 4 / math.sqrt(runs) and abs(np.std(zs) - 1) < 0.05
    assert stats.kstest(ps, "uniform").pvalue > 1e-4


def test_the_residual_fault_power_benchmark_runs_in_smoke_mode(tmp_path):
    """benchmarks/harness/residual_fault_power.py --smoke (README's tokens-to-detect figures): in process on the default
    model with the ngram drafter, every drafted position's f moves the draft token up, so the repeat drift is
    positive and every statistic's token count is a positive number. The script is run by
    tests/support/cli_fork_server.run_forked (forked from its `torch` server, as the benchmark smoke runs are)."""
    import os

    from tests.support.cli_fork_server import run_forked

    out = tmp_path / "power.json"
    module, argv = "benchmarks.harness.residual_fault_power", ["--smoke", "--drafter", "ngram", "--json", str(out)]
    repo = str(Path(__file__).resolve().parents[2])
    proc = run_forked(argv, module=module, env=dict(os.environ), cwd=repo, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    pred = data["prediction"]
    assert pred["positions"] > 20 and pred["drafted_share"] > 0.5
    assert pred["repeat"]["mu"] > 0 and pred["oracle_info"] > 0
    assert all(0 < n < float("inf") for row in pred["tokens"].values() for key, n in row.items() if key != "chi2")
    assert data["simulation"]["replicas"] == 3 and data["simulation"]["tokens"] == 500
