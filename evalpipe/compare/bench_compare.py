"""Compare two bench folders: ratio of medians (B / A) with a bootstrap interval, per measured quantity."""

from __future__ import annotations

from pathlib import Path

from evalpipe.compare import stats
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
    problems = [f"bench setting {k} differs: {ca.get(k)!r} vs {cb.get(k)!r}" for k in PROTOCOL_KEYS if ca.get(k) != cb.get(k)]
    if a.get("requests") and a.get("requests") == b.get("requests"):  # identical event times: one bench twice (or a copy)
        problems.append(f"both folders hold the same bench ({a['_path']} and {b['_path']})")
    for d, label in ((a, "A"), (b, "B")):
        if d.get("partial"):
            problems.append(f"bench {label} ({d['_path']}) is partial")
    return problems


def kept_values(bench: dict, metric: str) -> list[float]:
    """Every non-warm-up, non-error value of `metric` (low outliers included)."""
    return [r[metric] for r in bench["requests"]
            if not r.get("warmup") and not r.get("error") and isinstance(r.get(metric), (int, float))]


def compare_benches(a: dict, b: dict, *, seed: int, n_resamples: int, forced: list[str]) -> dict:
    metrics = {}
    for m in METRICS:
        va, vb = kept_values(a, m), kept_values(b, m)
        res = stats.bootstrap_ratio_of_medians(va, vb, n_resamples=n_resamples, seed=seed)
        res["values_a"], res["values_b"] = va, vb
        metrics[m] = res
    acc = {k: (d.get("results") or {}).get("accept_length_median") for k, d in (("a", a), ("b", b))}
    return {
        "schema_version": 1,
        "kind": "bench",
        "forced": bool(forced),
        "forced_over": forced,
        "arms": {"a": {"path": a["_path"], "config": a.get("config")}, "b": {"path": b["_path"], "config": b.get("config")}},
        "metrics": metrics,
        "accept_length_median": acc,
        # run-level: the servers' /metrics counters over each bench's measured rounds, not per request
        "spec_metrics": {k: (d.get("results") or {}).get("spec_metrics") for k, d in (("a", a), ("b", b))},
        "settings": {"seed": seed, "n_resamples": n_resamples, "confidence": stats.DEFAULT_CONFIDENCE},
    }
