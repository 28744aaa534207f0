"""sgl-eval (0.1.x) output, one run folder `<out-dir>/sgl_eval_<name>_<stamp>/`, as an evalpipe run folder.

sgl-eval writes `metrics.json` (benchmark name, repeats, generation config, endpoint, model, its version, the
aggregate) and `output-rs<r>.jsonl` per repeat r: per example its `id`, the raw `generation`, `expected_answer`,
`predicted_answer`, the 0/1 score (`symbolic_correct`; RULER2's `is_correct`), `finish_reason`, token counts, the
problem text and generation start/end times. It records neither the rendered prompt nor the request body, usage
beyond completion and reasoning tokens, token ids, speculative statistics or server facts.

`question_id` is sgl-eval's `id`, `repeat_index` the r of the file; the prompt hash is over the problem text (the
template that wraps it is the same for every example of one benchmark and prompt, recorded in the task config).
For the math benchmarks sgl-eval grades with NeMo-Skills' last-`\\boxed{}` extractor and `math_equal`, which are
evalpipe's `ns_last_boxed` grader: audit re-grades them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness.imports import (
    Imported,
    ImportSourceError,
    config_sha256,
    files_sha256,
    read_jsonl,
    record_prompt_sha256,
)
from evalpipe.harness.records import MalformedFile, read_json_object
from evalpipe.lanes import canonical_json, sha256_hex

TOOL = "sgl-eval"
NOT_RECORDED = [
    "rendered prompt (the problem text is kept)",
    "request body",
    "usage.prompt_tokens",
    "spec",
    "output_token_ids",
    "logprobs",
    "reasoning_text",
    "matched_stop",
    "server facts",
]
SCORE_FIELDS = ("symbolic_correct", "is_correct")
_OUTPUT = re.compile(r"^output-rs(\d+)\.jsonl$")
# the metrics.json keys that describe what was asked (compared between arms); the rest are results or volatile
PROTOCOL_KEYS = (
    "name",
    "num_examples",
    "n_repeats",
    "gen",
    "prompt",
    "bench_args",
    "preset",
    "model_preset",
    "ns_commit_sha",
)


def _record(n: int, row: dict, path: Path, rep: int) -> dict:
    for key in ("id", "generation", "expected_answer"):
        if key not in row:
            raise ImportSourceError(f"{path}:{n}: not an sgl-eval prediction (no {key!r})")
    field = next((f for f in SCORE_FIELDS if f in row), None)
    if field is None:
        raise ImportSourceError(f"{path}:{n}: no score field ({' or '.join(SCORE_FIELDS)})")
    if not isinstance(row[field], bool) and row[field] not in (0, 1):
        raise ImportSourceError(
            f"{path}:{n}: {field} is {row[field]!r}, not 0 or 1; evalpipe's paired statistics "
            "need a right/wrong outcome"
        )
    finish = row.get("finish_reason")
    start, end = row.get("generation_start_time"), row.get("generation_end_time")
    usage = {"completion_tokens": row.get("num_generated_tokens"), "reasoning_tokens": row.get("num_reasoning_tokens")}
    predicted = row.get("predicted_answer")
    error = (
        {"type": "source_error", "status": None, "message": "sgl-eval recorded finish_reason 'error'"}
        if finish == "error"
        else None
    )
    return {
        "question_id": row["id"],
        "repeat_index": rep,
        "prompt_sha256": record_prompt_sha256(row.get("problem")),
        "request": None,
        "response_text": row.get("generation") or "",
        "finish_reason": finish,
        "truncated": finish == "length",
        "error": error,
        "usage": usage if any(v is not None for v in usage.values()) else None,
        "latency_s": end - start if isinstance(start, (int, float)) and isinstance(end, (int, float)) else None,
        "extracted_answer": predicted,
        "expected_answer": row["expected_answer"],
        "correct": bool(row[field]),
        "grade_status": "request_error" if error else ("ok" if predicted is not None else "no_answer"),
        "source": {"file": path.name, "line": n, "score_field": field, "problem": row.get("problem")},
    }


def load(source: Path) -> Imported:
    source = Path(source)
    if not source.is_dir():
        raise ImportSourceError(f"{source}: not a folder (give sgl-eval's run folder, sgl_eval_<name>_<stamp>)")
    metrics_path = source / "metrics.json"
    outputs = sorted((int(m.group(1)), p) for p in source.iterdir() if (m := _OUTPUT.match(p.name)))
    if not outputs:
        raise ImportSourceError(f"{source}: no output-rs<r>.jsonl (sgl-eval writes them unless --no-dump-predictions)")
    if not metrics_path.is_file():
        raise ImportSourceError(
            f"{source}: no metrics.json beside the output-rs*.jsonl files (an interrupted sgl-eval run writes it last)"
        )
    try:
        meta = read_json_object(metrics_path)
    except MalformedFile as exc:
        raise ImportSourceError(str(exc)) from None
    if "name" not in meta or "aggregate" not in meta:
        raise ImportSourceError(f"{metrics_path}: not sgl-eval's metrics.json (no 'name' and 'aggregate')")
    reps = [r for r, _ in outputs]
    if reps != list(range(len(reps))):
        raise ImportSourceError(f"{source}: output files for repeats {reps}; expected 0..{len(reps) - 1}")
    records, seen = [], {}
    for rep, path in outputs:
        for n, row in read_jsonl(path):
            rec = _record(n, row, path, rep)
            key = (rec["question_id"], rep)
            if key in seen:
                raise ImportSourceError(f"{path}:{n}: id {rec['question_id']!r} again (first on line {seen[key]})")
            seen[key] = n
            records.append(rec)
    name = str(meta["name"])
    protocol = {k: meta.get(k) for k in PROTOCOL_KEYS if k in meta}
    from evalpipe.lanes.sgl_eval_adapter import eval_category

    grader = "ns_last_boxed" if eval_category(name) == "math" else None
    return Imported(
        tool=TOOL,
        version=meta.get("sgl_eval_version"),
        lane=f"{TOOL}/{name}",
        run_id=f"{TOOL}-{name}-{meta.get('timestamp') or source.name}",
        model=meta.get("model"),
        base_url=meta.get("base_url"),
        records=records,
        task_config=protocol,
        params=meta.get("gen") if isinstance(meta.get("gen"), dict) else {},
        repeats=len(outputs),
        grader=grader,
        created_at=None,
        source={
            "source_dir": str(source.resolve()),
            "files_sha256": files_sha256([metrics_path] + [p for _, p in outputs]),
            "benchmark": name,
            "model_args": {
                "base_url": meta.get("base_url"),
                "model": meta.get("model"),
                "num_threads": meta.get("num_threads"),
            },
            "task_config_sha256": config_sha256(protocol),
            "source_score": _score(meta.get("aggregate")),
            "source_aggregate": meta.get("aggregate"),
            "partial": bool(meta.get("partial")),
            "planned_examples": meta.get("planned_examples"),
        },
        not_recorded=list(NOT_RECORDED),
        dataset_sha256=dataset_sha256(records),
    )


def dataset_sha256(records: list[dict]) -> str:
    """Identity of the problems asked: (id, problem sha256) pairs, sorted."""
    return sha256_hex(
        canonical_json(
            sorted((str(r["question_id"]), r.get("prompt_sha256") or "") for r in records if r["repeat_index"] == 0)
        )
    )


def _score(aggregate: Any) -> Optional[float]:
    if not isinstance(aggregate, dict):
        return None
    for key in ("score", "pass@1"):
        if isinstance(aggregate.get(key), (int, float)):
            return float(aggregate[key])
    return None
