"""Fixtures shared by the engine test modules."""

import os
from pathlib import Path

import pytest
import torch

# pytest-xdist workers export COLUMNS=80 and LINES=24 as if a terminal were attached; the commands these tests
# start must see what a script that pipes their output sees (unbounded tables).
for _terminal_size in ("COLUMNS", "LINES"):
    os.environ.pop(_terminal_size, None)

# Triton builds its own language functions (tl.zeros, tl.sum, ...) for the interpreter or the compiler when triton is
# first imported, whatever TRITON_INTERPRET says later. Test folders collected before tests/kernels import triton
# through evalpipe.engine, so without CUDA (where Triton can only run interpreted) triton is imported here, in
# interpreter mode, before any of them; the variable is put back so servers and subprocesses do not inherit it.
if not torch.cuda.is_available():
    _interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:  # triton is optional on the CPU
        pass
    if _interpret is None:
        os.environ.pop("TRITON_INTERPRET")
    else:
        os.environ["TRITON_INTERPRET"] = _interpret

# One torch intra-op thread in every test process: the tiny model's and the kernel references' ops are overhead
# bound, so a second thread only adds barrier cost, and two workers' threads thrash on the 2-core machine
# (tests/kernels/test_kernels_moe.py + test_kernels_ratio2_compress.py under -n 2: 143-147 s with torch's default of 2
# threads, 110-121 s with one). The servers and subprocesses the tests start set their own (`serve --threads`,
# default 1).
torch.set_num_threads(1)

# The longest test files, longest first (seconds: sum of setup + call + teardown per file in a `-n 2` run of the
# suite on the quiet 2-core machine of 2026-12-06, `.ci/run` on a clean clone with `--junitxml`; the order matters,
# not the numbers). pyproject's addopts hand whole files to the two workers in collection order (`--dist loadfile
# --no-loadscope-reorder`); starting with the longest keeps a long file from starting last and running alone while the
# other worker idles (by xdist's default order, by number of tests, a long single-test file started last). Files not
# listed follow, in pytest's order. Refresh with `--durations` or `--junitxml`.
LONGEST_FIRST = [
    "engine/test_fault_matrix.py",  # 176
    "interop/test_lmeval.py",  # 86
    "benchmarks/test_smoke_serving.py",  # 75
    "interop/test_vllm_ab.py",  # 69
    "interop/test_vllm_peer.py",  # 69
    "qualify/test_qualify.py",  # 66
    "kernels/test_static_step_triton.py",  # 58
    "interop/test_vllm_vision.py",  # 58
    "ab/test_ab.py",  # 56
    "qualify/test_qualify_sampling.py",  # 51
    "benchmarks/test_smoke.py",  # 48
    "benchmarks/test_smoke_model.py",  # 47
    "engine/test_fault_matrix_seeded.py",  # 44
    "harness/test_accept_baseline.py",  # 40
    "harness/test_core_run.py",  # 39
    "kernels/test_kernels_moe.py",  # 36
    "lanes/test_chat_arith_boxed.py",  # 35
    "interop/test_vllm_qualify.py",  # 35
    "training/test_training_smoke.py",  # 34
    "harness/test_bench.py",  # 31
    "harness/test_sample_seeds.py",  # 30
    "engine/test_seeded_replay.py",  # 27
    "kernels/test_eager_attention_kernel.py",  # 26
    "kernels/test_kernels_hyper.py",  # 26
    "engine/test_prefix_cache.py",  # 26
    "engine/test_spec_lossless.py",  # 24
    "server/test_server_scoring.py",  # 24
    "engine/test_engine_oracle.py",  # 22
    "engine/test_model_config.py",  # 22
    "harness/test_import_sgl_eval.py",  # 21
    "server/test_spec_server.py",  # 21
    "commands/test_secret_scan.py",  # 21
    "engine/test_spec_acceptance.py",  # 21
    "engine/test_grammar_lossless.py",  # 20
    "kernels/test_kernels_mxfp8.py",  # 19
    "server/test_server_structured.py",  # 19
    "harness/test_deterministic_reporting.py",  # 18
    "harness/test_repeat.py",  # 18
    "launchers/test_launchers.py",  # 17
    "engine/test_overlap_schedule.py",  # 17
]


def pytest_collection_modifyitems(config, items):
    """Longest files first (LONGEST_FIRST); a stable sort, so each file's tests stay together and in order."""
    tests_dir = Path(__file__).parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def file_rank(item) -> int:
        try:
            return rank.get(item.path.relative_to(tests_dir).as_posix(), len(rank))
        except ValueError:  # a test outside tests/
            return len(rank)

    items.sort(key=file_rank)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private weight cache (EVALPIPE_CACHE_DIR-style) for the module's default-model runners."""
    return tmp_path_factory.mktemp("evalpipe-cache")


@pytest.fixture(scope="module")
def tiny_runner(cache_dir):
    """Factory: `tiny_runner(**kwargs)` is a ModelRunner on the random tiny model whose seeded weights are cached
    in the module's private cache (built once per module, reused by every runner after the first)."""
    from evalpipe.engine.model.names import TINY_MODEL_NAME
    from evalpipe.engine.runner import ModelRunner

    def make(**kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EVALPIPE_CACHE_DIR", str(cache_dir))
            return ModelRunner(kwargs.pop("model_path", TINY_MODEL_NAME), **kwargs)

    return make
