"""benchmarks/README.md's index is built from benchmarks/latest.json and lists every script, so the two cannot drift
apart and a new script cannot be left out of either."""

from __future__ import annotations

import json

import pytest

from benchmarks import index


def test_the_readme_table_is_the_json():
    assert index.main(["--check"]) == 0, "run `python -m benchmarks.index` after editing benchmarks/latest.json"


def test_every_script_has_one_entry_that_exists():
    listed = [e["script"] for e in index.load()]
    on_disk = sorted(p.relative_to(index.HERE).as_posix() for p in index.HERE.glob("*/*.py") if p.name != "__init__.py")
    assert sorted(listed) == on_disk
    for e in index.load():
        assert e["command"].startswith("python -m benchmarks." + e["script"][: -len(".py")].replace("/", "."))


def test_the_check_fails_on_a_changed_figure(tmp_path, monkeypatch):
    entries = index.load()
    entries[0]["figure"] = entries[0]["figure"] + 1
    changed = tmp_path / "latest.json"
    changed.write_text(json.dumps(entries))
    monkeypatch.setattr(index, "LATEST", changed)
    monkeypatch.setattr(index, "load", lambda path=changed: json.loads(path.read_text()))
    assert index.main(["--check"]) == 1


def test_an_entry_missing_a_field_is_refused(tmp_path):
    bad = tmp_path / "latest.json"
    bad.write_text(json.dumps([{"script": "x/y.py", "question": "q"}]))
    with pytest.raises(ValueError, match="lacks"):
        index.load(bad)
