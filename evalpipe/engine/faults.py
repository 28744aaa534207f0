"""Planted faults (`evalpipe serve --debug-fault NAME`): known speculative-decoding bugs, each a few lines in the
engine, so that an evaluation can show which of its detectors notices which bug. Never on unless asked for; a server
running one reports it in /get_server_info (`debug_faults`), on every choice's `spec` and in its ready line.

Torch-free at import: the HTTP process and the flag rules read the names. Where each one acts:
- `greedy-sampling` (spec/decoder.py): the verify step takes the target argmax for sampled requests (a verifier that
  ignores temperature, as in SGLang PR #31214);
- `residual-from-target` (spec/accept.py): on a rejection, the replacement token is drawn from the target p instead
  of the normalised residual max(0, p - q), which biases the output toward the drafter; under keyed sampling
  (`--deterministic`) the token after a rejected draft is a draw from the full p with another key instead of the
  target's own keyed sample (the same bias for a one-hot q, and a seeded output that leaves spec off);
- `stale-kv-after-reject` (spec/decoder.py): the target's cache is not rolled back after a rejection, so the rejected
  drafts stay in the sequence's context;
- `batch-variant` (model/deepseek_v4.py, through `head_linear`): the LM head's matmul is split over the hidden
  dimension into a number of chunks that depends on the forward's logit rows, each partial sum rounded to bfloat16
  (as a GEMM that picks split-K for small batches), so tokens change with the batch shape.

One more is not a decoding bug but a broken device, to show how the server and a run meet one:
- `device-assert` (engine/engine.py): a step that carries a request seeded DEVICE_ASSERT_SEED indexes a device
  tensor past its end. On CUDA that is a device-side assert, a sticky error: the engine process exits
  (engine/device_loss.py) and the server answers 503 `engine_dead` and stops. On the CPU it is an IndexError that
  fails that request's step, and the engine keeps serving.
"""

from __future__ import annotations

from evalpipe.engine.config import EngineConfig

DEVICE_ASSERT_SEED = 4004  # the request seed that sets off `device-assert`
DEBUG_FAULTS = {
    "greedy-sampling": "verify takes the target argmax for sampled requests",
    "residual-from-target": "on rejection, resample from the target p instead of the residual max(0, p - q)",
    "stale-kv-after-reject": "the target cache keeps the rejected drafts' rows",
    "batch-variant": "LM-head reduction split by batch rows, bfloat16 partial sums",
    "device-assert": f"a step with a request seeded {DEVICE_ASSERT_SEED} indexes a device tensor past its end",
}
NEEDS_SPECULATION = ("greedy-sampling", "residual-from-target", "stale-kv-after-reject")


def faults_of(config: EngineConfig) -> tuple[str, ...]:
    """The engine config's planted faults, sorted and without repeats (an unknown name raises ValueError)."""
    names = tuple(sorted(set(config.debug_faults)))
    unknown = [n for n in names if n not in DEBUG_FAULTS]
    if unknown:
        raise ValueError(f"unknown debug fault(s) {unknown}; known: {', '.join(DEBUG_FAULTS)}")
    return names


def split_k_chunks(rows: int) -> int:
    """Chunks of the hidden dimension for a forward with `rows` logit rows: 4 below 8 rows, 2 below 64, else 1."""
    return 4 if rows < 8 else 2 if rows < 64 else 1


def batch_variant_linear(h, weight):
    """h @ weight.T with the hidden dimension split into `split_k_chunks(rows)` chunks; with more than one chunk
    every partial product is rounded to bfloat16 before the float32 sum (one chunk: the exact F.linear)."""
    import torch
    import torch.nn.functional as F

    chunks = split_k_chunks(h.shape[0])
    if chunks == 1:
        return F.linear(h, weight)
    parts = [
        F.linear(hc, wc).to(torch.bfloat16).float()
        for hc, wc in zip(h.chunk(chunks, dim=-1), weight.chunk(chunks, dim=-1))
    ]
    return torch.stack(parts).sum(0)


def plant_device_assert(faults: tuple[str, ...], seeds, device) -> None:
    """`device-assert`: when `seeds` (the step's requests' seeds) hold DEVICE_ASSERT_SEED, read one element past a
    one-element device tensor and wait for it (CUDA: a device-side assert; CPU: IndexError)."""
    if "device-assert" not in faults or DEVICE_ASSERT_SEED not in seeds:
        return
    import torch

    one = torch.zeros(1, device=device)
    one[torch.ones(1, dtype=torch.long, device=device)].sum().item()
