"""How many tokens the sampling gate needs to catch `residual-from-target` with a given drafter.

Measured in process on the CPU with the engine the server runs (`build(EngineConfig(...))`, the real Engine loop):
the gate's own prompts (`qualify.sampling.prompts`, seed --seed), T = 1, top_p 1, 64 tokens each, the exact sampler.
At every emitted token we keep the target's distribution p and, where the token sat at a drafted position, the
drafter's q there. A verifier with the fault emits at a drafted position
    f(x) = min(p(x), q(x)) + r p(x),  r = 1 - sum_y min(p(y), q(y))   (accept, else resample from p)
instead of p = min(p, q) + max(0, p - q); bonus tokens (a whole block accepted) and the first token are exact.
The gate's statistics are computed against p as the server reports it (top 20 by logprob, ties by text, the rest
one tail bin), so per position the fault moves:
- the PIT: the probability of each of the B equal bins is the f-mass of the u-interval it covers; over n tokens
  Pearson's chi-square is noncentral chi-square(B - 1, lambda) with lambda = n B sum_b (pi_b - 1/B)^2, pi_b the
  bins' probabilities averaged over positions (Cohen's effect size w^2; biases of opposite sign cancel);
- the greedy-collapse and context-repeat counts: each position adds f(t) - p(t) to the expected hits (t the argmax,
  or the prompt-lookup candidate where it is in the top 20), against a null variance sum p(t)(1 - p(t)), so
  z ~ Normal(sqrt(n) mu / s0, s1 / s0) (mu, s0^2, s1^2: per-token means of the drift, p(1 - p) and f(1 - f)).
A bound for any statistic, API-only or not: the likelihood-ratio test that knows q needs n = (z_alpha + z_power)^2 / I
tokens, I the mean chi-square divergence sum (f - p)^2 / p per token (the information in a small shift).
Tokens for p < alpha at 50% and 90% power follow (scipy's ncx2 and norm). The formula is then checked by
simulation: tokens drawn from f at positions resampled from the measured ones, put through the gate's own
`PitSample.add_position` and `pit_tests`, and the simulated mean chi-square and z compared with the predicted ones.

    python -m benchmarks.harness.residual_fault_power [--drafter layerskip:4] [--responses 200] [--sim-tokens 20000]
    python -m benchmarks.harness.residual_fault_power --smoke      # seconds: 4 responses, 16 tokens, small simulation
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch
from scipy import stats

from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling import sampling_probs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import make_sequences
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.qualify.sampling import (
    HIST_BINS,
    MAX_TOKENS,
    TOP_K,
    PitSample,
    hit_test,
    lookup_candidate,
    pit_tests,
    prompts,
)


def measure(model: str, drafter: str, n_responses: int, max_tokens: int, seed: int, batch: int) -> list[list[dict]]:
    """Per response, per emitted token: {"token", "p" (float64 [V]), "q" ([V] or None: not a drafted position)}.
    The first token (sampled at prefill) has p None: it is exact under the fault and only counted."""
    config = EngineConfig(model=model, speculative="block", drafter=drafter, max_batch=batch, max_seq_len=512)
    runner, decoder = build(config)
    assert isinstance(decoder, SpeculativeDecoder)
    tokenizer = load_tokenizer(None)
    record: dict[int, list[dict]] = {}
    plain_accept = decoder.accept

    def recording_accept(seq, logits, argmax=None, samples=None):
        spec = seq.spec
        drafts, q = list(spec.drafts), spec.q
        p = sampling_probs(logits, seq.params).double()
        tokens = plain_accept(seq, logits, argmax, samples)
        rows = record.setdefault(seq.id, [])
        for i, tok in enumerate(tokens):
            drafted = i < len(drafts)
            rows.append({"token": tok, "p": p[i].numpy(), "q": q[i].double().numpy() if drafted else None})
        return tokens

    decoder.accept = recording_accept
    engine = Engine(runner, tokenizer, max_batch=batch, decoder=decoder)
    texts = prompts(seed * 1_000_003, n_responses)
    out: list[list[dict]] = []
    for start in range(0, n_responses, batch):
        seqs = []
        for i, text in enumerate(texts[start : start + batch]):
            params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=seed * 7919 + start + i)
            seq = make_sequences(tokenizer.encode_prompt(text), params, 1, lambda ev: None)[0]
            seqs.append(seq)
            engine.submit([seq])
        while any(s.finish_reason is None for s in seqs):
            engine.step()
        for seq in seqs:
            rows = [{"token": seq.output[0], "p": None, "q": None}] + record.pop(seq.id, [])
            assert [r["token"] for r in rows[: len(seq.output)]] == seq.output
            out.append(rows[: len(seq.output)])
    return out


def faulty(p: np.ndarray, q: np.ndarray | None) -> np.ndarray:
    """The fault's output distribution at a position: min(p, q) + r p at a drafted one, p elsewhere."""
    if q is None:
        return p
    overlap = np.minimum(p, q)
    return overlap + (1.0 - overlap.sum()) * p


