"""`python -m evalpipe.launchers ...`: the launcher command on its own (same flags as `evalpipe serve --engine`)."""

from evalpipe.launchers.cli import command

if __name__ == "__main__":
    command(prog_name="python -m evalpipe.launchers")
