"""The native engine: `evalpipe serve ...` as a child process, same interpreter, so an A/B can boot it fresh.

Only the flags the user gave are passed, so that an arm written `--speculative block` differs from its partner in
exactly that flag; flags this launcher does not know pass through to `evalpipe serve` untouched.
"""

from __future__ import annotations

import sys

from evalpipe.launchers.base import Launcher, fmt_number, require

PROFILES = ("off", "block")


class NativeLauncher(Launcher):
    engine = "native"
    health_path = "/health_generate"
    info_paths = ("/get_server_info", "/server_info")
    accept_rules = ("topk", "threshold")

    def validate(self) -> None:
        o = self.options
        require(
            o.speculative in (None, *PROFILES),
            f"the native engine's speculation is off or block; got {o.speculative!r} (dspark/eagle/nextn are sglang/vllm)",
        )
        require(o.tp is None and o.ep is None and o.dp is None, "--tp/--ep/--dp are for sglang/vllm; the native engine runs on one device")
        require(o.draft_model is None, "the native engine takes --drafter model:PATH, not --draft-model")
        require(
            o.spec_steps is None and o.spec_topk is None and o.spec_draft_tokens is None,
            "--spec-steps/--spec-topk/--spec-draft-tokens are sglang/vllm tree settings; the native engine takes --block-size",
        )
        require(o.engine_python is None, "--engine-python is for sglang/vllm; the native engine runs in this interpreter")
        require(o.ngram_min is None and o.ngram_max is None, "--ngram-min/--ngram-max are vllm ngram settings; "
                "the native engine takes --drafter ngram")
        require(not o.deterministic, "--deterministic is an sglang/vllm switch; the native engine is batch-invariant by design")
        if o.speculative in (None, "off"):
            require(o.block_size is None and o.drafter is None, "--block-size/--drafter need --speculative block")
            require(o.simulate_acc_len is None, "--simulate-acc-len needs --speculative block")

    @property
    def interpreter(self) -> str | None:
        return None if self.options.engine_command else sys.executable

    def command(self) -> list[str]:
        o = self.options
        argv = list(o.engine_command or (sys.executable, "-m", "evalpipe.cli", "serve"))
        argv += ["--host", o.host, "--port", str(o.port)]
        for flag, value in (
            ("--model", o.model),
            ("--tokenizer", o.tokenizer),
            ("--dtype", o.dtype),
            ("--device", o.device),
            ("--max-batch", o.max_batch),
            ("--api-key", o.api_key),
            ("--speculative", o.speculative),
            ("--block-size", o.block_size),
            ("--drafter", o.drafter),
        ):
            if value is not None:
                argv += [flag, str(value)]
        if o.simulate_acc_len is not None:
            argv += ["--simulate-acc-len", fmt_number(o.simulate_acc_len)]
        if o.spec_accept_topk is not None:
            argv += ["--spec-accept-topk", str(o.spec_accept_topk)]
        for flag, value in (("--spec-accept-threshold-single", o.spec_accept_threshold_single),
                            ("--spec-accept-threshold-acc", o.spec_accept_threshold_acc)):
            if value is not None:
                argv += [flag, fmt_number(value)]
        return argv + list(o.extra_args)
