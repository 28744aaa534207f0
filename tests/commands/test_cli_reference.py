"""docs/cli/ is generated from the click commands (docs/cli/generate.py): the committed pages equal what `--help`
prints, so a changed flag without regenerated pages fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATE = ROOT / "docs" / "cli" / "generate.py"


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True, timeout=120)


def test_the_committed_pages_match_every_commands_help():
    done = generate("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_page_that_differs_from_help_or_a_stray_page_fails_the_check(tmp_path):
    assert generate("--pages", str(tmp_path)).returncode == 0
    run_page = tmp_path / "run.md"
    assert "--base-url" in run_page.read_text() and "Usage: evalpipe run" in run_page.read_text()
    assert generate("--check", "--pages", str(tmp_path)).returncode == 0
    run_page.write_text(run_page.read_text().replace("--base-url", "--base-uri"))
    (tmp_path / "old-command.md").write_text("# gone\n")
    done = generate("--check", "--pages", str(tmp_path))
    assert done.returncode == 1
    assert "run.md" in done.stdout and "old-command.md" in done.stdout
    assert generate("--bogus").returncode == 2
