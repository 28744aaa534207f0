"""Per-request sampling: one probability transform shared by plain decoding and speculative verification.

`sampling_probs(logits, params)` turns raw logits (any number of rows of one request) into the distribution that
is sampled from: temperature, then top-k, then top-p, then min-p; greedy (temperature 0) gives the one-hot of
the argmax, so speculative rejection sampling degenerates to exact greedy acceptance. `sample(probs, generator)`
draws one token per row with the request's own `torch.Generator` (`generator_for(params)`), so the same seed and
inputs give the same tokens whatever else is in the batch.

Keyed sampling (`--deterministic`, `generator_for(..., keyed=True)`): the request's noise is a `KeyedNoise`
(engine/keyed.py) instead of a stream, and `sample(probs, noise, start)` draws row r as output token start + r with
noise that depends on (seed, start + r, vocab id) alone. Without a seed, one is drawn for the request.
"""

from __future__ import annotations

import torch

from evalpipe.engine.keyed import SALT_TOKEN, KeyedNoise, exponentials_of, row_keys
from evalpipe.engine.sampling_params import SamplingParams, draw_seed

Noise = torch.Generator | KeyedNoise | None  # a request's randomness: a stream, a key, or none (greedy)


def generator_for(params: SamplingParams, device: str | torch.device = "cpu", keyed: bool = False) -> Noise:
    """The request's randomness: None under greedy; keyed: `KeyedNoise(seed)` (a drawn seed when it has none);
    else a `torch.Generator` seeded from `seed`, or from the OS."""
    if params.greedy:
        return None
    if keyed:
        return KeyedNoise(params.seed if params.seed is not None else draw_seed())
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed % (1 << 64) if params.seed is not None else draw_seed())
    return gen


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution to sample from, float32, same shape as `logits` ([V] or [rows, V])."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p (always >= 1 token)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: Noise, start: int = 0) -> torch.Tensor:
    """One token id per row (int64, shape probs.shape[:-1]); exponential race, so zero-probability ids never win.

    With `generator=None` the argmax is taken (greedy one-hot probabilities need no randomness). With a
    `KeyedNoise`, row r is output token `start + r` (keyed_sample).
    """
    if generator is None:
        return probs.argmax(-1)
    if isinstance(generator, KeyedNoise):
        return keyed_sample(probs, generator, start)
    noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


def keyed_sample(probs: torch.Tensor, noise: KeyedNoise, start: int, salt: int = 0) -> torch.Tensor:
    """The exponential race argmax_v p_v / E_v with E the key's Exp(1) noise of output tokens start, start + 1, ...
    (one per row), in float64; ties (p / E equal) go to the lowest id. A draw from p: P(v wins) = p_v / sum(p)."""
    rows = probs.reshape(-1, probs.shape[-1])
    e = noise.exponentials(start, rows.shape[0], rows.shape[-1], rows.device, salt)
    return (rows.to(torch.float64) / e).argmax(-1).reshape(probs.shape[:-1])


KeyedRow = tuple[int, SamplingParams, KeyedNoise, int]  # (row of a step's logits, its params, its key, output index)


def keyed_sample_rows(logits: torch.Tensor, rows: list[KeyedRow]) -> list[int]:
    """The keyed samples of many rows of one step, each what `keyed_sample(sampling_probs(row, params), noise, index)`
    draws alone: the rows' distributions are processed one group of equal transforms at a time, and their noise and
    race in one pass for all, with one host read. A decode step of B sampled requests runs a few dozen ops instead of
    B times as many (each request's own pass is ~80 small ops: the hash alone is ~60)."""
    if not rows:
        return []
    groups: dict[tuple, list[int]] = {}
    for k, (_, params, _, _) in enumerate(rows):
        groups.setdefault((params.temperature, params.top_k, params.top_p, params.min_p), []).append(k)
    order = [k for ks in groups.values() for k in ks]
    probs = torch.cat(
        [
            sampling_probs(logits[torch.tensor([rows[k][0] for k in ks], device=logits.device)], rows[ks[0]][1])
            for ks in groups.values()
        ]
    )
    keys = row_keys([(rows[k][2].seed, rows[k][3]) for k in order], SALT_TOKEN, logits.device)
    drawn = (probs.to(torch.float64) / exponentials_of(keys, logits.shape[-1])).argmax(-1).tolist()
    samples = [0] * len(rows)
    for k, token in zip(order, drawn):
        samples[k] = token
    return samples


class StepArgmax:
    """The argmax of every row of one step's logits, read to the host in one transfer when a row is first asked for:
    a step of B greedy sequences synchronises with the device once instead of B times (at batch 64 on the H200 the
    per-sequence reads took half of a decode step). Ties go to the lowest id, as in `sample_token`."""

    def __init__(self, logits: torch.Tensor):
        self._logits = logits
        self._ids: list[int] | None = None

    def rows(self, start: int, stop: int) -> list[int]:
        if self._ids is None:
            self._ids = self._logits.argmax(-1).tolist()
        return self._ids[start:stop]


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: Noise, index: int = 0) -> int:
    """One token from one row of logits: `sample(sampling_probs(...))`, with greedy short-cut to the argmax.
    `index`: the output token this is (the key's counter under keyed sampling; a stream ignores it)."""
    if params.greedy:
        return int(logits.argmax(-1))
    return int(sample(sampling_probs(logits, params), generator, index))


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, top_k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row: (logprob of the chosen token, the top_k (id, logprob) pairs) from the raw model distribution.

    Logprobs are those of the model itself (log-softmax of the raw logits, before temperature or truncation),
    which is what vLLM and SGLang report by default.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.view(-1, 1)).view(-1).tolist()
    if top_k > 0:
        vals, ids = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen, tops))
