"""`_backend.jit` rebuilds a kernel that calls helpers with a new globals scope; the rebuilt function must still carry
what Triton compiles from. Triton 3.6 (the GPU machine's) reads `tl.constexpr` parameters from the function's
annotations: without them a block size is an ordinary argument and `tl.arange(0, BLOCK)` does not compile
(seen on the H200 on 2026-12-03). Triton's own `JITFunction` parses the parameters here, on the CPU."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from evalpipe.kernels._backend import jit  # noqa: E402


def _double(x):
    return x * 2


def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SCALE: tl.constexpr = 1):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, _double(tl.load(x_ptr + offs, mask=mask)) * SCALE, mask=mask)


def test_a_kernel_rebuilt_with_helpers_keeps_its_constexpr_parameters():
    built = jit(_kernel, ("n",), helpers=(_double,))
    rebuilt = built.fn
    assert rebuilt is not _kernel and rebuilt.__globals__ is not _kernel.__globals__  # the helper scope is its own
    assert rebuilt.__annotations__ == _kernel.__annotations__ and rebuilt.__qualname__ == _kernel.__qualname__
    params = {p.name: p for p in triton.runtime.jit.JITFunction(rebuilt).params}
    assert params["BLOCK"].is_constexpr and params["SCALE"].is_constexpr and not params["n"].is_constexpr
    assert inspect.signature(rebuilt).parameters["SCALE"].default == 1


def test_the_rebuilt_kernel_runs_with_its_helper():
    import torch

    x = torch.randn(37)
    y = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    jit(_kernel, ("n",), helpers=(_double,))[(3,)](x, y, 37, BLOCK=16, SCALE=3)
    assert torch.equal(y, x * 2 * 3)
