"""What the GPU check scripts (benchmarks/step_*_gpu.py) share: pass/fail reporting of tolerance checks, CUDA-graph
capture and event-timed replays, and kernel counting with torch.profiler. Importing it does not import torch, so a
script can still set TRITON_INTERPRET=1 (its `--device cpu` dry run) before torch and triton load."""

from __future__ import annotations

import statistics


class Checks:
    """Prints one line per check and remembers the failures (a script exits non-zero when `failed` is not empty)."""

    def __init__(self):
        self.failed: list[str] = []

    def report(self, name: str, ok: bool, detail: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL':<4}] {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)

    @staticmethod
    def rel_diff(got, want) -> tuple[float, float]:
        """(max abs difference, that over want's largest magnitude)."""
        d = (got.float() - want.float()).abs().max().item()
        return d, d / max(want.float().abs().max().item(), 1e-30)

    def check(self, name: str, got, want, tol: float) -> float:
        """got within `tol` of want relative to want's largest magnitude, and finite; returns the relative error."""
        import torch

        d, r = self.rel_diff(got, want)
        self.report(name, r <= tol and bool(torch.isfinite(got).all()), f"max abs {d:.3g}, rel {r:.3g} (tol {tol})")
        return r


def capture(fn):
    """fn captured once into a CUDA graph, after two warm-up calls on a side stream (compiles Triton kernels)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph, replays: int) -> float:
    """Median microseconds of one replay (CUDA events around each, after 3 untimed replays)."""
    import torch

    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def kernel_names(fn) -> list[str]:
    """Names of the CUDA kernels one call of fn launches (after one untimed call), memcpy/memset left out."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    ]
