"""Read a run folder (responses.jsonl, summary.json, manifest.json) and decide whether two are comparable.

Two runs are comparable only when they asked the same questions the same way: equal prompt-stream
hashes, dataset hashes and lane protocols, and neither is partial. Anything else is refused unless
the user forces it, and the forced reasons are written into compare.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    SUMMARY_FILE,
    MalformedFile,
    Record,
    counted_records,
    read_json_object,
    read_records,
)
from evalpipe.harness.server_facts import find_key

# Manifest keys searched (depth first) for each identity; the first one found wins.
PROMPT_STREAM_KEYS = ("prompt_stream_sha256_selected", "prompt_stream_sha256")
DATASET_KEYS = ("dataset_sha256", "file_sha256", "data_sha256")
HELD_OUT_KEYS = ("held_out_ids_sha256", "id_list_sha256", "ids_sha256", "selected_ids_sha256")
LANE_SPEC_KEYS = ("lane_spec", "protocol", "lane_protocol")
OVERRIDES_KEYS = ("overrides",)


class RunFolderError(Exception):
    """A folder that is not a readable run folder."""


@dataclass
class LoadedRun:
    """A run folder read back for comparison (harness/run_folder.py's `RunFolder` writes one)."""

    path: Path
    records: list[Record]  # every record in file order, superseded duplicates included
    summary: dict
    manifest: dict
    bad_lines: int = 0  # 1 when the last line of responses.jsonl is cut off (a killed writer), else 0
    duplicates: int = 0
    by_key: dict[tuple, Record] = field(default_factory=dict)  # record_key -> the record that counts (records.py)

    @property
    def lane(self) -> str | None:
        lanes = {r.lane for r in self.records if r.lane is not None}
        if len(lanes) == 1:
            return next(iter(lanes))
        return self.summary.get("lane") or find_key(self.manifest, ("lane",))

    @property
    def arm(self) -> str:
        arms = {r.arm for r in self.records if r.arm}
        return self.summary.get("arm") or (next(iter(arms)) if len(arms) == 1 else self.path.name)

    @property
    def run_id(self) -> str:
        ids = {r.run_id for r in self.records if r.run_id}
        return next(iter(ids)) if len(ids) == 1 else self.path.name

    @property
    def repeated(self) -> bool:
        return any(int(r.repeat_index or 0) > 0 for r in self.records)

    @property
    def deterministic(self) -> bool | None:
        """The server's deterministic mode the run recorded: its manifest's server facts, else summary.json's;
        None when neither says (an older or imported run, a server that does not report it)."""
        server = snapshot(self.manifest).get("server")
        for value in ((server or {}).get("deterministic"), self.summary.get("server_deterministic")):
            if isinstance(value, bool):
                return value
        return None

    def partial_reasons(self) -> list[str]:
        reasons = []
        if self.summary.get("partial"):
            reasons.append("summary.json says partial: true")
        planned = self.summary.get("n_planned")
        if isinstance(planned, int) and len(self.by_key) < planned:
            reasons.append(f"{len(self.by_key)} of {planned} planned items have a record")
        if self.bad_lines:
            reasons.append(f"the last line of {RESPONSES_FILE} is cut off")
        if self.summary.get("manifest_changed") or self.manifest.get("consistent") is False:
            reasons.append("manifest changed between start and end of the run")
        return reasons


def snapshot(manifest: dict) -> dict:
    """The provenance snapshot `evalpipe run` wrote (end, else start); a flat manifest is its own snapshot."""
    for key in ("end", "start", "resume_start"):
        if isinstance(manifest.get(key), dict):
            return manifest[key]
    return manifest


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def prompt_stream_sha(manifest: dict) -> Any:
    """Hash of the prompts actually sent: the selected items' stream, else any prompt-stream hash recorded."""
    snap = snapshot(manifest)
    return (
        _get(snap, "prompts", "prompt_stream_sha256_selected")
        or _get(snap, "prompts", "prompt_stream_sha256")
        or find_key(snap, PROMPT_STREAM_KEYS)
    )


def dataset_sha(manifest: dict) -> Any:
    snap = snapshot(manifest)
    direct = _get(snap, "dataset", "sha256")
    if direct is not None:
        return direct
    return find_key(snap, DATASET_KEYS)


def held_out_sha(manifest: dict) -> Any:
    snap = snapshot(manifest)
    return _get(snap, "dataset", "selected_id_list_sha256") or find_key(snap, HELD_OUT_KEYS)


def lane_protocol(manifest: dict, summary: dict) -> Any:
    """Lane spec, the sampling parameters actually sent, and repeats: what the arms must share."""
    snap = snapshot(manifest)
    lane = snap.get("lane") if isinstance(snap.get("lane"), dict) else None
    if lane is not None and ("spec" in lane or "effective" in lane):
        eff = lane.get("effective") or {}
        return {"spec": lane.get("spec"), "params": eff.get("params"), "repeats": eff.get("repeats")}
    spec = find_key(snap, LANE_SPEC_KEYS)
    overrides = find_key(snap, OVERRIDES_KEYS)
    if spec is None and overrides is None:
        return None
    return {"spec": spec, "overrides": overrides or {}}


def load_run(path: str | Path) -> LoadedRun:
    """The run folder at `path`; RunFolderError (naming the file and line) when it is not one or cannot be read."""
    folder = Path(path)
    responses = folder / RESPONSES_FILE
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: not a directory")
    missing = [name for name in (MANIFEST_FILE, RESPONSES_FILE) if not (folder / name).is_file()]
    if missing:
        raise RunFolderError(f"{folder} is not a run folder (no {' and no '.join(missing)})")
    read = read_records(responses)
    if (
        read.bad_lines
    ):  # a torn last line is a partial run (refused, --force compares it); a bad line mid-file is damage
        raise RunFolderError(read.first_bad(responses))
    try:  # a line without a required key is damage too: named, like a line that is not JSON
        records = read.typed(responses)
    except MalformedFile as exc:
        raise RunFolderError(str(exc)) from None
    counted = counted_records(records)
    return LoadedRun(
        path=folder,
        records=records,
        summary=_read_json(folder / SUMMARY_FILE),
        manifest=_read_json(folder / MANIFEST_FILE),
        bad_lines=int(read.torn_tail),
        duplicates=counted.n_duplicates,
        by_key=counted.by_key,
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return read_json_object(path)
    except MalformedFile as exc:
        raise RunFolderError(str(exc)) from None


def comparability_problems(a: LoadedRun, b: LoadedRun) -> list[str]:
    """Every reason the two runs should not be compared; empty when they are comparable."""
    problems: list[str] = []
    if a.run_id and a.run_id == b.run_id:  # the same folder twice (or a copy): no difference by construction
        problems.append(f"both folders hold the same run {a.run_id!r} ({a.path} and {b.path})")
    if a.lane != b.lane:
        problems.append(f"lanes differ: {a.lane!r} vs {b.lane!r}")
    ha, hb = prompt_stream_sha(a.manifest), prompt_stream_sha(b.manifest)
    if ha is None or hb is None:
        missing = [str(r.path) for r, h in ((a, ha), (b, hb)) if h is None]
        problems.append(f"prompt-stream hash missing from manifest of {', '.join(missing)}")
    elif ha != hb:
        problems.append(f"prompt-stream hashes differ: {ha} vs {hb}")
    da, db = dataset_sha(a.manifest), dataset_sha(b.manifest)
    if da != db:
        problems.append(f"dataset hashes differ: {da} vs {db}")
    ia, ib = held_out_sha(a.manifest), held_out_sha(b.manifest)
    if ia != ib:
        problems.append(f"held-out id lists differ: {ia} vs {ib}")
    pa, pb = lane_protocol(a.manifest, a.summary), lane_protocol(b.manifest, b.summary)
    if pa != pb:
        problems.append("lane protocols differ: " + "; ".join(_dict_diff_lines(pa, pb)))
    for run, label in ((a, "A"), (b, "B")):
        for reason in run.partial_reasons():
            problems.append(f"run {label} ({run.path}) is partial: {reason}")
    if a.repeated != b.repeated:
        problems.append("one run has repeats (repeat_index > 0) and the other does not")
    return problems


def _dict_diff_lines(a: Any, b: Any, limit: int = 8) -> list[str]:
    fa, fb = flatten(a or {}), flatten(b or {})
    lines = [f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of nested dicts; lists are kept whole as values."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
    else:
        out[prefix or "value"] = obj
    return out
