"""The hook that gives `evalpipe serve` its `--engine` and `--dry-run` flags without touching the native server.

`commands/serve.py` ends with `command = with_engine_dispatch(command)`. A command line that asks for another
engine, or for a dry run, is parsed and run by the launcher command (`evalpipe.launchers.cli`); anything else goes
to the native `serve` unchanged, which also learns to accept (and ignore) an explicit `--engine native`.
"""

from __future__ import annotations

import click

from evalpipe.launchers import ENGINES


def wants_launcher(args: list[str]) -> bool:
    """True when the command line selects sglang/vllm or asks for --dry-run (before any `--`)."""
    for i, token in enumerate(args):
        if token == "--":
            break
        if token == "--dry-run":
            return True
        if token == "--engine" and i + 1 < len(args) and args[i + 1] != "native":
            return True
        if token.startswith("--engine=") and token.partition("=")[2] != "native":
            return True
    return False


class EngineDispatchCommand(click.Command):
    """Routes a `serve` command line to the native command or to the launcher command."""

    def __init__(self, native: click.Command):
        # the native parameters stay visible for introspection; parsing is always delegated in make_context
        super().__init__(native.name, params=native.params, help=native.help, short_help=native.short_help)
        self.native = native

    def make_context(self, info_name, args, parent=None, **extra):
        from evalpipe.launchers.cli import command as launcher_command

        target = launcher_command if wants_launcher(list(args)) else self.native
        return target.make_context(info_name, list(args), parent=parent, **extra)

    def invoke(self, ctx):
        return ctx.command.invoke(ctx)

    def get_help(self, ctx):
        return self.native.get_help(ctx)


def with_engine_dispatch(native: click.Command) -> click.Command:
    """Wrap the native `serve` command so that `--engine sglang|vllm` and `--dry-run` reach the launchers."""
    native.params.append(
        click.Option(
            ["--engine"],
            type=click.Choice(ENGINES),
            default="native",
            show_default=True,
            expose_value=False,
            help="Which server: native (this one), sglang or vllm. See `evalpipe serve --engine sglang --help`.",
        )
    )
    native.params.append(
        click.Option(
            ["--dry-run"],
            is_flag=True,
            expose_value=False,
            help="Print the command and environment, start nothing (the only way to exercise sglang/vllm "
            "where they are not installed).",
        )
    )
    return EngineDispatchCommand(native)
