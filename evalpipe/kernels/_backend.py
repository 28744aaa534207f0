"""The one backend selector and the one lazy Triton JIT cache of every op in `evalpipe.kernels`.

Each public op takes `backend="auto" | "triton" | "reference"`. "auto" picks Triton only when every tensor is on
CUDA, Triton imports, and the op's own guard accepts the shapes/dtypes. "triton" forces the kernel (on CPU that
needs TRITON_INTERPRET=1, which is how the tests run it); "reference" forces the plain PyTorch chain.

Every kernel is written as a plain function and compiled by `jit` on first use (with the device functions it calls,
`helpers`), cached per interpreter mode. Triton's own language helpers are built when triton is imported, so
TRITON_INTERPRET=1 must be set before that (tests/kernels/conftest.py does).
"""

from __future__ import annotations

import os
import types
from typing import Any, Callable

import torch

BACKENDS = ("auto", "triton", "reference")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(backend: str, tensors: list[torch.Tensor], guard_ok: bool = True) -> bool:
    """Decide whether to launch the Triton kernel; raise on an impossible forced choice."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton is not installed")
        if not on_cuda and not interpret_mode():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
        if not guard_ok:
            raise ValueError("backend='triton' requested but the inputs fail this kernel's shape/dtype guard")
        return True
    return on_cuda and guard_ok and triton_available()


_JIT: dict[tuple[bool, Callable], Any] = {}


def jit(fn: Callable, varying: tuple[str, ...] = (), helpers: tuple[Callable, ...] = ()) -> Any:
    """`triton.jit(fn)`, built on first use and cached per interpreter mode. `varying` names integer arguments that
    change from call to call in eager forwards (row and entry counts, offsets): Triton would otherwise compile a
    variant per value class (1, multiple of 16, other) of each, so new prompt lengths kept compiling kernels
    mid-run on a fresh machine. Strides and sizes fixed for a model stay specialised. `helpers` are the plain
    functions `fn` calls as Triton device functions: the kernel sees each, by its name, jitted in the same mode."""
    key = (interpret_mode(), fn)
    if key not in _JIT:
        import triton

        if helpers:  # in dependency order: each helper may call those before it
            scope = dict(fn.__globals__)
            scope.update({h.__name__: jit(h, helpers=helpers[:i]) for i, h in enumerate(helpers) if h is not fn})
            rebuilt = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
            # a function built from code has no annotations, and Triton 3.6 reads `tl.constexpr` from them
            for name in ("__annotations__", "__kwdefaults__", "__qualname__", "__module__", "__doc__"):
                setattr(rebuilt, name, getattr(fn, name))
            fn = rebuilt
        _JIT[key] = triton.jit(fn, do_not_specialize=list(varying)) if varying else triton.jit(fn)
    return _JIT[key]
