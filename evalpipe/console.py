"""The rich Console every command prints tables with.

On a terminal rich fits the terminal. Piped or redirected (a log, `| tee`, CI), rich would assume 80 columns and
cut or fold table cells; there the width is unbounded instead (COLUMNS still wins when set), so a saved log
holds every value whole.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, TextIO

from rich.console import Console

PIPED_WIDTH = 10_000


def make_console(stderr: bool = False, file: Optional[TextIO] = None) -> Console:
    """A console on stdout (stderr), or into `file` (unbounded width, as when piped)."""
    if file is not None:
        return Console(file=file, soft_wrap=True, width=PIPED_WIDTH)
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, soft_wrap=True, width=PIPED_WIDTH if piped else None)
