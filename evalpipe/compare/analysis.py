"""Everything `evalpipe compare` says about two run folders, as one JSON-ready dict.

The dict is compare.json; the terminal table and report.html are views of it and add nothing.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import numpy as np

from evalpipe import volatile
from evalpipe.compare import stats
from evalpipe.compare.intervals import upper_bound_rate
from evalpipe.compare.runfolder import LoadedRun, flatten, snapshot
from evalpipe.harness import metrics, spec_metrics
from evalpipe.harness.agreement import compare_outputs, summarize_agreement
from evalpipe.harness.metrics import completion_tokens, is_correct
from evalpipe.harness.records import Record
from evalpipe.harness.server_facts import determinism_note, lossy_acceptance
from evalpipe.redact import redact

SCHEMA_VERSION = 1
ABSENT = "<absent>"  # a manifest key one side lacks

# Keys of our own manifests that differ between any two runs by construction (ids, clocks, paths): listed as
# volatile, never flagged. What the server itself changes per call or per boot is evalpipe.volatile's list.
VOLATILE_LEAVES = {
    "run_id",
    "arm",
    "started_at",
    "ended_at",
    "start_time",
    "end_time",
    "finished_at",
    "created",
    "created_at",
    "timestamp",
    "time",
    "wall_s",
    "duration_s",
    "out_dir",
    "run_dir",
    "output_dir",
    "pid",
    "output_sha256",
    "responses_sha256",
    "n_records",
    "n_done",
    "done",
    "captured_at",
    "command_line",
    "load_seconds",
    "uptime_s",
    # a fresh boot gets a fresh free port: the address is not a setting
    "port",
    "base_url",
    # command lines (launch.argv, launch.command, server_args.argv) only restate the settings the server reports
    # field by field (server_args.*, speculative.*), which are compared, so a declared flag shows up once, there
    "argv",
    "command",
}


def _scrub(obj: Any, in_list: bool = False) -> Any:
    """Drop volatile keys inside lists (e.g. `created` in /v1/models entries), which flatten keeps whole;
    outside lists they are flattened, counted and reported as ignored."""
    if isinstance(obj, dict):
        return {
            k: _scrub(v, in_list)
            for k, v in obj.items()
            if not (in_list and k in VOLATILE_LEAVES and not isinstance(v, dict))
        }
    if isinstance(obj, list):
        return [_scrub(v, True) for v in obj]
    return obj


def arm_overview(run: LoadedRun) -> dict:
    recs = list(run.by_key.values())
    n_planned = run.summary.get("n_planned")
    if not isinstance(n_planned, int):
        n_planned = len(recs)
    n_correct = sum(map(is_correct, recs))
    return {
        "path": str(run.path),
        "run_id": run.run_id,
        "arm": run.arm,
        "lane": run.lane,
        "n_planned": n_planned,
        "n_records": len(recs),
        "n_duplicate_records": run.duplicates,
        "n_correct": n_correct,
        "accuracy": n_correct / n_planned if n_planned else None,
        "summary_accuracy": run.summary.get("accuracy"),
        "partial": bool(run.summary.get("partial")),
    }


def rate_block(recs_a: list[Record], recs_b: list[Record], n_a: int, n_b: int) -> dict:
    """Truncation, error and invalid/no-answer counts and rates per arm and their difference (B - A)."""
    out = {}
    for name, pred in metrics.RATES:
        ka, kb = sum(map(pred, recs_a)), sum(map(pred, recs_b))
        ra, rb = (ka / n_a if n_a else None), (kb / n_b if n_b else None)
        out[name] = {
            "n_a": ka,
            "n_b": kb,
            "denominator_a": n_a,
            "denominator_b": n_b,
            "rate_a": ra,
            "rate_b": rb,
            "diff": (rb - ra) if ra is not None and rb is not None else None,
        }
    return out


def spec_stats(recs: list[Record]) -> dict:
    """Accept-length mean and distribution from the records' `spec` (null when speculation was off).

    Per record the accept length is metrics.accept_length (the server's figure, else tokens / verify steps). Per-step
    lengths (`accept_lengths`), a histogram by length (`accept_length_histogram`) or by accepted drafts
    (metrics.draft_histogram: the native engine's and SGLang's; length = drafts + 1) feed the distribution; else
    the per-record means do. The token-weighted mean is metrics.token_weighted_accept_length, as in acceptance.py.
    """
    per_record: list[float] = []
    steps: list[int] = []
    n_with = n_lossy = 0
    rules: set[str] = set()
    for r in recs:
        spec = r.spec
        if not isinstance(spec, dict):
            continue
        n_with += 1
        n_lossy += spec.get("lossy") is True
        if isinstance(spec.get("accept"), dict) and spec["accept"].get("rule"):
            rules.add(str(spec["accept"]["rule"]))
        al = metrics.accept_length(r)
        if al is not None:
            per_record.append(al)
        lengths = spec.get("accept_lengths")
        hist = spec.get("accept_length_histogram")
        drafts_hist = metrics.draft_histogram(r)
        if isinstance(drafts_hist, list) and not isinstance(lengths, list) and hist is None:
            # index = accepted drafts per verify step; the accept length adds the bonus token
            hist = [0] + [int(c or 0) for c in drafts_hist]
        if isinstance(lengths, list):
            steps.extend(int(x) for x in lengths if isinstance(x, (int, float)))
        elif isinstance(hist, list):
            for length, count in enumerate(hist):
                steps.extend([length] * int(count or 0))
        elif isinstance(hist, dict):
            for length, count in hist.items():
                steps.extend([int(length)] * int(count or 0))
    source = steps if steps else [round(x) for x in per_record]
    histogram: dict[str, int] = {}
    for x in source:
        histogram[str(int(x))] = histogram.get(str(int(x)), 0) + 1
    return {
        "n_records_with_spec": n_with,
        "accept_length_mean": metrics.mean_accept_length(recs),
        "accept_length_token_weighted": metrics.token_weighted_accept_length(recs),
        "accept_length_median": float(np.median(per_record)) if per_record else None,
        "histogram_basis": "per-step accept lengths" if steps else "per-record mean accept length, rounded",
        "histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "per_record": per_record,
        # the acceptance rule the records report (evalpipe serve --spec-accept-*) and how many it decided lossily
        "accept_rules": sorted(rules),
        "n_records_lossy": n_lossy,
    }


def spec_block(recs: list[Record], summary: dict) -> dict:
    """Per-record statistics (`spec_stats`) beside the run-level ones the run scraped from the server's /metrics
    (`server_metrics`: vLLM's counters after minus before the run; not per request)."""
    block = spec_stats(recs)
    metrics = summary.get("spec_metrics") if isinstance(summary, dict) else None
    block["server_metrics"] = metrics
    block["accept_length_run_level"] = spec_metrics.accept_length(metrics)
    return block


def arm_accept_length(block: Any) -> tuple[float | None, str | None]:
    """(accept length, basis) of one arm's spec block: the per-record mean where responses carried statistics,
    else the run-level figure from the server's /metrics; (None, None) when neither exists."""
    if not isinstance(block, dict):
        return None, None
    if isinstance(block.get("accept_length_mean"), (int, float)):
        return float(block["accept_length_mean"]), "per-record"
    if isinstance(block.get("accept_length_run_level"), (int, float)):
        return float(block["accept_length_run_level"]), "run-level /metrics"
    return None, None


def speed_stats(recs: list[Record]) -> dict:
    """Client latency and completion tokens per second, per record and in aggregate."""
    lat = [float(r.latency_s) for r in recs if isinstance(r.latency_s, (int, float)) and not r.error]
    tps, tok_total, lat_total = [], 0, 0.0
    for r in recs:
        ct, ls = completion_tokens(r), r.latency_s
        if ct is not None and isinstance(ls, (int, float)) and ls > 0 and not r.error:
            tps.append(ct / ls)
            tok_total += ct
            lat_total += ls
    return {
        "n": len(lat),
        "latency_median_s": _q(lat, 0.5),
        "latency_p90_s": _q(lat, 0.9),
        "latency_mean_s": _mean(lat),
        "tokens_per_s_median": _q(tps, 0.5),
        "tokens_per_s_mean": _mean(tps),
        "tokens_per_s_aggregate": tok_total / lat_total if lat_total else None,
        "completion_tokens_total": tok_total,
        "latency_s": lat,
        "tokens_per_s": tps,
    }


def _q(xs: list[float], q: float) -> float | None:
    return float(np.quantile(xs, q)) if xs else None


def _mean(xs: list[float]) -> float | None:
    return float(np.mean(xs)) if xs else None


def manifest_differences(ma: dict, mb: dict, intended: list[str]) -> dict:
    """Every differing manifest key (dotted), grouped, with the intended ones (glob patterns) marked."""
    fa, fb = flatten(manifest_view(ma)), flatten(manifest_view(mb))
    # what the server changes by itself (evalpipe.volatile) is left out of the views: listed, when it differs
    ra, rb = flatten(manifest_view(ma, strip_volatile=False)), flatten(manifest_view(mb, strip_volatile=False))
    stripped = {k for k in set(ra) | set(rb) if k not in fa and k not in fb and ra.get(k, ABSENT) != rb.get(k, ABSENT)}
    rows, volatile = [], []
    for key in sorted(set(fa) | set(fb) | stripped):
        va, vb = fa.get(key, ABSENT), fb.get(key, ABSENT)
        if va == vb and key not in stripped:
            continue
        leaf = key.rsplit(".", 1)[-1]
        if key in stripped or leaf in VOLATILE_LEAVES:
            volatile.append(key)
            continue
        mark = any(fnmatch.fnmatchcase(key, pat) or fnmatch.fnmatchcase(leaf, pat) for pat in intended)
        rows.append({"key": key, "category": _category(key), "a": va, "b": vb, "intended": mark})
    implied = None
    if not intended and rows and all(speculation_setting(r["key"]) for r in rows):
        for r in rows:
            r["intended"] = True
        implied = (
            f"the arms differ only in speculation settings ({len(rows)} key(s)): taken as the intended "
            "difference (give --intended to mark it yourself)"
        )
    return {
        "intended_patterns": list(intended),
        "intended_implied": implied,
        "differences": rows,
        "n_intended": sum(r["intended"] for r in rows),
        "n_unintended": sum(not r["intended"] for r in rows),
        "volatile_keys_ignored": volatile,
    }


def speculation_setting(key: str) -> bool:
    """A server setting of speculation: its name has a speculation word (volatile.SPECULATION_WORDS), or the engine
    derives it from a speculative config (volatile.SPECULATION_DERIVED)."""
    prefix = "server.server_info."
    if not key.startswith("server."):
        return False
    return any(word in key.lower() for word in volatile.SPECULATION_WORDS) or (
        key.startswith(prefix) and volatile.derived_from_speculation(key[len(prefix) :])
    )


def manifest_view(manifest: dict, strip_volatile: bool = True) -> dict:
    """The provenance snapshot with packages as {name: version}, so a changed package is one row; server facts
    without what changes per call or per boot, and redacted (a manifest written before either rule may hold both)."""
    snap = dict(snapshot(manifest))
    if isinstance(snap.get("server"), dict):
        snap["server"] = redact(volatile.strip_server(snap["server"]) if strip_volatile else snap["server"])
    view = {k: (_scrub(v) if isinstance(v, (dict, list)) and k != "packages" else v) for k, v in snap.items()}
    pkgs = view.get("packages")
    if isinstance(pkgs, list):
        view["packages"] = {p.split("==", 1)[0]: (p.split("==", 1)[1] if "==" in p else "") for p in map(str, pkgs)}
    return view


def _category(key: str) -> str:
    k = key.lower()
    for cat, words in (
        ("packages", ("package",)),
        ("sources", ("git", "commit", "diff", "version", "source")),
        ("server", ("server", "endpoint", "model", "spec", "launch")),
        ("dataset", ("dataset", "data")),
        ("lane", ("lane", "override", "prompt", "template")),
    ):
        if any(w in k for w in words):
            return cat
    return "other"


IDENTITY_BASIS = {"token_ids": "token", "logprob_tokens": "logprob-token", "text": "text"}


def output_identity(agreement: dict, confidence: float = stats.DEFAULT_CONFIDENCE) -> dict:
    """Identical outputs in all n pairs as evidence: no pair can then differ in correctness, and the exact one-sided
    bound on the rate of differing outputs bounds the loss of accuracy too."""
    n, same = agreement.get("n_pairs") or 0, agreement.get("n_identical") or 0
    bases = [b for b, count in (agreement.get("basis_counts") or {}).items() if count]
    return {
        "all_identical": bool(n) and same == n,
        "n_pairs": n,
        "basis": "/".join(IDENTITY_BASIS.get(b, b) for b in sorted(bases)) or None,
        "discordance_upper_bound": upper_bound_rate(n - same, n, confidence),
        "confidence": confidence,
    }


def seeds_shared(pairs: list[tuple[Record, Record]]) -> bool:
    """Whether both arms sent every paired request the same integer seed (`evalpipe run --sample-seeds`, or a lane
    seed), so their sampled outputs can be compared pair by pair: on a server whose tokens depend only on the
    prompt and the seed they are then identical wherever the two arms' distributions are."""

    def seed(rec: Record):
        value = (rec.request or {}).get("seed")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return bool(pairs) and all(seed(ra) is not None and seed(ra) == seed(rb) for ra, rb in pairs)


def flip_list(pairs: dict[tuple, tuple[Record, Record]], agreement: dict) -> list[dict]:
    """Every question answered right in exactly one arm, with what each arm said."""
    flips = []
    for key, (ra, rb) in pairs.items():
        ca, cb = is_correct(ra), is_correct(rb)
        if ca == cb:
            continue
        ag = agreement.get(key) or {}
        flips.append(
            {
                "question_id": key[1],
                "repeat_index": key[2],
                "direction": "gained" if cb else "lost",
                "expected_answer": rb.expected_answer,
                "answer_a": ra.extracted_answer,
                "answer_b": rb.extracted_answer,
                "correct_a": ca,
                "correct_b": cb,
                "finish_reason_a": ra.finish_reason,
                "finish_reason_b": rb.finish_reason,
                "tokens_a": completion_tokens(ra),
                "tokens_b": completion_tokens(rb),
                "error_a": ra.error.get("type") if ra.error else None,
                "error_b": rb.error.get("type") if rb.error else None,
                "divergence_position": ag.get("position"),
                "divergence_basis": ag.get("basis"),
                "logprob_gap": (ag.get("logprob") or {}).get("gap"),
            }
        )
    flips.sort(key=lambda f: _id_sort_key(f["question_id"]))
    return flips


def _id_sort_key(qid) -> tuple:
    if isinstance(qid, int):
        return (0, qid, "")
    return (1, 0, str(qid))


def _accuracy_block(over_a: dict, over_b: dict) -> dict:
    return {
        "a": over_a["accuracy"],
        "b": over_b["accuracy"],
        "denominator_a": over_a["n_planned"],
        "denominator_b": over_b["n_planned"],
        "diff": (over_b["accuracy"] - over_a["accuracy"])
        if over_a["accuracy"] is not None and over_b["accuracy"] is not None
        else None,
    }


def _add_repeated(
    result: dict, a: LoadedRun, b: LoadedRun, pairs: dict, common: list, *, margin_pts, seed, n_resamples
) -> None:
    """Repeated runs: per-question permutation statistics, and output agreement where both arms shared seeds."""
    oa: dict = {}
    ob: dict = {}
    for (_, qid, _), rec in a.by_key.items():
        oa.setdefault(qid, []).append(float(is_correct(rec)))
    for (_, qid, _), rec in b.by_key.items():
        ob.setdefault(qid, []).append(float(is_correct(rec)))
    ids = sorted(set(oa) & set(ob), key=_id_sort_key)
    result["repeated_stats"] = stats.compare_repeated(
        {q: np.array(oa[q]) for q in ids},
        {q: np.array(ob[q]) for q in ids},
        n_permutations=n_resamples,
        seed=seed,
        margin_pts=margin_pts,
    )
    if seeds_shared([pairs[k] for k in common]):  # both arms sent each (question, repeat) the same seed
        per_pair = {k: compare_outputs(*pairs[k]) for k in common}
        result["agreement"] = summarize_agreement(list(per_pair.items()))
        result["repeated_stats"]["output_identity"] = output_identity(result["agreement"])
    else:
        result["agreement"] = {
            "note": "not computed: the arms did not send every (question, repeat) the same seed "
            "(evalpipe run --sample-seeds BASE does)"
        }
    result["flips"] = []


def _add_greedy(result: dict, pairs: dict, common: list, *, margin_pts, seed, n_resamples) -> None:
    """Single-answer runs: paired accuracy statistics, McNemar per rate, agreement, flips and per-question rows."""
    ca = np.array([is_correct(pairs[k][0]) for k in common], dtype=bool)
    cb = np.array([is_correct(pairs[k][1]) for k in common], dtype=bool)
    greedy = stats.compare_greedy(ca, cb, margin_pts=margin_pts, n_resamples=n_resamples, seed=seed)
    result["greedy"] = greedy.to_dict()
    for name, pred in metrics.RATES:
        fa = np.array([pred(pairs[k][0]) for k in common], dtype=bool)
        fb = np.array([pred(pairs[k][1]) for k in common], dtype=bool)
        result["rates"][name]["mcnemar_p"] = stats.mcnemar_exact(int(np.sum(fb & ~fa)), int(np.sum(fa & ~fb)))
    per_pair = {k: compare_outputs(*pairs[k]) for k in common}
    result["agreement"] = summarize_agreement(list(per_pair.items()))
    result["greedy"]["output_identity"] = output_identity(result["agreement"])
    result["flips"] = flip_list(pairs, per_pair)
    result["per_question"] = [
        {
            "question_id": k[1],
            "correct_a": bool(x),
            "correct_b": bool(y),
            "identical": per_pair[k]["identical"],
            "divergence_position": per_pair[k]["position"],
        }
        for k, x, y in zip(common, ca, cb)
    ]


def _spec_blocks(a: LoadedRun, b: LoadedRun, recs_a: list, recs_b: list) -> dict:
    """Each arm's speculation facts, with the server's lossy acceptance and what an import did not record."""
    spec = {"a": spec_block(recs_a, a.summary), "b": spec_block(recs_b, b.summary)}
    for side, run in (("a", a), ("b", b)):
        server = lossy_acceptance((snapshot(run.manifest).get("server") or {}).get("server_info"))
        spec[side]["server_lossy_acceptance"] = server
        spec[side]["lossy"] = bool(server) or spec[side]["n_records_lossy"] > 0
        imported = run.manifest.get("imported")  # `evalpipe import`: the source may have kept no speculation facts
        spec[side]["not_recorded"] = isinstance(imported, dict) and "spec" in (imported.get("not_recorded") or [])
    return spec


def analyse(
    a: LoadedRun,
    b: LoadedRun,
    *,
    margin_pts: float,
    seed: int,
    n_resamples: int,
    intended: list[str],
    forced: list[str],
) -> dict:
    """The whole comparison of run A (reference) and run B (candidate)."""
    # A run folder holds one lane, so (question_id, repeat) names a record: pairing on it lets a forced comparison
    # of two lanes that ask the same questions (`evalpipe run arith` and an lm-eval import of its task) pair them
    join_a, join_b = {k[1:]: k for k in a.by_key}, {k[1:]: k for k in b.by_key}
    joined = sorted(set(join_a) & set(join_b), key=lambda j: (_id_sort_key(j[0]), j[1]))
    common = [join_a[j] for j in joined]
    only_a = sorted(join_a[j] for j in set(join_a) - set(join_b))
    only_b = sorted(join_b[j] for j in set(join_b) - set(join_a))
    pairs = {join_a[j]: (a.by_key[join_a[j]], b.by_key[join_b[j]]) for j in joined}
    over_a, over_b = arm_overview(a), arm_overview(b)
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "runs",
        "lane": a.lane,
        "forced": bool(forced),
        "forced_over": forced,
        "arms": {"a": over_a, "b": over_b},
        "accuracy": _accuracy_block(over_a, over_b),
        "paired_keys": len(common),
        "keys_only_in_a": [list(k[1:]) for k in only_a],
        "keys_only_in_b": [list(k[1:]) for k in only_b],
        "repeated": a.repeated or b.repeated,
        "settings": {
            "margin_pts": margin_pts,
            "seed": seed,
            "n_resamples": n_resamples,
            "confidence": stats.DEFAULT_CONFIDENCE,
        },
    }
    recs_a, recs_b = list(a.by_key.values()), list(b.by_key.values())
    result["rates"] = rate_block(recs_a, recs_b, over_a["n_planned"], over_b["n_planned"])
    settings = {"margin_pts": margin_pts, "seed": seed, "n_resamples": n_resamples}
    if result["repeated"]:
        _add_repeated(result, a, b, pairs, common, **settings)
    else:
        _add_greedy(result, pairs, common, **settings)
    result["spec"] = _spec_blocks(a, b, recs_a, recs_b)
    modes = {"a": a.deterministic, "b": b.deterministic}
    result["deterministic"] = {**modes, "note": determinism_note(modes.values())}
    result["speed"] = {"a": speed_stats(recs_a), "b": speed_stats(recs_b)}
    result["manifest_diff"] = manifest_differences(a.manifest, b.manifest, intended)
    return _clean(result)


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN and inf become null."""
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    return obj
