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
# (tests/kernels/test_kernels_moe.py + test_kernels_c2.py under -n 2: 143-147 s with torch's default of 2 threads,
# 110-121 s with one). The servers and subprocesses the tests start set their own (`serve --threads`, default 1).
torch.set_num_threads(1)

# The longest test files on the 2-core CI machine, longest first (seconds: sum of setup + call + teardown in a full
# run under `-n 2`, before the vLLM and smoke-training tests were made cheaper; the order matters, not the numbers).
# pyproject's addopts hand whole files to the two workers in collection order
# (`--dist loadfile --no-loadscope-reorder`); starting with the longest keeps a long file from starting last and
# running alone while the other worker idles (by xdist's default order, by number of tests, test_vllm_ab.py and its
# single 250 s test started last). Files not listed follow, in pytest's order. Refresh with `--durations`.
LONGEST_FIRST = [
    "engine/test_fault_matrix.py",  # 7 servers, every detector (628 s in the 2026-12-04 full run, before its cut)
    "interop/test_lmeval.py",  # its module fixture: 137 s in a loaded full run (2026-12-03)
    "qualify/test_qualify.py",  # 139
    "ab/test_ab.py",  # 130
    "kernels/test_kernels_moe.py",  # 121
    "kernels/test_kernels_c2.py",  # 118
    # the benchmark scripts' --smoke runs, split by folder: about 110, 90 and 86 s in a run of tests/benchmarks alone
    # under -n 2 on the shared machine (before the split and one torch thread each: one 250 s file)
    "benchmarks/test_smoke_serving.py",
    "interop/test_vllm_peer.py",  # 117
    "server/test_server_structured.py",  # 106
    "engine/test_spec_acceptance.py",  # 100
    "harness/test_accept_baseline.py",  # 106 in a loaded full run, 38 alone
    "kernels/test_eager_attention_kernel.py",  # 95 in a loaded full run, 38 alone
    "interop/test_vllm_ab.py",  # 64 alone (two vLLM boots)
    "harness/test_core_run.py",  # 89
    "benchmarks/test_smoke.py",  # 90 (kernels, engine, harness)
    "benchmarks/test_smoke_model.py",  # 86
    "commands/test_secret_scan.py",  # 86
    "server/test_spec_server.py",  # 80
    "kernels/test_static_step_triton.py",  # 65
    "kernels/test_kernels_mxfp8.py",  # 59
    "engine/test_engine_process.py",  # 57
    "engine/test_spec_lossless.py",  # 53
    "engine/test_prefix_cache.py",  # 45
    "server/test_server_startup.py",  # 45
    "server/test_server_api.py",  # 43
    "engine/test_engine_oracle.py",  # 41
    "training/test_training_smoke.py",  # 40
    "kernels/test_kernels_q_rope.py",  # 37
    "engine/test_engine_fused_sites.py",  # 36
    "harness/test_bench.py",  # 34
    "harness/test_repeat.py",  # 34
    "server/test_server_hostile.py",  # 30
    "server/test_server_scoring.py",  # 30 alone
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
