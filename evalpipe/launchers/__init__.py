"""Launchers: start the native engine, SGLang or vLLM the same way, with clean environments and receipts.

flags.py is the one table of serve flags (`evalpipe serve`, `evalpipe ab` arms) and rules.py the rules they obey;
base.py the launcher interface and process handling, native/sglang/vllm.py each engine's argv; launch.py one
launch (dry run, boot, serve until interrupted); env.py and receipts.py the environment hygiene and receipts.
"""

from __future__ import annotations

from evalpipe.launchers.base import Launcher, LaunchOptions
from evalpipe.launchers.errors import LaunchConfigError, ServerStartError

ENGINES = ("native", "sglang", "vllm")


def make_launcher(options: LaunchOptions, parent_env=None) -> Launcher:
    """The launcher for `options.engine`; raises LaunchConfigError for settings that engine refuses."""
    if options.engine == "native":
        from evalpipe.launchers.native import NativeLauncher as cls
    elif options.engine == "sglang":
        from evalpipe.launchers.sglang import SGLangLauncher as cls
    elif options.engine == "vllm":
        from evalpipe.launchers.vllm import VLLMLauncher as cls
    else:
        raise LaunchConfigError(f"unknown engine {options.engine!r}; choose one of {', '.join(ENGINES)}")
    return cls(options, parent_env=parent_env)


__all__ = ["ENGINES", "LaunchConfigError", "LaunchOptions", "Launcher", "ServerStartError", "make_launcher"]