def position_effects(responses: list[list[dict]], texts: list[str], bins: int = HIST_BINS, k: int = TOP_K) -> dict:
    """Per measured position: the bin probabilities of u under f, the argmax and candidate drifts and variances,
    and what a simulation needs (the reported top K, f)."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    rows = []
    for resp in responses:
        history: list[str] = []
        for pos in resp:
            p, q = pos["p"], pos["q"]
            if p is None:
                history.append(texts[pos["token"]])
                continue
            f = faulty(p, q)
            top = sorted(np.argsort(-p)[:k].tolist(), key=lambda t: (-math.log(p[t]), texts[t]))
            top_p = np.array([p[t] for t in top])
            knots_p = np.concatenate([[0.0], np.cumsum(top_p), [1.0]])
            knots_p[-2] = min(knots_p[-2], 1.0)
            knots_f = np.concatenate([[0.0], np.cumsum([f[t] for t in top]), [1.0]])
            cdf_f = np.interp(edges, knots_p, knots_f)  # u's CDF under f is linear inside each token's interval
            cand = lookup_candidate(history)
            cand_id = next((t for t in top if texts[t] == cand), None)
            rows.append(
                {
                    "pi": np.diff(cdf_f),
                    "a_p": p[top[0]],
                    "a_f": f[top[0]],
                    "drafted": q is not None,
                    "c_p": p[cand_id] if cand_id is not None else None,
                    "c_f": f[cand_id] if cand_id is not None else None,
                    "top": top,
                    "f": f,
                    "p": p,
                    "cand": cand_id,
                    "hit": pos["token"] == top[0],
                    "chi2_div": float(((f - p) ** 2 / np.maximum(p, 1e-300)).sum()),
                }
            )
            history.append(texts[pos["token"]])
    return {"rows": rows, "counted": sum(len(r) for r in responses), "bins": bins}


def hit_effect(pairs: list[tuple[float, float]], share: float) -> dict:
    """Per token of the run: the mean drift f - p, null variance p(1 - p), alternative variance f(1 - f), over the
    positions that enter the count (`share` of the tokens)."""
    p = np.array([a for a, _ in pairs])
    f = np.array([b for _, b in pairs])
    return {
        "mu": share * float((f - p).mean()),
        "mu_se": share * float((f - p).std() / math.sqrt(len(p))),
        "s0": math.sqrt(share * float((p * (1 - p)).mean())),
        "s1": math.sqrt(share * float((f * (1 - f)).mean())),
    }


def tokens_for_z(effect: dict, alpha: float, power: float) -> float:
    """Tokens for a two-sided z test at alpha to reject with `power`: sqrt(n) = (z_a/2 s0 + z_power s1) / |mu|."""
    if effect["mu"] == 0:
        return math.inf
    root = (stats.norm.isf(alpha / 2) * effect["s0"] + stats.norm.ppf(power) * effect["s1"]) / abs(effect["mu"])
    return root**2


def tokens_for_chi2(lam_per_token: float, df: int, alpha: float, power: float) -> float:
    """Tokens n with P(noncentral chi-square(df, n lam) > the null's 1 - alpha quantile) = power (bisection)."""
    if lam_per_token <= 0:
        return math.inf
    crit = stats.chi2.isf(alpha, df)
    lo, hi = 1.0, 1.0
    while stats.ncx2.sf(crit, df, hi * lam_per_token) < power:
        hi *= 2
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if stats.ncx2.sf(crit, df, mid * lam_per_token) < power else (lo, mid)
    return hi


def predict(eff: dict, alphas=(0.01, 0.001)) -> dict:
    rows, counted, bins = eff["rows"], eff["counted"], eff["bins"]
    measured_share = len(rows) / counted  # the first tokens: exact, uniform PIT, no drift
    pi = measured_share * np.mean([r["pi"] for r in rows], axis=0) + (1 - measured_share) / bins
    lam = bins * float(((pi - 1.0 / bins) ** 2).sum())
    collapse = hit_effect([(r["a_p"], r["a_f"]) for r in rows], measured_share)
    cand = [(r["c_p"], r["c_f"]) for r in rows if r["c_p"] is not None]
    repeat = hit_effect(cand, measured_share * len(cand) / len(rows)) if cand else None
    # the likelihood-ratio test that knows q (no API-only statistic can beat it): n ~ (z_a + z_power)^2 / I, I the
    # mean chi-square divergence of f from p per token (the Fisher information of a small shift)
    info = measured_share * float(np.mean([r["chi2_div"] for r in rows]))
    out = {
        "positions": counted,
        "drafted_share": sum(r["drafted"] for r in rows) / counted,
        "oracle_info": info,
        "chi2_lambda_per_token": lam,
        "collapse": collapse,
        "repeat": repeat,
        "tokens": {},
    }
    for alpha in alphas:
        for power in (0.5, 0.9):
            key = f"alpha {alpha:g}, power {power:g}"
            out["tokens"][key] = {
                "chi2": tokens_for_chi2(lam, bins - 1, alpha, power),
                "collapse": tokens_for_z(collapse, alpha, power),
                "repeat": tokens_for_z(repeat, alpha, power) if repeat else math.inf,
                "oracle LR": (stats.norm.isf(alpha) + stats.norm.ppf(power)) ** 2 / info if info > 0 else math.inf,
            }
    return out


def simulate(eff: dict, texts: list[str], n_tokens: int, replicas: int, rng: np.random.Generator) -> dict:
    """The gate's own statistics on tokens drawn from f at positions drawn from the measured ones (the first,
    exact tokens in their measured share, drawn from p of a random measured position)."""
    rows, share = eff["rows"], len(eff["rows"]) / eff["counted"]
    chi2s, zc, zr = [], [], []
    for _ in range(replicas):
        sample = PitSample()
        for idx in rng.integers(0, len(rows), n_tokens):
            row = rows[idx]
            dist = row["f"] if rng.random() < share else row["p"]
            x = int(rng.choice(len(dist), p=dist / dist.sum()))
            top = {texts[t]: math.log(row["p"][t]) for t in row["top"]}
            sample.add_position(texts[x], math.log(row["p"][x]), top, float(rng.random()))
            if row["cand"] is not None:
                sample.repeat_p.append(float(row["p"][row["cand"]]))
                sample.repeat_hits += x == row["cand"]
        tests = pit_tests(sample, eff["bins"])
        chi2s.append(tests["chi2"])
        zc.append(tests["collapse_z"])
        zr.append(tests["repeat_z"])
    return {
        "replicas": replicas,
        "tokens": n_tokens,
        "chi2_mean": float(np.mean(chi2s)),
        "chi2_sem": float(np.std(chi2s) / math.sqrt(replicas)),
        "collapse_z_mean": float(np.mean(zc)),
        "collapse_z_sem": float(np.std(zc) / math.sqrt(replicas)),
        "repeat_z_mean": float(np.mean(zr)),
        "repeat_z_sem": float(np.std(zr) / math.sqrt(replicas)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="evalpipe-skills-dsv4", help="built-in model name or checkpoint folder")
    ap.add_argument("--drafter", default="layerskip:4", help="drafter spec, as `evalpipe serve --drafter`")
    ap.add_argument("--responses", type=int, default=200, help="gate prompts measured (64 tokens each)")
    ap.add_argument("--seed", type=int, default=1, help="prompt seed, as `qualify --sampling-seed`")
    ap.add_argument("--batch", type=int, default=16, help="concurrent sequences in the engine")
    ap.add_argument("--sim-tokens", type=int, default=20000, help="tokens per simulated gate run")
    ap.add_argument("--sim-replicas", type=int, default=60, help="simulated gate runs")
    ap.add_argument("--smoke", action="store_true", help="4 responses of 16 tokens, 3 simulated runs of 500 tokens")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    if args.smoke:
        args.responses, args.sim_tokens, args.sim_replicas, args.batch = 4, 500, 3, 4
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    responses = measure(
        args.model, args.drafter, args.responses, 16 if args.smoke else MAX_TOKENS, args.seed, args.batch
    )
    vocab = len(next(pos["p"] for resp in responses for pos in resp if pos["p"] is not None))
    tokenizer = load_tokenizer(None)
    texts = [tokenizer.token_text(t) for t in range(vocab)]  # the model's rows, reserved ids included
    eff = position_effects(responses, texts)
    pred = predict(eff)
    print(
        f"{args.drafter}: {pred['positions']} tokens measured in {time.perf_counter() - t0:.0f} s, "
        f"{100 * pred['drafted_share']:.0f}% at drafted positions"
    )
    print(
        f"per token: chi-square lambda {pred['chi2_lambda_per_token']:.3g}; collapse drift "
        f"{pred['collapse']['mu']:+.3g} +- {pred['collapse']['mu_se']:.2g} (s0 {pred['collapse']['s0']:.3g}); "
        "repeat drift "
        + (
            f"{pred['repeat']['mu']:+.3g} +- {pred['repeat']['mu_se']:.2g} (s0 {pred['repeat']['s0']:.3g})"
            if pred["repeat"]
            else "n/a"
        )
    )
    print("| tokens for p < alpha | chi-square | collapse | repeat | likelihood ratio knowing q (a bound) |")
    print("|---|---:|---:|---:|---:|")
    for key, row in pred["tokens"].items():
        print(f"| {key} | " + " | ".join(f"{v:,.0f}" for v in row.values()) + " |")
    # the measured tokens themselves came from the exact sampler: their argmax hits against sum(p_max) (the gate's
    # collapse statistic on the engine's own draws, in process)
    _, z_exact, p_exact = hit_test(sum(r["hit"] for r in eff["rows"]), [r["a_p"] for r in eff["rows"]])
    print(f"exact sampler, measured tokens: collapse z {z_exact:+.2f} (p {p_exact:.2g})")
    rng = np.random.default_rng(args.seed)
    sim = simulate(eff, texts, args.sim_tokens, args.sim_replicas, rng)
    n = args.sim_tokens
    expected = {
        "chi2": eff["bins"] - 1 + n * pred["chi2_lambda_per_token"],
        "collapse_z": math.sqrt(n) * pred["collapse"]["mu"] / pred["collapse"]["s0"],
        "repeat_z": (math.sqrt(n) * pred["repeat"]["mu"] / pred["repeat"]["s0"]) if pred["repeat"] else 0.0,
    }
    print(
        f"simulation, {sim['replicas']} gate runs of {n} tokens: chi-square {sim['chi2_mean']:.2f} +- "
        f"{sim['chi2_sem']:.2f} (formula {expected['chi2']:.2f}); collapse z {sim['collapse_z_mean']:+.3f} +- "
        f"{sim['collapse_z_sem']:.3f} (formula {expected['collapse_z']:+.3f}); repeat z "
        f"{sim['repeat_z_mean']:+.3f} +- {sim['repeat_z_sem']:.3f} (formula {expected['repeat_z']:+.3f})"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "drafter": args.drafter,
                    "prediction": pred,
                    "simulation": sim,
                    "formula": expected,
                    "exact_sampler_collapse_z": z_exact,
                },
                fh,
                indent=1,
                default=float,
            )


if __name__ == "__main__":
    main()
