"""The native engine: `evalpipe serve ...` as a child process, same interpreter, so an A/B can boot it fresh.

Only the flags the user gave are passed, so that an arm written `--speculative block` differs from its partner in
exactly that flag; flags this launcher does not know pass through to `evalpipe serve` untouched.
"""

from __future__ import annotations

import sys

from evalpipe.launchers.base import Launcher, fmt_number
from evalpipe.launchers.rules import NATIVE_ACCEPT_RULES, check_native


class NativeLauncher(Launcher):
    engine = "native"
    health_path = "/health_generate"
    info_paths = ("/get_server_info", "/server_info")
    accept_rules = NATIVE_ACCEPT_RULES

    def validate(self) -> None:
        check_native(self.options)

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
        for key in o.more_api_keys:
            argv += ["--api-key", key]
        if o.deterministic:
            argv += ["--deterministic"]
        if o.simulate_acc_len is not None:
            argv += ["--simulate-acc-len", fmt_number(o.simulate_acc_len)]
        if o.spec_accept_topk is not None:
            argv += ["--spec-accept-topk", str(o.spec_accept_topk)]
        for flag, value in (
            ("--spec-accept-threshold-single", o.spec_accept_threshold_single),
            ("--spec-accept-threshold-acc", o.spec_accept_threshold_acc),
        ):
            if value is not None:
                argv += [flag, fmt_number(value)]
        return argv + list(o.extra_args)
