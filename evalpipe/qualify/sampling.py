"""Gate `sampling`: does the server sample from the distribution it reports? (docs: statistics.md section 4)

For a correct sampler the randomised probability integral transform (PIT) of every sampled token under the
distribution the server reports for its position, given the prefix, is i.i.d. Uniform(0, 1) over all tokens of all
responses (Rosenblatt 1952; the discrete randomisation of Czado, Gneiting and Held 2009). So no reference server is
needed, only `logprobs` at temperature 1 and top_p 1, where every server's logprobs (raw or processed) and its
sampling distribution are the same softmax.

Per position: order the reported top K tokens by logprob (ties by text), put the unreported mass 1 - sum(top K) last
as one bin, and draw u = F- + V f with V ~ U(0, 1) from a seeded generator (F-: the mass before the sampled token in
that order; f: its own mass, or the tail's when it is not among the top K). Three tests, each at ALPHA:
- uniformity: Pearson's chi-square of u over `bins` equal-probability bins (scipy.stats.chisquare, bins - 1 df);
- greedy collapse: the sampled tokens that were the argmax against their expectation sum(p_max), variance
  sum(p_max (1 - p_max)) (a sum of Bernoulli martingale differences, normal approximation), two-sided;
- context-repeat bias: the same count for the token a prompt-lookup drafter would propose from the output so far
  (what followed the latest earlier occurrence of its longest suffix, up to 3 tokens; `lookup_candidate`), at the
  positions where that token is among the top K. A verifier that resamples from p instead of the residual
  max(0, p - q) after rejecting a point-mass draft d emits d with probability p(d)(2 - p(d)), a bias the aggregate
  PIT does not see when d's rank varies, but this count does.
Each statistic is valid for any favourite token fixed by the prefix (Rosenblatt again). The gate fails when any
p-value is below ALPHA (a false-alarm rate of at most 3 x ALPHA on a correct server, Bonferroni), and when fewer than
MIN_INFORMATIVE informative tokens sum(1 - p_max) were tested: low-entropy tokens carry almost no signal.
Kolmogorov-Smirnov on u is reported beside them, not gated on.

Prompts: random strings of letters and digits (the continuations of such prompts are uncertain), seeded.
Beside qualify.json, TOKENS_FILE holds per response what the statistics used (sampled tokens, their logprobs, the
top K kept and the U(0, 1) draws), so that every p-value can be recomputed from the folder alone.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

from evalpipe.harness.server_facts import find_key
from evalpipe.qualify.core import Endpoint, GateResult, check, exchange, gather_limited
from evalpipe.redact import scrub_values

ALPHA = 0.001  # per test; three tests: at most 0.003 false alarms per run on a correct server
LOOKUP_NGRAM = 3  # longest suffix the context-repeat candidate matches (the native ngram drafter's)
MIN_INFORMATIVE = 100.0  # sum(1 - p_max) below this cannot test a sampler
TOP_K = 20  # logprobs per position asked for: the OpenAI API's, vLLM's default and the native server's maximum
MAX_TOKENS = 64  # per request
HIST_BINS = 20  # bars of the PIT histogram in qualify.json and the report
TOKENS_FILE = "sampling_tokens.jsonl"  # per response: tokens, logprobs, top-K kept, U(0, 1) draws (recomputable)
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


@dataclass
class PitSample:
    """The PIT values of all sampled tokens, the argmax hits and p_max per position, and the matching anomalies."""

    u: list = field(default_factory=list)
    p_max: list = field(default_factory=list)
    argmax_hits: int = 0
    in_tail: int = 0
    logprob_mismatches: int = 0  # the sampled token's logprob differs from its top-K entry (> 1e-4)
    repeat_p: list = field(default_factory=list)  # p of the context-repeat candidate, where it is in the top K
    repeat_hits: int = 0
    short_tops: int = 0  # positions with fewer than K entries
    extra_entries_dropped: int = 0  # positions whose top logprobs had more than K entries (the sampled token added)

    def add_response(self, tokens: list, logprobs: list | None, tops: list, v_rng, k: int | None = None) -> dict:
        """Every position of one response: its sampled token texts, their logprobs and top-K dicts. With `k`, only
        the k most likely entries count: vLLM adds the sampled token to its top-k when it is not among them, and
        an entry present only because it was sampled would break the transform (it is put back in the tail).
        Returns what the statistics used, per position (`TOKENS_FILE`'s line): the tokens, their logprobs, the
        top-K dicts kept and the U(0, 1) draws, with None for a position without top logprobs (not tested)."""
        used: dict = {
            "tokens": list(tokens),
            "logprobs": list(logprobs) if logprobs else None,
            "top_logprobs": [],
            "v": [],
        }
        for j, (tok, top) in enumerate(zip(tokens, tops)):
            if not top:
                used["top_logprobs"].append(None)
                used["v"].append(None)
                continue
            self.short_tops += k is not None and len(top) < k  # texts that collided, or a short vocabulary
            if k is not None and len(top) > k:
                top = dict(sorted(top.items(), key=lambda kv: (-kv[1], str(kv[0])))[:k])
                self.extra_entries_dropped += 1
            v = float(v_rng.random())
            used["top_logprobs"].append(top)
            used["v"].append(v)
            self.add_position(tok, logprobs[j] if logprobs else None, top, v)
            candidate = lookup_candidate(tokens[:j])
            if candidate is not None and candidate in top:
                self.repeat_p.append(math.exp(top[candidate]))
                self.repeat_hits += tok == candidate
        return used

    def add_position(self, chosen: str, chosen_logprob: float | None, top: dict, v: float) -> None:
        """One sampled token: `top` {token text: logprob} as the server reported it, `v` a U(0, 1) draw."""
        order = sorted(top.items(), key=lambda kv: (-kv[1], str(kv[0])))
        probs = [math.exp(lp) for _, lp in order]
        mass = min(1.0, sum(probs))
        before = 0.0
        for rank, ((text, lp), p) in enumerate(zip(order, probs)):
            if text == chosen:
                if chosen_logprob is not None and abs(chosen_logprob - lp) > 1e-4:
                    self.logprob_mismatches += 1
                self.argmax_hits += rank == 0
                self.u.append(min(1.0, before + v * p))
                break
            before += p
        else:
            self.in_tail += 1
            self.u.append(mass + v * (1.0 - mass))
        self.p_max.append(probs[0] if probs else 0.0)

    @property
    def informative(self) -> float:
        return float(sum(1.0 - p for p in self.p_max))


def lookup_candidate(history: list, max_ngram: int = LOOKUP_NGRAM):
    """What a prompt-lookup drafter proposes after `history`: the token that followed the latest earlier occurrence
    of its longest suffix (up to max_ngram tokens); the last token when nothing matches; None for no history."""
    n_hist = len(history)
    for n in range(min(max_ngram, n_hist - 1), 0, -1):
        suffix = history[n_hist - n :]
        for start in range(n_hist - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n]
    return history[-1] if history else None


def hit_test(hits: int, probs: list) -> tuple[float, float, float]:
    """(expected hits, z, two-sided p) of `hits` favourite-token draws with probabilities `probs`: mean sum(p),
    variance sum(p (1 - p)), normal approximation; z = 0 and p = 1 when the variance is 0."""
    p = np.asarray(probs, dtype=float)
    expected, var = float(p.sum()), float((p * (1.0 - p)).sum())
    if var <= 0:
        return expected, 0.0, 1.0
    z = (hits - expected) / math.sqrt(var)
    return expected, z, float(2.0 * stats.norm.sf(abs(z)))


def pit_tests(sample: PitSample, bins: int) -> dict:
    """Chi-square of u over `bins` equal bins, KS against U(0, 1), and the two hit tests (module docstring)."""
    n = len(sample.u)
    if n == 0:
        return {"tokens": 0, "chi2_p": None, "collapse_p": None, "repeat_p": None, "ks_p": None}
    counts = np.histogram(np.asarray(sample.u), bins=bins, range=(0.0, 1.0))[0]
    chi2 = stats.chisquare(counts)
    expected, z, p = hit_test(sample.argmax_hits, sample.p_max)
    r_expected, r_z, r_p = hit_test(sample.repeat_hits, sample.repeat_p)
    return {
        "tokens": n,
        "bins": bins,
        "chi2": float(chi2.statistic),
        "chi2_p": float(chi2.pvalue),
        "argmax_hits": int(sample.argmax_hits),
        "argmax_expected": expected,
        "collapse_z": z,
        "collapse_p": p,
        "repeat_positions": len(sample.repeat_p),
        "repeat_hits": int(sample.repeat_hits),
        "repeat_expected": r_expected,
        "repeat_z": r_z,
        "repeat_p": r_p,
        "ks_p": float(stats.kstest(np.asarray(sample.u), "uniform").pvalue),
    }


def verdict(tests: dict, informative: float, alpha: float = ALPHA) -> str | None:
    """None when the sampler passes, else why not."""
    if informative < MIN_INFORMATIVE:
        return (
            f"only {informative:.1f} informative tokens (sum of 1 - p_max) were tested, fewer than "
            f"{MIN_INFORMATIVE:g}: raise --sampling-tokens or use higher-entropy prompts"
        )
    failed = [f"{name} p = {tests[key]:.3g}" for name, key in GATED if tests[key] is not None and tests[key] < alpha]
    if failed:
        return (
            f"{', '.join(failed)} < alpha {alpha:g}: the sampled tokens do not follow the distribution the "
            f"server reports (argmax {tests['argmax_hits']} vs {tests['argmax_expected']:.1f} expected, "
            f"context repeats {tests['repeat_hits']} vs {tests['repeat_expected']:.1f})"
        )
    return None


GATED = (
    ("PIT uniformity chi-square", "chi2_p"),
    ("greedy collapse", "collapse_p"),
    ("context-repeat bias", "repeat_p"),
)


def prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(6, 24))) for _ in range(n)]


def token_id_keys(models) -> dict:
    """Extra request fields that make the logprob keys token ids instead of token texts, where the server has them
    (vLLM's `return_tokens_as_token_ids`): texts collide (byte pieces that decode to '' or U+FFFD), and a sampled
    token matched to another token of the same text breaks the transform. Other servers: none (keys are texts)."""
    data = models.get("data") if isinstance(models, dict) else None
    vllm = any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in data or [])
    return {"return_tokens_as_token_ids": True} if vllm else {}


def logprobs_mode(info) -> str:
    """What the server says its logprobs are (vLLM's `logprobs_mode`, the native server's), else 'not reported'."""
    value = find_key(info, ("logprobs_mode",))
    return str(value) if value is not None else "not reported"


def _wave_bodies(ep: Endpoint, seed: int, wave: int, n_req: int, id_keys: dict) -> list[dict]:
    """Wave `wave`'s requests: fresh prompts, each sampled at temperature 1 with its own seed and top logprobs."""
    texts = prompts(seed * 1_000_003 + wave, n_req)
    return [
        ep.body(
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=1.0,
            logprobs=TOP_K,
            seed=seed * 1_000_003 + wave * 10_000 + i,
            **id_keys,
        )
        for i, p in enumerate(texts)
    ]


def _record_wave(result: GateResult, sample: PitSample, wave: int, bodies, outcomes, v_rng, tokens_file, cfg) -> None:
    """Check each response of a wave, add its tokens to the sample and to the tokens file, and record it."""
    for i, (body, out) in enumerate(zip(bodies, outcomes)):
        rid = f"sampling-{wave}-{i}"
        checks = [out.transport_check()]
        have = out.ok and out.tokens is not None and out.top_logprobs is not None
        if out.ok:
            checks.append(
                check(
                    "logprobs",
                    have and len(out.tokens) == len(out.top_logprobs) > 0,
                    f"{len(out.tokens or [])} tokens with top logprobs"
                    if have
                    else "the response carries no per-token top logprobs",
                )
            )
        if have:
            used = sample.add_response(out.tokens, out.logprobs, out.top_logprobs, v_rng, k=TOP_K)
            line = scrub_values({"id": rid, **used}, cfg.api_keys)
            tokens_file.write(json.dumps(line, ensure_ascii=False) + "\n")
        result.records.append(exchange(rid, "completion", body, out, checks))


async def _sample_waves(ep: Endpoint, result: GateResult, sample: PitSample, id_keys: dict) -> None:
    """Send waves of sampled requests until the sample holds the token budget (or a wave adds nothing)."""
    cfg = ep.cfg
    budget, seed = cfg.sampling_tokens, cfg.sampling_seed
    v_rng = np.random.default_rng(seed)
    with open(Path(cfg.out_dir) / TOKENS_FILE, "w", encoding="utf-8") as tokens_file:
        wave = 0
        while len(sample.u) < budget:
            n_req = max(1, min(cfg.concurrency * 4, math.ceil((budget - len(sample.u)) / MAX_TOKENS)))
            bodies = _wave_bodies(ep, seed, wave, n_req, id_keys)
            outcomes = await gather_limited([ep.send(b, chat=False) for b in bodies], cfg.concurrency)
            tested_before = len(sample.u)
            _record_wave(result, sample, wave, bodies, outcomes, v_rng, tokens_file, cfg)
            if len(sample.u) == tested_before:  # nothing testable came back: stop instead of looping
                break
            wave += 1


def _notes(ep: Endpoint, sample: PitSample, tests: dict, id_keys: dict) -> dict:
    cfg = ep.cfg
    histogram = np.histogram(np.asarray(sample.u or [0.0]), bins=HIST_BINS, range=(0.0, 1.0))[0].tolist()
    return {
        **tests,
        "alpha_per_test": ALPHA,
        "gated_on": [key for _, key in GATED],
        "informative_tokens": round(sample.informative, 2),
        "tokens_in_tail_bin": sample.in_tail,
        "logprob_mismatches": sample.logprob_mismatches,
        "positions_with_extra_entries": sample.extra_entries_dropped,
        "top_k": TOP_K,
        "token_budget": cfg.sampling_tokens,
        "seed": cfg.sampling_seed,
        "pit_histogram": histogram if sample.u else [],
        "request": {"temperature": 1.0, "top_p": 1.0, "logprobs": TOP_K, "max_tokens": MAX_TOKENS},
        "server_logprobs_mode": logprobs_mode(ep.info),
        "token_identity": "token ids (return_tokens_as_token_ids)" if id_keys else "token texts",
        "positions_with_fewer_entries": sample.short_tops,
        "tokens_file": TOKENS_FILE,
    }


def _problem(result: GateResult, sample: PitSample, tests: dict) -> str | None:
    if not result.records:
        return "no requests were sent"
    if len(sample.u) == 0:
        return "no response carried top logprobs: the sampling gate needs logprobs"
    return verdict(tests, sample.informative)


async def run(ep: Endpoint) -> GateResult:
    t0 = time.perf_counter()
    result = GateResult("sampling")
    sample = PitSample()
    id_keys = token_id_keys(ep.facts.get("models"))
    await _sample_waves(ep, result, sample, id_keys)
    bins = HIST_BINS if len(sample.u) >= 5 * HIST_BINS else max(2, len(sample.u) // 5)
    tests = pit_tests(sample, bins)
    result.notes = _notes(ep, sample, tests, id_keys)
    result.problem = _problem(result, sample, tests)
    result.notes["summary"] = (
        f"{tests['tokens']} tokens ({sample.informative:.0f} informative): chi-square p = "
        f"{_fmt(tests['chi2_p'])}, collapse p = {_fmt(tests['collapse_p'])}, repeat p = "
        f"{_fmt(tests.get('repeat_p'))}"
    )
    result.wall_s = time.perf_counter() - t0
    return result


def _fmt(p) -> str:
    return "n/a" if p is None else f"{p:.3g}"
