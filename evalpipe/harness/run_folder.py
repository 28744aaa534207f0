"""A run's folder on disk and the one owner of its manifest.json.

`RunFolder.create` makes `<out>/<lane>/<run_id>/` with a manifest holding the start snapshot. `RunFolder.resume`
reopens one for `--resume`: it refuses when the protocol changed, keeps the records that count (records.py's
duplicate rule) unless they are errors, moves the rest to superseded.jsonl and appends a `resumes` entry.
`finish` writes the end snapshot and summary.json, then pins the records file's sha256 in the manifest.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from evalpipe.digest import file_sha256
from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness.prepare import PreparedRun, RunError
from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    SUPERSEDED_FILE,
    MalformedFile,
    Record,
    counted_records,
    read_records,
    rewrite_records,
    write_json,
)
from evalpipe.redact import scrub_values


@dataclass
class RunFolder:
    path: Path
    run_id: str
    manifest: dict  # written (with the API key scrubbed) by write_manifest only
    kept: list[Record]  # the records a resume keeps (they are not sent again); empty for a new run
    resumed: Optional[dict]  # this resume's entry in manifest["resumes"], None for a new run
    api_key: Optional[str] = None

    @classmethod
    def create(cls, prepared: PreparedRun) -> "RunFolder":
        cfg = prepared.cfg
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        run_id = f"{cfg.arm}-{stamp}-{secrets.token_hex(3)}"
        path = Path(cfg.out_dir) / prepared.lane.name / run_id
        path.mkdir(parents=True, exist_ok=False)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "run_id": run_id,
            "arm": cfg.arm,
            "lane": prepared.lane.name,
            "command_line": cfg.command_line,
            "started_at": time.time(),
            "start": None,
            "end": None,
        }
        folder = cls(path, run_id, manifest, [], None, cfg.api_key)
        manifest["start"] = prepared.snapshot(prepared.server.facts)
        folder.write_manifest()
        return folder

    @classmethod
    def resume(cls, prepared: PreparedRun) -> "RunFolder":
        path = Path(prepared.cfg.resume_dir)
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        resume_start = prepared.snapshot(prepared.server.facts)
        # the address may change (a restarted server, another host name); the server it reaches is compared
        protocol, _ = manifest_mod.differences(_without_base_url(manifest["start"]), _without_base_url(resume_start))
        if protocol:  # checked before the folder is touched
            raise RunError("cannot resume: the protocol changed since the run started:\n  " + "\n  ".join(protocol))
        read = read_records(path / RESPONSES_FILE)
        if read.bad_lines:
            raise RunError(f"{path / RESPONSES_FILE}: lines {read.bad_lines[:10]} are not JSON; refusing to resume")
        try:
            records = read.typed(path / RESPONSES_FILE)
        except MalformedFile as exc:
            raise RunError(f"{exc}; refusing to resume") from None
        # the records that count (records.py) stay, unless they are errors: those are retried. The files are
        # rewritten from the raw objects, so a line keeps every key it had (Record holds only its fields).
        counted = {id(r) for r in counted_records(records).by_key.values() if not r.error}
        keep = [r for r in records if id(r) in counted]
        keep_raw = [raw for raw, r in zip(read.records, records) if id(r) in counted]
        superseded = [raw for raw, r in zip(read.records, records) if id(r) not in counted]
        if superseded:
            with open(path / SUPERSEDED_FILE, "a", encoding="utf-8") as fh:
                for raw in superseded:
                    fh.write(json.dumps(raw, ensure_ascii=False) + "\n")
        if superseded or read.torn_tail:
            rewrite_records(path / RESPONSES_FILE, keep_raw)
        resumed = {
            "at": time.time(),
            "kept_records": len(keep),
            "superseded_error_records": len(superseded),
            "dropped_torn_line": read.torn_tail,
        }
        manifest.setdefault("resumes", []).append(resumed)
        manifest["resume_start"] = resume_start
        folder = cls(path, manifest["run_id"], manifest, keep, resumed, prepared.cfg.api_key)
        folder.write_manifest()
        return folder

    @property
    def responses(self) -> Path:
        return self.path / RESPONSES_FILE

    def write_manifest(self) -> None:
        write_json(self.path / MANIFEST_FILE, scrub_values(self.manifest, [self.api_key or ""]))

    def record_end(self, end: dict) -> list[str]:
        """Store the end snapshot and how it differs from the start (or this resume's start); the protocol
        differences are returned (they go into the summary too)."""
        start = self.manifest.get("resume_start") or self.manifest["start"]
        protocol, warnings = manifest_mod.differences(start, end)
        self.manifest["end"] = end
        self.manifest["finished_at"] = time.time()
        self.manifest["consistent"] = not protocol
        self.manifest["differences"] = protocol
        self.manifest["code_changes_during_run"] = warnings
        return protocol

    def write_summary(self, summary: dict) -> None:
        """summary.json, then the manifest with the counts and the records file's sha256 as it stands now: audit
        catches any later edit, including one that leaves every grade and count unchanged."""
        write_json(self.path / SUMMARY_FILE, summary)
        self.manifest["counts"] = {k: summary.get(k) for k in ("n_planned", "n_records", "n_errors", "n_truncated")}
        self.manifest["responses_sha256"] = file_sha256(self.responses)
        self.write_manifest()

    def resume_command(self, recorded_url: str) -> str:
        """The exact command that continues this run (the endpoint comes from its manifest unless it moved)."""
        cmd = ["evalpipe", "run", "--resume", str(self.path)]
        if recorded_url != self.manifest["start"]["endpoint"]["base_url"]:
            cmd += ["--base-url", recorded_url]
        line = shlex.join(cmd)
        if self.api_key:
            line += "   # with the same key in EVALPIPE_API_KEY (or --api-key)"
        return line


def _without_base_url(snapshot: dict) -> dict:
    endpoint = {k: v for k, v in (snapshot.get("endpoint") or {}).items() if k != "base_url"}
    return {**snapshot, "endpoint": endpoint}
