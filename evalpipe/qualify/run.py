"""One qualification: check the input, ask the server who it is, run the selected gates, write the folder.

The folder (`--out`): qualify.json (every request with its checks and verdict, per gate, and the overall verdict),
manifest.json (the same provenance as a `run`: code, packages, the server's facts at start and at end and whether
they moved) and report.html. Nothing in it carries a key: every write is scrubbed of the keys given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

from evalpipe.harness import client as http
from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness.client import EndpointError, Server
from evalpipe.harness.records import MANIFEST_FILE, write_json
from evalpipe.harness.server_facts import deterministic_label, deterministic_mode
from evalpipe.qualify import (
    EXIT_BAD_INPUT,
    EXIT_CANNOT_CONNECT,
    EXIT_GATE_FAILED,
    EXIT_INTERRUPTED,
    EXIT_PASS,
    GATES,
    auth,
    consistency,
    kv_pressure,
    reference,
    report,
    retrieval,
    sampling,
    server_sizes,
    soak,
    structured,
    vision,
)
from evalpipe.qualify.core import Endpoint, GateResult, QualifyConfig, bounded
from evalpipe.redact import redact_text, scrub_values

RESULT_FILE = "qualify.json"
SCHEMA = "evalpipe-qualify/1"


class QualifyError(Exception):
    """Qualification cannot start; `code` is the exit code (bad input or cannot connect)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def check_input(cfg: QualifyConfig) -> Optional[dict]:
    """The loaded reference when comparing; QualifyError(EXIT_BAD_INPUT) for settings that cannot work."""
    if cfg.record_reference and cfg.reference:
        raise QualifyError("give --record-reference or --reference, not both", EXIT_BAD_INPUT)
    if "reference" in cfg.gates and not (cfg.record_reference or cfg.reference):
        raise QualifyError("gate reference needs --record-reference FILE or --reference FILE", EXIT_BAD_INPUT)
    if (Path(cfg.out_dir) / RESULT_FILE).exists():
        raise QualifyError(
            f"{cfg.out_dir} already holds a qualification ({RESULT_FILE}); choose another --out", EXIT_BAD_INPUT
        )
    if cfg.receipt is not None:
        try:
            server_sizes.read_receipt(cfg.receipt)
        except ValueError as exc:
            raise QualifyError(f"--receipt: {exc}", EXIT_BAD_INPUT) from None
    if cfg.reference and "reference" in cfg.gates:
        try:
            return reference.load(cfg.reference)
        except reference.ReferenceError as exc:
            raise QualifyError(str(exc), EXIT_BAD_INPUT) from None
    return None


def connect(cfg: QualifyConfig) -> tuple[str, dict, Optional[int]]:
    """(model, server facts, the model's context length if listed); QualifyError when it cannot be used."""
    with Server(cfg.base_url, cfg.api_key) as server:
        try:
            models = server.models()
        except EndpointError as exc:
            text = str(exc)
            if " returned HTTP 401" in text or " returned HTTP 403" in text:
                raise QualifyError(
                    f"{text} (the --api-key given is refused, or none was given)", EXIT_BAD_INPUT
                ) from None
            raise QualifyError(text, EXIT_CANNOT_CONNECT) from None
        served = [m["id"] for m in models["data"]]
        model = cfg.model or served[0]
        if model not in served:
            raise QualifyError(
                f"--model {model!r} is not served by {cfg.base_url} (it lists: {', '.join(served)})", EXIT_BAD_INPUT
            )
        path, info = server.server_info()
    listed = next((m.get("max_model_len") for m in models["data"] if m["id"] == model), None)
    facts = {"models": models, "server_info_path": path, "server_info": info, "deterministic": deterministic_mode(info)}
    return model, facts, listed


def exposed_sizes(cfg: QualifyConfig, info) -> dict:
    """server_sizes.gather over the server's report, its /metrics and its launch receipt (--receipt, else the
    newest receipt in results/receipts/ of a server still running at this address), with the receipt's path."""
    path = cfg.receipt or server_sizes.find_receipt(cfg.base_url)
    receipt = server_sizes.read_receipt(path) if path else None
    sizes = server_sizes.gather(info, server_sizes.cache_config_info(cfg.base_url, cfg.api_key), receipt)
    sizes["receipt"] = str(path) if path else None
    return sizes


def _snapshot(cfg: QualifyConfig, model: str, facts: dict) -> dict:
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("api_keys", "command_line", "base_url")
    }
    settings["api_keys"] = len(cfg.api_keys)
    return manifest_mod.capture(
        lane_desc={"name": "qualify", "gates": list(cfg.gates)},
        overrides={},
        effective=settings,
        transport={"timeout_s": cfg.timeout_s, "max_retries": 0, "retry_policy": "none: every failure counts"},
        data_facts={},
        prompt_facts={},
        endpoint={"base_url": redact_text(cfg.base_url), "model": model},
        server=facts,
    )


