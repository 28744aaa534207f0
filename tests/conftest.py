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
# suite on the quiet 2-core machine of 2026-12-06, `--junitxml`; ~: estimated after a later cut or for a file that run
# skipped; the order matters, not the numbers). pyproject's addopts hand whole files to the two workers in collection
# order (`--dist loadfile --no-loadscope-reorder`); starting with the longest keeps a long file from starting last and
# running alone while the other worker idles (by xdist's default order, by number of tests, a long single-test file
# started last). Files not listed follow, in pytest's order. Refresh with `--durations` or `--junitxml`, but keep the
# vLLM files away from the fault matrix: it runs up to four busy processes at once, and a vLLM server beside it gets a
# share of one core (the same suite, sorted strictly by time, put test_vllm_peer.py beside it: that file 69 -> 98-105 s
# and the suite 970-976 s with this order against 1,035-1,061 s, in four clean-clone CI runs of 2026-12-06).
LONGEST_FIRST = [
    "engine/test_fault_matrix.py",  # ~115 (170 before smaller gate, greedy and T = 1 budgets; 216 before that)
    "benchmarks/test_smoke_serving.py",  # 97
    "benchmarks/test_smoke.py",  # 86
    "interop/test_lmeval.py",  # 83
    "interop/test_vllm_vision.py",  # ~80 (a vLLM boot; it needs the real model, which that run lacked)
    "interop/test_vllm_peer.py",  # 78
    "interop/test_vllm_ab.py",  # 73
    "harness/test_core_run.py",  # 72
    "qualify/test_qualify.py",  # 72
    "kernels/test_static_step_triton.py",  # 67
    "ab/test_ab.py",  # 64
    "benchmarks/test_smoke_model.py",  # 61
    "harness/test_accept_baseline.py",  # ~57 (92 before arith at 64 tokens and a shared boot)
    "engine/test_fault_matrix_seeded.py",  # ~57 (four --deterministic boots), not yet timed in CI
    "qualify/test_qualify_sampling.py",  # 53
    "harness/test_sample_seeds.py",  # 46
    "kernels/test_kernels_moe.py",  # 44
    "training/test_training_smoke.py",  # 42
    "harness/test_bad_input.py",  # 41
    "commands/test_secret_scan.py",  # 40
    "harness/test_import_sgl_eval.py",  # 40
    "interop/test_vllm_qualify.py",  # 38
    "lanes/test_chat_arith_boxed.py",  # ~38 (44 before 2 questions on the real server, not 3)
    "harness/test_bench.py",  # 35
    "server/test_spec_server.py",  # 35
    "engine/test_seeded_replay.py",  # 28
    "kernels/test_eager_attention_kernel.py",  # 26
    "kernels/test_kernels_hyper.py",  # 26
    "harness/test_deterministic_reporting.py",  # 25
    "engine/test_prefix_cache.py",  # 24
    "server/test_server_scoring.py",  # 23
    "engine/test_engine_oracle.py",  # 21
    "engine/test_spec_lossless.py",  # 21
    "engine/test_spec_acceptance.py",  # 21
    "kernels/test_kernels_attention.py",  # 21
    "training/test_build_real_model.py",  # ~20 (it needs the real model, which that run lacked)
    "compare/test_compare.py",  # 20
    "engine/test_overlap_schedule.py",  # 20
    "kernels/test_kernels_mxfp8.py",  # 20
    "server/test_server_structured.py",  # 20
    "launchers/test_launchers.py",  # 20
    "harness/test_run_exit_codes.py",  # 19
    "engine/test_grammar_lossless.py",  # 19
    "kernels/test_kernels_q_rope.py",  # 18
    "kernels/test_kernels_ratio2_compress.py",  # 18
    "harness/test_repeat.py",  # 18
    "compare/test_verdict.py",  # 17
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


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A private weight cache (EVALPIPE_CACHE_DIR-style) for the test process's default-model runners: its entries
    are keyed by the config's hash, so every module reuses the seeded tiny checkpoint the first one built."""
    return tmp_path_factory.mktemp("evalpipe-cache")


@pytest.fixture(scope="module")
def tiny_runner(cache_dir):
    """Factory: `tiny_runner(**kwargs)` is a ModelRunner on the random tiny model whose seeded weights are cached
    in the test process's private cache (built once, reused by every runner after the first)."""
    from evalpipe.engine.model.names import TINY_MODEL_NAME
    from evalpipe.engine.runner import ModelRunner

    def make(**kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EVALPIPE_CACHE_DIR", str(cache_dir))
            return ModelRunner(kwargs.pop("model_path", TINY_MODEL_NAME), **kwargs)

    return make
