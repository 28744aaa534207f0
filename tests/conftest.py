"""Fixtures shared by the engine test modules."""

import os

import pytest
import torch

# pytest-xdist workers export COLUMNS=80 and LINES=24 as if a terminal were attached; the commands these tests
# start must see what a script that pipes their output sees (unbounded tables).
for _terminal_size in ("COLUMNS", "LINES"):
    os.environ.pop(_terminal_size, None)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: the tiny model's ops are overhead bound, so extra threads only add barrier
    cost, and they thrash on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private weight cache (EVALPIPE_CACHE_DIR-style) for the module's default-model runners."""
    return tmp_path_factory.mktemp("evalpipe-cache")


@pytest.fixture(scope="module")
def tiny_runner(cache_dir):
    """Factory: `tiny_runner(**kwargs)` is a ModelRunner on the random tiny model whose seeded weights are cached
    in the module's private cache (built once per module, reused by every runner after the first)."""
    from evalpipe.engine.runner import ModelRunner

    from evalpipe.engine.model.config import TINY_MODEL_NAME

    def make(**kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EVALPIPE_CACHE_DIR", str(cache_dir))
            return ModelRunner(kwargs.pop("model_path", TINY_MODEL_NAME), **kwargs)

    return make
