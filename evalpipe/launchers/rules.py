"""The rules the serve flags obey, one place each: the native engine's settings (`check_native`) and the lossy
acceptance flags (`check_acceptance`). `evalpipe serve` runs them before a native server loads in this process, and
the launchers when they are built (base.Launcher, native.NativeLauncher). Options are read by attribute
(`LaunchOptions`); a refusal is a LaunchConfigError, which the commands turn into a usage error (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from evalpipe.engine.config import ENGINE_DEFAULTS
from evalpipe.launchers.errors import LaunchConfigError, require

NATIVE_DTYPES = ("float32", "bfloat16")
NATIVE_DEVICES = ("cpu", "cuda")
NATIVE_MAX_BLOCK = 16
NATIVE_ACCEPT_RULES = ("topk", "threshold")  # the lossy acceptance rules the native engine offers on purpose


def check_native(o) -> None:
    """The native engine's flag rules, for `evalpipe serve` in this process and for the native launcher."""
    require(
        o.speculative in (None, "off", "block"),
        f"the native engine's speculation is off or block; got {o.speculative!r} (dspark/eagle/nextn are sglang/vllm)",
    )
    require(
        o.tp is None and o.ep is None and o.dp is None,
        "--tp/--ep/--dp are for sglang/vllm; the native engine runs on one device",
    )
    require(o.draft_model is None, "the native engine takes --drafter model:PATH, not --draft-model")
    require(
        o.spec_steps is None and o.spec_topk is None and o.spec_draft_tokens is None,
        "--spec-steps/--spec-topk/--spec-draft-tokens are sglang/vllm tree settings; the native engine takes "
        "--block-size",
    )
    require(o.engine_python is None, "--engine-python is for sglang/vllm; the native engine runs in this interpreter")
    require(
        o.tool_call_parser is None,
        "--tool-call-parser is a vllm setting; the native engine parses its own tool protocol",
    )
    require(
        o.ngram_min is None and o.ngram_max is None,
        "--ngram-min/--ngram-max are vllm ngram settings; the native engine takes --drafter ngram",
    )
    require(o.dtype in (None, *NATIVE_DTYPES), f"--dtype {o.dtype}: the native engine runs float32 or bfloat16")
    require(o.device in (None, *NATIVE_DEVICES), f"--device {o.device}: the native engine runs on cpu or cuda")
    if o.speculative in (None, "off"):
        require(o.block_size is None and o.drafter is None, "--block-size/--drafter need --speculative block")
        require(o.simulate_acc_len is None, "--simulate-acc-len needs --speculative block")
    g = ENGINE_DEFAULTS.block_size if o.block_size is None else o.block_size
    require(g <= NATIVE_MAX_BLOCK, f"--block-size {g}: the native engine drafts 1..{NATIVE_MAX_BLOCK} tokens")
    if o.simulate_acc_len is not None:
        require(
            1.0 <= o.simulate_acc_len <= g + 1,
            f"--simulate-acc-len must be in [1, G+1] = [1, {g + 1}] for --block-size {g}, got {o.simulate_acc_len}",
        )
    if o.drafter is not None:
        from evalpipe.engine.spec.settings import parse_drafter_spec

        try:
            kind, arg = parse_drafter_spec(o.drafter)
        except ValueError as exc:
            raise LaunchConfigError(f"--drafter: {exc}") from None
        require(kind != "model" or Path(arg).exists(), f"--drafter: draft model {arg} does not exist")
    if o.model is not None and not Path(o.model).exists():
        from evalpipe.engine.model.names import BUILTIN_MODEL_NAMES

        require(
            o.model in BUILTIN_MODEL_NAMES,
            f"--model {o.model} does not exist (built-in models: {', '.join(BUILTIN_MODEL_NAMES)})",
        )
    require(o.tokenizer is None or Path(o.tokenizer).exists(), f"--tokenizer {o.tokenizer} does not exist")


def check_acceptance(o, engine: str, rules: tuple[str, ...]) -> None:
    """--spec-accept-*: only where `engine` offers that rule (`rules`: "topk", "threshold"), with speculation on,
    not with simulated acceptance, one rule, sane values."""
    thresholds = [
        (flag, v)
        for flag, v in (
            ("--spec-accept-threshold-single", o.spec_accept_threshold_single),
            ("--spec-accept-threshold-acc", o.spec_accept_threshold_acc),
        )
        if v is not None
    ]
    given_flags = (["--spec-accept-topk"] if o.spec_accept_topk is not None else []) + [f for f, _ in thresholds]
    if not given_flags:
        return
    if o.spec_accept_topk is not None:
        require(
            "topk" in rules,
            f"{engine} has no top-k acceptance (--spec-accept-topk is a native-engine rule)"
            + ("; its lossy knobs are --spec-accept-threshold-single/-acc" if "threshold" in rules else ""),
        )
        require(
            o.spec_accept_topk >= 2,
            f"--spec-accept-topk {o.spec_accept_topk}: K = 1 is the exact greedy rule; a lossy top-k rule needs K >= 2",
        )
    if thresholds:
        require(
            "threshold" in rules,
            f"{engine} has no acceptance thresholds to loosen (--spec-accept-threshold-* "
            "are for the native engine and sglang)",
        )
        for flag, v in thresholds:
            require(
                0.0 <= v <= 1.0,
                f"{flag} {v} is not in the range 0.0<=x<=1.0: acceptance thresholds must be in [0, 1] (1.0 = lossless)",
            )
    profile = "block" if engine == "native" else "PROFILE"
    require(
        o.speculation_on,
        f"{'/'.join(given_flags)} need{'s' if len(given_flags) == 1 else ''} --speculative "
        f"{profile} (the acceptance flags need a speculation profile)",
    )
    require(
        o.simulate_acc_len is None or not o.lossy_acceptance,
        "--simulate-acc-len checks no draft, so an acceptance rule has nothing to decide",
    )
    require(
        o.spec_accept_topk is None or all(v == 1.0 for _, v in thresholds),
        "choose one lossy acceptance rule: --spec-accept-topk or the thresholds, not both",
    )


def check_debug_faults(faults, o) -> None:
    """--debug-fault (engine/faults.py): the speculation faults need --speculative block; batch-variant acts on the
    eager model only (--device cpu)."""
    from evalpipe.engine.faults import NEEDS_SPECULATION

    for name in faults:
        require(
            name not in NEEDS_SPECULATION or o.speculative == "block",
            f"--debug-fault {name} acts in the verify step: it needs --speculative block",
        )
        require(
            name != "batch-variant" or o.device in (None, "cpu"),
            "--debug-fault batch-variant acts on the eager model: --device cpu only",
        )
