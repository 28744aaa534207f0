"""The `evalpipe` command line: one lazily imported module per subcommand.

Subcommands live in `evalpipe/commands/<name>.py` and export a click command named `command`.
Lazy loading keeps `evalpipe run` from importing torch and `evalpipe serve` from importing graders.
"""

from __future__ import annotations

import importlib

import click

from evalpipe import __version__

# name -> (module, one-line help shown in `evalpipe --help` without importing the module)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "lanes": ("evalpipe.commands.lanes", "List the evaluation lanes and their protocol parameters."),
    "run": ("evalpipe.commands.run", "Run a lane against an OpenAI-compatible endpoint and record every response."),
    "audit": ("evalpipe.commands.audit", "Re-check a run folder: prompt hashes, grades, summary, manifest."),
    "serve": ("evalpipe.commands.serve", "Start a server (native engine by default) behind an OpenAI-compatible API."),
    "compare": ("evalpipe.commands.compare", "Compare two run (or bench) folders side by side with paired statistics."),
    "plan": (
        "evalpipe.commands.plan",
        "Questions and repeats a non-inferiority margin needs; each lane's detectable drop.",
    ),
    "repeat": ("evalpipe.commands.repeat", "Repeatability protocol: distinct completions over N identical requests."),
    "bench": ("evalpipe.commands.bench", "Streamed decode-throughput protocol against an endpoint."),
    "ab": ("evalpipe.commands.ab", "Boot arm A and arm B fresh, run lanes on each, compare, write one report."),
    "import": ("evalpipe.commands.import_run", "Turn an lm-eval or sgl-eval run into an evalpipe run folder."),
    "qualify": (
        "evalpipe.commands.qualify",
        "Serving qualification gates (keys, retrieval, boundaries, mixed, "
        "structured, soak, reference) against an endpoint.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module_name, short_help = SUBCOMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            return _unavailable(name, short_help)
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, help_) for name, (_, help_) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, short_help: str) -> click.Command:
    def callback(**_):
        raise click.ClickException(f"`evalpipe {name}` is not available in this build.")

    return click.Command(name, callback=callback, help=short_help, context_settings={"ignore_unknown_options": True})


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="evalpipe")
def main():
    """evalpipe: serve, evaluate and compare speculative decoding on vs off."""


if __name__ == "__main__":
    main()
