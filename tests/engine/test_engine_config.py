"""EngineConfig (engine/config.py) is the one place the native engine's defaults are written: every field is an
`evalpipe serve` flag of the same name with the same default, the module imports no torch, and the flags become
the config a server runs with."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import click
import pytest

from evalpipe.commands.serve import command as serve_command
from evalpipe.engine.config import DEFAULT_TOKENS_PER_STEP, ENGINE_DEFAULTS, EngineConfig
from evalpipe.launchers.flags import parse_serve_args
from evalpipe.server.state import ServerSettings

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def field_default(name: str):
    f = FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def serve_params() -> dict[str, click.Parameter]:
    return {p.name: p for p in serve_command.params}


def flag_mismatches(params: dict[str, click.Parameter]) -> list[str]:
    """Every EngineConfig field without a serve flag of its name, or whose flag's default is neither the field's
    nor None with the field's default in the help (the shared flags, where None means "the engine's default")."""
    problems = []
    for name in FIELDS:
        param = params.get(name)
        if param is None:
            problems.append(f"{name}: no serve flag")
            continue
        want = field_default(name)
        if param.multiple:
            got = tuple(param.default or ())
            if got != tuple(want):
                problems.append(f"{name}: flag default {got!r}, field default {want!r}")
        elif param.default is None:
            if want is not None and name != "max_tokens_per_step" and f"[default: {want}]" not in (param.help or ""):
                problems.append(f"{name}: flag default None and its help does not state [default: {want}]")
        elif param.default != want:
            problems.append(f"{name}: flag default {param.default!r}, field default {want!r}")
    return problems


def test_every_engine_field_is_a_serve_flag_with_the_fields_default():
    assert flag_mismatches(serve_params()) == []


def test_the_check_fails_for_a_missing_flag_or_a_drifted_default():
    params = serve_params()
    without = {k: v for k, v in params.items() if k != "prefix_cache"}
    assert flag_mismatches(without) == ["prefix_cache: no serve flag"]
    drifted = dict(params)
    drifted["max_queue"] = click.Option(["--max-queue"], default=ENGINE_DEFAULTS.max_queue + 1)
    assert flag_mismatches(drifted) == [
        f"max_queue: flag default {ENGINE_DEFAULTS.max_queue + 1}, field default {ENGINE_DEFAULTS.max_queue}"
    ]
    silent = dict(params)
    silent["block_size"] = click.Option(["--block-size"], default=None, help="drafts per verify")
    assert flag_mismatches(silent) == [
        f"block_size: flag default None and its help does not state [default: {ENGINE_DEFAULTS.block_size}]"
    ]


def test_max_tokens_per_step_follows_the_device_unless_given():
    assert EngineConfig().max_tokens_per_step == DEFAULT_TOKENS_PER_STEP["cpu"]
    assert EngineConfig(device="cuda").max_tokens_per_step == DEFAULT_TOKENS_PER_STEP["cuda"]
    assert EngineConfig(device="cuda", max_tokens_per_step=77).max_tokens_per_step == 77
    help_text = serve_params()["max_tokens_per_step"].help
    assert f"{DEFAULT_TOKENS_PER_STEP['cpu']} on the CPU, {DEFAULT_TOKENS_PER_STEP['cuda']} with" in help_text


def test_serve_flags_become_the_engine_config():
    options, _ = parse_serve_args(
        [
            "--speculative",
            "block",
            "--block-size",
            "3",
            "--max-queue",
            "9",
            "--debug-fault",
            "stale-kv-after-reject",
            "--debug-fault",
            "greedy-sampling",
            "--prefix-cache",
            "off",
            "--deterministic",
        ]
    )
    config = options.native
    assert (config.speculative, config.block_size, config.max_queue, config.prefix_cache) == ("block", 3, 9, "off")
    assert config.deterministic is True and options.deterministic is True
    assert config.debug_faults == ("greedy-sampling", "stale-kv-after-reject")  # sorted, as faults_of reads them
    changed = {"speculative", "block_size", "max_queue", "debug_faults", "prefix_cache", "deterministic"}
    untouched = {n for n in FIELDS} - changed
    assert {n: getattr(config, n) for n in untouched} == {n: getattr(ENGINE_DEFAULTS, n) for n in untouched}
    sglang, _ = parse_serve_args(["--engine", "sglang", "--model", "m", "--speculative", "eagle"])
    assert sglang.native is None and "native" not in sglang.recorded()


def test_settings_report_one_flat_mapping_without_secrets():
    settings = ServerSettings(EngineConfig(block_size=7), port=5, api_key="sk-secret-value-123456")
    public = settings.public()
    assert public["block_size"] == 7 and public["port"] == 5 and "engine" not in public
    assert "sk-secret-value-123456" not in repr(public)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.engine.block_size = 3  # type: ignore[misc]


def test_engine_config_imports_no_torch():
    code = "import sys, evalpipe.engine.config, evalpipe.launchers.flags; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
