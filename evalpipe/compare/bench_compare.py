"""Compare two bench folders: ratio of medians (B / A) with a bootstrap interval, per measured quantity, and a
throughput verdict with the smallest change the two benches could have detected."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from evalpipe.compare import power, stats
from evalpipe.compare.runfolder import RunFolderError
from evalpipe.harness.records import BENCH_FILE, MalformedFile, read_json_object

# Settings that must match for two benches to measure the same thing.
PROTOCOL_KEYS = ("input_len", "output_len", "concurrency", "input_ids_sha256", "temperature", "ignore_eos")
METRICS = ("decode_tokens_per_s", "ttft_s", "total_s")


def is_bench_folder(path: str | Path) -> bool:
    return (Path(path) / BENCH_FILE).is_file()


def load_bench(path: str | Path) -> dict:
    p = Path(path) / BENCH_FILE
    try:
        data = read_json_object(p)
    except MalformedFile as exc:
        raise RunFolderError(str(exc)) from None
    if "requests" not in data:
        raise RunFolderError(f"{p}: not a bench.json written by `evalpipe bench`")
    data["_path"] = str(Path(path))
    return data


def bench_problems(a: dict, b: dict) -> list[str]:
    ca, cb = a.get("config", {}), b.get("config", {})
    problems = [
        f"bench setting {k} differs: {ca.get(k)!r} vs {cb.get(k)!r}" for k in PROTOCOL_KEYS if ca.get(k) != cb.get(k)
    ]
    if a.get("requests") and a.get("requests") == b.get(
        "requests"
    ):  # identical event times: one bench twice (or a copy)
        problems.append(f"both folders hold the same bench ({a['_path']} and {b['_path']})")
    for d, label in ((a, "A"), (b, "B")):
        if d.get("partial"):
            problems.append(f"bench {label} ({d['_path']}) is partial")
    return problems


def kept_values(bench: dict, metric: str) -> list[float]:
    """Every non-warm-up, non-error value of `metric` (low outliers included)."""
    return [
        r[metric]
        for r in bench["requests"]
        if not r.get("warmup") and not r.get("error") and isinstance(r.get(metric), (int, float))
    ]


def samples_overlap(va: list[float], vb: list[float]) -> bool:
    """True when the ranges of the two arms' values intersect."""
    return bool(va and vb) and bool(min(va) <= max(vb) and min(vb) <= max(va))


def change_verdict(ratio_ci: dict, values_a: list[float], values_b: list[float]) -> dict:
    """'higher' / 'lower' when the ratio's interval excludes 1, else 'no measurable change', with the MDE in percent
    (power.ratio_mde_pct on the log values' spread) and whether the two arms' samples overlap."""
    lo, hi = ratio_ci.get("ci_low"), ratio_ci.get("ci_high")
    if lo is None or hi is None:
        verdict = "not-evaluable"
    elif lo > 1:
        verdict = "higher"
    elif hi < 1:
        verdict = "lower"
    else:
        verdict = "no measurable change"
    logs = [np.log([v for v in vals if v > 0]) for vals in (values_a, values_b)]
    sds = [float(np.std(x, ddof=1)) if x.size >= 2 else math.nan for x in logs]
    mde = power.ratio_mde_pct(sds[0], logs[0].size, sds[1], logs[1].size) if all(map(math.isfinite, sds)) else None
    return {"verdict": verdict, "mde_pct": mde, "samples_overlap": samples_overlap(values_a, values_b)}


def compare_benches(a: dict, b: dict, *, seed: int, n_resamples: int, forced: list[str]) -> dict:
    metrics = {}
    for m in METRICS:
        va, vb = kept_values(a, m), kept_values(b, m)
        res = stats.bootstrap_ratio_of_medians(va, vb, n_resamples=n_resamples, seed=seed)
        res["values_a"], res["values_b"] = va, vb
        res.update(change_verdict(res, va, vb))
        metrics[m] = res
    acc = {k: (d.get("results") or {}).get("accept_length_median") for k, d in (("a", a), ("b", b))}
    return {
        "schema_version": 1,
        "kind": "bench",
        "forced": bool(forced),
        "forced_over": forced,
        "arms": {
            "a": {"path": a["_path"], "config": a.get("config")},
            "b": {"path": b["_path"], "config": b.get("config")},
        },
        "metrics": metrics,
        "accept_length_median": acc,
        # run-level: the servers' /metrics counters over each bench's measured rounds, not per request
        "spec_metrics": {k: (d.get("results") or {}).get("spec_metrics") for k, d in (("a", a), ("b", b))},
        "settings": {"seed": seed, "n_resamples": n_resamples, "confidence": stats.DEFAULT_CONFIDENCE},
    }
