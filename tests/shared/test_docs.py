"""The docs cannot drift from the tree: every relative link in README.md, docs/ and benchmarks/README.md points at a
file that exists (and at a heading that exists, when it names one), and every repository path or `python -m` module
they name in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")])
TOP_FOLDERS = ("evalpipe", "tests", "benchmarks", "training", "docs", "lm_eval_tasks", "datasets", "manifests", ".ci")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^(?:\./)?((?:%s)/[\w./*-]*)" % "|".join(re.escape(f) for f in TOP_FOLDERS))
MODULE = re.compile(r"python3? -m ((?:benchmarks|evalpipe|training)(?:\.\w+)+)(?![<\w])")
PEER_PATHS = ("tests/v1/",)  # vLLM's test tree, cited by name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*?", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def prose(page: Path) -> str:
    """The page without its fenced code blocks (commands there may name files that a run creates)."""
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


def missing_paths(page: Path) -> list[str]:
    bad = []
    text = page.read_text()
    for code in CODE.findall(text):
        for token in code.split():
            m = PATH.match(token.strip("'\",;:()"))
            if (
                m
                and not m.group(1).startswith(PEER_PATHS)
                and "<" not in token
                and "{" not in token
                and not list(ROOT.glob(m.group(1).rstrip("/.") or "."))
            ):
                bad.append(m.group(1))
    for module in MODULE.findall(text):
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
            bad.append(f"python -m {module}")
    return sorted(set(bad))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page):
    assert missing_paths(page) == []


def test_the_checks_catch_a_broken_link_a_missing_heading_and_a_missing_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [gone](nowhere.md) [bad](#no-such-heading)\n"
        "`evalpipe/cli.py` `evalpipe/no_such_module.py` `python -m benchmarks.no_such_script`\n"
    )
    assert broken_links(page) == [
        "nowhere.md: no such file",
        "#no-such-heading: no heading #no-such-heading in page.md",
    ]
    assert missing_paths(page) == ["evalpipe/no_such_module.py", "python -m benchmarks.no_such_script"]
