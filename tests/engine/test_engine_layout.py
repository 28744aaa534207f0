"""evalpipe/engine/__init__.py is the engine's map: its docstring names every module and subpackage of the engine, so
a file added without a line there fails here."""

from __future__ import annotations

from pathlib import Path

import evalpipe.engine as engine

ENGINE = Path(engine.__file__).parent


def test_the_engine_docstring_names_every_file_and_subpackage():
    doc = engine.__doc__
    modules = sorted(p.name for p in ENGINE.glob("*.py") if p.name != "__init__.py")
    packages = sorted(f"{p.name}/" for p in ENGINE.iterdir() if (p / "__init__.py").exists())
    assert len(modules) > 10 and packages
    assert [name for name in modules + packages if name not in doc] == []
