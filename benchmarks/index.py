"""benchmarks/README.md's index table, built from benchmarks/latest.json (the one record of the latest numbers).

Each entry's `howto` is the anchor of the README section that says how to run the script and where its earlier
measurements are; tests/shared/test_docs.py checks that the section exists.

    python -m benchmarks.index           # rewrite the table between the README's markers
    python -m benchmarks.index --check   # exit 1 if the README's table is not the JSON's

tests/benchmarks/test_index.py runs the check, so the README and the JSON cannot drift apart."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LATEST = HERE / "latest.json"
README = HERE / "README.md"
BEGIN, END = "<!-- index: built from latest.json by `python -m benchmarks.index` -->", "<!-- end of index -->"
FIELDS = ("script", "question", "figure", "unit", "date", "machine", "command", "howto")


def load(path: Path = LATEST) -> list[dict]:
    entries = json.loads(path.read_text())
    for e in entries:
        missing = [f for f in FIELDS if f not in e]
        if missing:
            raise ValueError(f"{path}: {e.get('script', '?')} lacks {missing}")
    return entries


def render(entries: list[dict]) -> str:
    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    lines = ["| script | question | latest figure | measured | command | how to |", "|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(
            f"| [`{e['script']}`]({e['script']}) | {cell(e['question'])} | **{e['figure']:g}** {cell(e['unit'])} "
            f"| {e['date']}, {cell(e['machine'])} | `{cell(e['command'])}` | [how to](#{e['howto']}) |"
        )
    return "\n".join(lines)


def table_in(readme: str) -> str:
    """The text between the README's index markers."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if the README's table differs")
    args = ap.parse_args(argv)
    text, table = README.read_text(), render(load())
    if args.check:
        if table_in(text) != table:
            print("benchmarks/README.md's index is not latest.json's: run `python -m benchmarks.index`")
            return 1
        return 0
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
