"""The one exception a command raises for malformed input: its message names the file and line, exit status 2."""

from __future__ import annotations

import click


class BadInput(click.ClickException):
    """A file or folder given on the command line is not what it should be (exit 2, like a usage error)."""

    exit_code = 2
