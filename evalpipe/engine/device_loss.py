"""A lost device: whether the engine's device can still run anything after a step failed.

CUDA's sticky errors (a device-side assert, an illegal memory access) break the process's CUDA context: every later
launch and synchronisation fails with the same error. An engine that only failed the step's sequences would then
fail every request while /health said ok. So after a failed step the engine probes its device; on a lost one it
raises `DeviceLost`, the engine process exits (engine/loop.py, engine/process.py) and the server answers 503
`engine_dead` and stops. A step that failed for another reason (a bug in the host code, an out-of-memory error)
leaves the device usable and the engine serving.
"""

from __future__ import annotations

import torch

EXIT_DEVICE_LOST = 3  # the engine process's exit code after a lost device (0: a clean stop, 1: the build failed)


class DeviceLost(RuntimeError):
    """The engine's device runs nothing more; the message is the device's own error."""


def check_device(device: torch.device | str) -> None:
    """Raise DeviceLost when `device` can run nothing more: a CUDA device whose synchronisation or a one-element
    kernel fails. A CPU device always passes (its errors are ordinary exceptions, never sticky)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except Exception as exc:  # CUDA reports a sticky error as a RuntimeError subclass (torch.AcceleratorError)
        raise DeviceLost(f"{type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """CUDA errors append advice on CUDA_LAUNCH_BLOCKING and TORCH_USE_CUDA_DSA over several lines: keep the error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