async def run_gates(ep: Endpoint, ref: Optional[dict], say) -> list[GateResult]:
    cfg = ep.cfg
    results = []
    for name in (g for g in GATES if g in cfg.gates):
        say(f"gate {name}: running" + (f" for {cfg.soak_s:g} s" if name == "soak" else ""))
        t0 = time.perf_counter()
        try:
            result = await _gate(name, ep, ref)
        except Exception as exc:  # a gate that breaks is a failed gate with its reason, never a lost run
            result = GateResult(
                name,
                problem=f"the gate stopped on an error: {type(exc).__name__}: {bounded(exc)}",
                wall_s=time.perf_counter() - t0,
            )
        say(
            f"gate {name}: {result.verdict} ({result.passed}/{len(result.records)} requests passed, "
            f"{result.wall_s:.1f} s){'' if result.verdict == 'pass' else ': ' + result.reason}"
        )
        results.append(result)
    return results


async def _gate(name: str, ep: Endpoint, ref: Optional[dict]) -> GateResult:
    cfg = ep.cfg
    if name == "auth":
        return await asyncio.to_thread(auth.run, ep)
    if name == "reference":
        return await (
            reference.record(ep, cfg.record_reference)
            if cfg.record_reference
            else reference.compare(ep, ref, cfg.reference)
        )
    if name == "retrieval":
        return await retrieval.run(ep)
    if name == "boundaries":
        return await consistency.run_boundaries(ep)
    if name == "mixed":
        return await consistency.run_mixed(ep)
    if name == "structured":
        return await structured.run(ep)
    if name == "sampling":
        return await sampling.run(ep)
    if name == "vision":
        return await vision.run(ep)
    if name == "kv-pressure":
        return await kv_pressure.run(ep)
    return await soak.run(ep)


def execute(
    cfg: QualifyConfig, say=lambda line: print(f"evalpipe qualify: {line}", file=sys.stderr)
) -> tuple[int, dict]:
    """Run the qualification; (exit code, the qualify.json content). QualifyError when it cannot start."""
    ref = check_input(cfg)
    model, facts, listed_context = connect(cfg)
    say(f"server deterministic: {deterministic_label(facts['deterministic'])}")
    if cfg.max_context <= 0:
        cfg = dataclasses.replace(cfg, max_context=int(listed_context or 4096))
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema_version": SCHEMA,
        "kind": "qualify",
        "command_line": cfg.command_line,
        "started_at": time.time(),
        "start": _snapshot(cfg, model, facts),
        "end": None,
    }
    keys = list(cfg.api_keys)
    write_json(out_dir / MANIFEST_FILE, scrub_values(manifest, keys))
    sizes = exposed_sizes(cfg, facts.get("server_info"))
    ep = Endpoint(cfg, model, facts, sizes)
    interrupted = False
    results: list[GateResult] = []

    async def main():
        async with ep:
            results.extend(await run_gates(ep, ref, say))

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
    with Server(cfg.base_url, cfg.api_key) as server:
        end = _snapshot(cfg, model, server.describe())
    protocol, warnings = manifest_mod.differences(manifest["start"], end)
    manifest.update(
        end=end,
        finished_at=time.time(),
        consistent=not protocol,
        differences=protocol,
        code_changes_during_run=warnings,
    )
    failed = [r.name for r in results if r.verdict not in ("pass", "skipped")]
    code = EXIT_INTERRUPTED if interrupted else (EXIT_GATE_FAILED if failed or protocol else EXIT_PASS)
    result = {
        "schema": SCHEMA,
        "verdict": "pass" if code == EXIT_PASS else ("interrupted" if interrupted else "fail"),
        "exit_code": code,
        "failed_gates": failed,
        "manifest_changed": bool(protocol),
        "manifest_changes": protocol,
        "out_dir": str(out_dir),
        "endpoint": {
            "base_url": redact_text(cfg.base_url),
            "model": model,
            "server_info_path": facts.get("server_info_path"),
            "deterministic": facts.get("deterministic"),
            "sizes": sizes,
        },
        "settings": manifest["start"]["lane"]["effective"],
        "gates": [r.to_json() for r in results],
        "retry_policy": http.RETRY_POLICY + " (qualify sends no retries)",
    }
    result = scrub_values(result, keys)
    write_json(out_dir / RESULT_FILE, result)
    write_json(out_dir / MANIFEST_FILE, scrub_values(manifest, keys))
    report.write_html(result, out_dir)
    return code, result
