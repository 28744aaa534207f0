"""`--help` explains every flag: each subcommand (and each `evalpipe import` tool) has a description, and every option
a help text, so no flag is a bare name in `--help`."""

from __future__ import annotations

import click

from evalpipe.cli import SUBCOMMANDS, main


def leaf_commands():
    ctx = click.Context(main)
    todo = [(f"evalpipe {name}", main.get_command(ctx, name)) for name in SUBCOMMANDS]
    while todo:
        name, cmd = todo.pop()
        if isinstance(cmd, click.Group):
            todo += [(f"{name} {sub}", cmd.get_command(ctx, sub)) for sub in cmd.list_commands(ctx)]
        else:
            yield name, cmd


def test_every_command_and_option_has_help():
    commands = dict(leaf_commands())
    assert {"evalpipe run", "evalpipe compare", "evalpipe import lm-eval", "evalpipe import sgl-eval"} <= set(commands)
    missing = [f"{name}: no description" for name, cmd in commands.items() if not (cmd.help or "").strip()]
    missing += [
        f"{name} {'/'.join(p.opts)}"
        for name, cmd in commands.items()
        for p in cmd.params
        if isinstance(p, click.Option) and not (p.help or "").strip()
    ]
    assert missing == [], missing
