"""Host tensors onto the engine's device without draining the GPU.

A copy from pageable host memory makes CUDA synchronise the stream first: the host waits until every queued kernel
has run. Issued in the middle of a prompt chunk's forward, that leaves the GPU idle while the host queues the next
layer's kernels. From pinned memory the copy is queued on the stream like a kernel; torch's pinned-memory allocator
keeps the staging block until the copy has run."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t (a CPU tensor) on `device`: through pinned memory without a stream synchronisation on CUDA, plainly
    elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
