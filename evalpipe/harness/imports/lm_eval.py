"""lm-evaluation-harness (0.4.x) output, `--output_path DIR --log_samples`, as an evalpipe run folder.

lm-eval writes `DIR/<model>/results_<date>.json` (scores, task configs, model args, its version) and one
`samples_<task>_<date>.jsonl` per task: per document and filter its doc_id, doc, target, the request arguments
(prompt and generation kwargs, or the choices of a loglikelihood task), the raw and filtered responses, the metric
values and sha256 hashes of doc, prompt and target. It records no finish reason, usage, latency, token ids or
server facts: those are null in the records and listed in `imported.not_recorded`.

One task and one filter become one run folder: `question_id` is lm-eval's doc_id, `correct` the per-document value
of one 0/1 metric (exact_match, acc, ...). A generate_until document's response is its generation and its extracted
answer the filtered response; a multiple-choice document's response is the continuation with the highest
loglikelihood, its extracted answer that choice's index and `logprobs` every choice's loglikelihood.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness.imports import (
    Imported,
    ImportSourceError,
    config_sha256,
    files_sha256,
    id_order,
    read_jsonl,
    record_prompt_sha256,
)
from evalpipe.harness.records import MalformedFile, read_json_object
from evalpipe.lanes import canonical_json, sha256_hex

TOOL = "lm-eval"
NOT_RECORDED = [
    "finish_reason",
    "usage",
    "latency_s",
    "spec",
    "output_token_ids",
    "reasoning_text",
    "matched_stop",
    "request body (the prompt and generation kwargs are kept)",
    "server facts",
]
SAMPLE_KEYS = ("doc_id", "doc", "target", "arguments", "resps", "filtered_resps", "filter", "metrics")
_NUMBER = re.compile(r"\s*[(\[]?\s*(-?(?:inf|[0-9.]+(?:e[-+]?[0-9]+)?))")
# lm-eval names its results `results_<date>.json`, or `<stem>_<date>.json` when --output_path is `<stem>.json`
_RESULTS = re.compile(r"^.+_(\d{4}-\d\d-\d\dT[0-9.\-]+)\.json$")
_SAMPLES = re.compile(r"samples_(.+)_(\d{4}-\d\d-\d\dT[0-9.\-]+)\.jsonl$")


def find_run(source: Path, task: Optional[str]) -> tuple[Path, dict, Path, str]:
    """(results file, its JSON, samples file, task) of the one run under `source` (a folder or a results file)."""
    source = Path(source)
    if source.is_file():
        results_files = [source]
    elif source.is_dir():
        results_files = sorted(p for p in source.rglob("results_*.json") if _RESULTS.search(p.name))
    else:
        raise ImportSourceError(f"{source}: no such file or folder")
    if not results_files:
        raise ImportSourceError(
            f"{source}: no lm-eval results_*.json here (run lm_eval with --output_path DIR "
            "--log_samples, then import DIR)"
        )
    if len(results_files) > 1:
        raise ImportSourceError(
            f"{source} holds {len(results_files)} lm-eval runs ("
            + ", ".join(str(p) for p in results_files[:5])
            + "); import one results_*.json file"
        )
    results_path = results_files[0]
    match = _RESULTS.search(results_path.name)
    if not match:
        raise ImportSourceError(f"{results_path}: not an lm-eval results file (name results_<date>.json)")
    date_id = match.group(1)
    try:
        results = read_json_object(results_path)
    except MalformedFile as exc:
        raise ImportSourceError(str(exc)) from None
    if not isinstance(results.get("configs"), dict) or not isinstance(results.get("results"), dict):
        raise ImportSourceError(f"{results_path}: not an lm-eval results file (no 'results' and 'configs')")
    samples = {
        m.group(1): p
        for p in results_path.parent.glob(f"samples_*_{date_id}.jsonl")
        if (m := _SAMPLES.search(p.name)) and m.group(2) == date_id
    }
    if not samples:
        raise ImportSourceError(
            f"{results_path.parent}: no samples_<task>_{date_id}.jsonl beside {results_path.name} "
            "(lm_eval writes them only with --log_samples)"
        )
    if task is None:
        if len(samples) > 1:
            raise ImportSourceError(
                f"{results_path.parent} has samples of {len(samples)} tasks ({', '.join(sorted(samples))}); "
                "choose one with --task"
            )
        task = next(iter(samples))
    if task not in samples:
        raise ImportSourceError(
            f"no samples of task {task!r} beside {results_path} (it has: {', '.join(sorted(samples))})"
        )
    if task not in results["configs"]:
        raise ImportSourceError(f"{results_path}: no config of task {task!r}")
    return results_path, results, samples[task], task


def _generation(sample: dict) -> bool:
    first = sample["arguments"].get("gen_args_0") if isinstance(sample["arguments"], dict) else None
    return isinstance(first, dict) and isinstance(first.get("arg_1"), dict)


def _choose(lines: list[tuple[int, dict]], path: Path, filter_name: Optional[str], metric: Optional[str]):
    filters = list(dict.fromkeys(s.get("filter") for _, s in lines))
    if filter_name is None:
        filter_name = filters[0]
    elif filter_name not in filters:
        raise ImportSourceError(f"{path}: no filter {filter_name!r} (it has: {', '.join(map(str, filters))})")
    chosen = [(n, s) for n, s in lines if s.get("filter") == filter_name]
    metrics = chosen[0][1].get("metrics") or []
    if metric is None:
        if not metrics:
            raise ImportSourceError(f"{path}:{chosen[0][0]}: the sample names no metric")
        metric = metrics[0]
    elif metric not in metrics:
        raise ImportSourceError(f"{path}: no metric {metric!r} (it has: {', '.join(map(str, metrics))})")
    return filters, filter_name, chosen, metric


def _record(n: int, s: dict, path: Path, metric: str, lm_fallback: str) -> dict:
    missing = [k for k in SAMPLE_KEYS if k not in s]
    if missing:
        raise ImportSourceError(f"{path}:{n}: not an lm-eval sample (no {', '.join(missing)})")
    value = s.get(metric)
    if isinstance(value, bool) or value in (0, 1):
        correct = bool(value)
    else:
        raise ImportSourceError(
            f"{path}:{n}: metric {metric!r} is {value!r}, not 0 or 1 per document; evalpipe's "
            "paired statistics need a right/wrong outcome (choose another with --metric)"
        )
    args = s["arguments"]
    first = args.get("gen_args_0") or {}
    prompt = first.get("arg_0")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a chat request: lm-eval logs the messages as one JSON string in a list (and hashes it)
    source = {
        "file": path.name,
        "line": n,
        "filter": s["filter"],
        "metrics": {m: s.get(m) for m in s["metrics"]},
        "doc": s["doc"],
        "target": s["target"],
        "doc_hash": s.get("doc_hash"),
        "prompt_hash": s.get("prompt_hash"),
        "target_hash": s.get("target_hash"),
    }
    rec: dict[str, Any] = {
        "question_id": s["doc_id"],
        "repeat_index": 0,
        "prompt_sha256": record_prompt_sha256(prompt),
        "expected_answer": s["target"],
        "correct": correct,
        "source": source,
    }
    if _generation(s):
        gens = s["resps"][0] if s["resps"] else []
        if len(gens) != 1:
            raise ImportSourceError(
                f"{path}:{n}: {len(gens)} generations for one document (task repeats); "
                "evalpipe import takes one generation per document"
            )
        filtered = s["filtered_resps"][0] if s["filtered_resps"] else None
        rec.update(
            request={"prompt": prompt, "generation_kwargs": first.get("arg_1")},
            response_text=gens[0],
            extracted_answer=filtered,
            grade_status="no_answer" if filtered in (None, "", lm_fallback) else "ok",
        )
    else:  # loglikelihood: one (context, continuation) per choice; the answer is the best-scoring choice
        choices = [args[k].get("arg_1") for k in sorted(args, key=lambda k: int(k.rsplit("_", 1)[-1]))]
        lls = [_loglikelihood(x) for x in s["filtered_resps"]]
        best = best_choice({"choice_loglikelihoods": lls})
        rec.update(
            request={"prompt": prompt, "choices": choices},
            response_text=choices[best] if best is not None else "",
            extracted_answer=best,
            logprobs={"choice_loglikelihoods": lls},
            grade_status="ok" if best is not None else "no_answer",
        )
    return rec


def best_choice(logprobs: Any) -> Optional[int]:
    """Index of the highest choice loglikelihood (the first of equals, as lm-eval's argmax), None without them."""
    lls = (logprobs or {}).get("choice_loglikelihoods") if isinstance(logprobs, dict) else None
    if not lls or any(not isinstance(x, (int, float)) for x in lls):
        return None
    return max(range(len(lls)), key=lambda i: (lls[i], -i))


def _loglikelihood(resp: Any) -> Optional[float]:
    """A choice's loglikelihood from its logged response: [loglikelihood, is_greedy], which lm-eval's sanitising
    may have turned into strings (["-0.26", "False"], or "(-0.26, False)")."""
    if isinstance(resp, (list, tuple)) and resp:
        resp = resp[0]
    if isinstance(resp, str):
        match = _NUMBER.match(resp)
        resp = match.group(1) if match else None
    try:
        return float(resp) if resp is not None and not isinstance(resp, bool) else None
    except (TypeError, ValueError):
        return None


def load(
    source: Path, *, task: Optional[str] = None, filter_name: Optional[str] = None, metric: Optional[str] = None
) -> Imported:
    results_path, results, samples_path, task = find_run(source, task)
    lines = read_jsonl(samples_path)
    if not lines:
        raise ImportSourceError(f"{samples_path}: no samples")
    filters, filter_name, chosen, metric = _choose(lines, samples_path, filter_name, metric)
    config = results["configs"][task]
    fallback = "[invalid]"  # lm-eval's regex filter default when nothing matches
    records = [_record(n, s, samples_path, metric, fallback) for n, s in chosen]
    seen: dict = {}
    for (n, _), r in zip(chosen, records):
        if r["question_id"] in seen:
            raise ImportSourceError(
                f"{samples_path}:{n}: doc_id {r['question_id']!r} again (first on line {seen[r['question_id']]})"
            )
        seen[r["question_id"]] = n
    model_args = (results.get("config") or {}).get("model_args")
    base_url = model_args.get("base_url") if isinstance(model_args, dict) else None
    lane_meta = (
        (config.get("metadata") or {}).get("evalpipe_lane") if isinstance(config.get("metadata"), dict) else None
    )
    grader = _grader_of(lane_meta) if config.get("output_type") == "generate_until" else None
    score_key = f"{metric},{filter_name}"
    first_gen = next(
        (r["request"].get("generation_kwargs") for r in records if "generation_kwargs" in r["request"]), None
    )
    return Imported(
        tool=TOOL,
        version=results.get("lm_eval_version"),
        lane=f"{TOOL}/{task}",
        run_id=f"{TOOL}-{task}-{_RESULTS.match(results_path.name).group(1)}",
        model=results.get("model_name") or (model_args.get("model") if isinstance(model_args, dict) else None),
        base_url=base_url,
        records=records,
        task_config={
            "task": task,
            "config": task_protocol(config, model_args),
            "filter": filter_name,
            "metric": metric,
            "n_shot": (results.get("n-shot") or {}).get(task),
            "version": (results.get("versions") or {}).get(task),
        },
        params=first_gen or {},
        repeats=1,
        grader=grader,
        created_at=_number(results.get("date")),
        source={
            "source_dir": str(results_path.parent.resolve()),
            "results_file": results_path.name,
            "samples_file": samples_path.name,
            "files_sha256": files_sha256([results_path, samples_path]),
            "task": task,
            "filter": filter_name,
            "filters_in_file": filters,
            "metric": metric,
            "model": results.get("model_source") or (results.get("config") or {}).get("model"),
            "model_args": model_args,
            "task_config_sha256": config_sha256(config),
            "source_score": (results["results"].get(task) or {}).get(score_key),
            "source_task_hash": (results.get("task_hashes") or {}).get(task),
            "n_samples": (results.get("n-samples") or {}).get(task),
            "limit": (results.get("config") or {}).get("limit"),
        },
        not_recorded=list(NOT_RECORDED),
        dataset_sha256=dataset_sha256(records),
    )


def dataset_sha256(records: list[dict]) -> str:
    """Identity of the documents asked: lm-eval's doc hashes in doc-id order."""
    ordered = sorted(records, key=lambda r: id_order(r["question_id"]))
    return sha256_hex(canonical_json([(r.get("source") or {}).get("doc_hash") for r in ordered]))


def task_protocol(config: dict, model_args: Any) -> dict:
    """The task config without what lm-eval copies into its metadata from the command line: the model args (the
    server address differs between arms; they are kept in `imported.model_args`) and the YAML's path."""
    meta = config.get("metadata")
    if not isinstance(meta, dict):
        return config
    drop = set(model_args) if isinstance(model_args, dict) else set()
    drop.add("config_source")
    return {**config, "metadata": {k: v for k, v in meta.items() if k not in drop}}


def _grader_of(lane_name: Optional[str]) -> Optional[str]:
    """evalpipe's grader of the lane an evalpipe task YAML names (metadata.evalpipe_lane), else None."""
    if not lane_name:
        return None
    from evalpipe.lanes import LANE_MODULES, get_lane

    return get_lane(lane_name).grader if lane_name in LANE_MODULES else None


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) else None


def doc_hash(doc: Any) -> str:
    """lm-eval's doc_hash: sha256 of the doc as `json.dumps(doc, indent=2, ensure_ascii=False)`."""
    return sha256_hex(json.dumps(doc, indent=2, ensure_ascii=False, default=str))


def task_hash(records: list[dict]) -> Optional[str]:
    """lm-eval's task hash over the samples in file order (doc + prompt + target hash each)."""
    parts = [(r["source"] or {}) for r in sorted(records, key=lambda r: (r["source"] or {}).get("line", 0))]
    if not all(p.get("doc_hash") and p.get("prompt_hash") and p.get("target_hash") for p in parts):
        return None
    return sha256_hex("".join(p["doc_hash"] + p["prompt_hash"] + p["target_hash"] for p in parts))
