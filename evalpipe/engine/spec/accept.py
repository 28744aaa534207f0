"""Block speculation: the acceptance rules and the per-request statistics.

A verify step scores G+1 rows per request (last committed token + G drafts). Row i of the target's output is the
target's next-token distribution after the committed prefix plus drafts d_1..d_i, so one forward is enough to decide
how many drafts survive and which token follows them:

- greedy: the longest prefix of drafts equal to the target argmax, plus the target argmax after it (the bonus);
- sampled: standard speculative rejection sampling (Leviathan et al. / Chen et al.): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a sample of norm(max(p_i - q_i, 0)) and stop; when every
  draft survives, emit a bonus sample of p_G. The emitted tokens are distributed exactly as plain sampling from p.
  A drafter without a distribution (n-gram lookup) passes q = one-hot of its proposal, which the same rule handles;
- keyed (sample-verify, requests sampled with keyed noise under `--deterministic`): the target draws its own
  keyed sample at every verify row (engine/keyed.py: noise of (seed, output index, vocab id) alone); the longest
  prefix of drafts equal to those samples is accepted and the target's sample at the first mismatch (or after the
  last draft) is emitted. Every emitted token is the sample plain decoding would draw at that index from the same
  distribution, so a seeded output is the spec-off output token for token. For a deterministic drafter (n-gram)
  P(accept d) = p(d), what rejection sampling gives for a one-hot q. A sampling model drafter draws its proposal
  with the same key, so it proposes the target's own sample whenever the two races agree; by the coupling
  inequality that is at most rejection sampling's 1 - TV(p, q);
- simulated (performance runs only): accept a prescribed number of drafts without checking them.

The greedy and sampled rules are exact and are the default. Two LOSSY rules exist only so that an evaluation can
prove it notices a speculator that changes the output (`AcceptRule` in spec/settings.py; never on unless asked
for, reported wherever `spec` is):

- top-k (`--spec-accept-topk K`, K >= 2): a draft survives when fewer than K tokens score strictly higher than it
  at its row, i.e. it is among the target's K best (ties counted in its favour). Greedy rows rank the logits and the
  bonus stays the target argmax after the accepted drafts. Sampled rows rank the request's own distribution p (after
  temperature/top-k/top-p/min-p); a draft in the top K with p > 0 is kept without a test, any other draft still
  faces the exact rejection test above. K = 1 would be the exact greedy rule, so it is refused, not offered.
- thresholds (`--spec-accept-threshold-single P`, `--spec-accept-threshold-acc P`, SGLang's
  `--speculative-accept-threshold-single/acc`): SGLang's target-only verification, for a linear block (no siblings,
  so SGLang's accumulated probability is just the draft's own p). At each row the draft d survives when
  u < p(d) / threshold_acc for a fresh uniform u (threshold_acc is floored at 1e-9 like SGLang's), or when
  p(d) >= threshold_single; at the first failure the target samples from p with d removed (renormalised), and after
  a fully accepted block it samples the bonus from p. The drafter's q is not used. At 1.0 / 1.0 this is an exact
  sampler (P(x) = q(x) p(x) + sum over d != x of q(d) (1 - p(d)) p(x) / (1 - p(d)) = p(x)), so the engine keeps its
  own rule there; below 1.0 it accepts more than p allows (threshold_single 0 accepts every draft, threshold_acc 0
  every draft with p > 0). As in SGLang, whose all-greedy batches go through its greedy verifier, the thresholds act
  on sampled requests only: greedy requests on such a server are verified exactly, and their `spec.lossy` says false.

Lengths here count drafts ("accepted drafts", 0..G); the accept length of SGLang's statistics adds the bonus.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from evalpipe.engine.keyed import SALT_FAULT, KeyedNoise
from evalpipe.engine.sampling import keyed_sample


def greedy_accept(
    target_logits: torch.Tensor, drafts: torch.Tensor | list[int], target: list[int] | None = None
) -> tuple[list[int], int]:
    """Greedy acceptance of one request's block.

    target_logits: [G+1, V], row i scores the token after draft i (row 0: after the last committed token).
    drafts: G token ids. Returns (emitted tokens = accepted drafts + bonus, number of accepted drafts).
    Ties in the argmax resolve to the lowest token id (torch.argmax), exactly as in plain greedy decoding.
    target: the rows' argmax when the caller already read it to the host (the engine reads a whole step at once).
    """
    if target is None:
        target = torch.argmax(target_logits, dim=-1).tolist()
    drafts = [int(d) for d in (drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts)]
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]], n


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def rejection_accept(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor | list[int],
    generator: torch.Generator | None = None,
    keep: list[bool] | None = None,
    residual_from_target: bool = False,
) -> tuple[list[int], int]:
    """Speculative rejection sampling of one request's block.

    target_probs: [G+1, V] target distributions (after temperature/top-p/top-k), row i after draft i.
    draft_probs: [G, V] the distributions each draft was sampled from (same transform), row i for draft i+1.
    keep: per draft, True to accept it without the test (the lossy top-k rule); None for the exact sampler.
    residual_from_target: the planted `residual-from-target` fault (engine/faults.py): resample from p on rejection.
    Returns (emitted tokens, number of accepted drafts); at least one token is always emitted.
    """
    drafts = [int(d) for d in (drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts)]
    p = target_probs.to(torch.float64)
    q = draft_probs.to(device=p.device, dtype=torch.float64)
    if p.shape[0] != len(drafts) + 1 or q.shape[0] != len(drafts):
        raise ValueError(
            f"need G+1 target rows and G draft rows for G={len(drafts)} drafts, got {p.shape[0]} and {q.shape[0]}"
        )
    emitted: list[int] = []
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64, device=p.device).tolist()
    for i, d in enumerate(drafts):
        p_d, q_d = float(p[i, d]), float(q[i, d])
        # accept iff u < p/q, written without the division; q_d == 0 cannot be drafted, reject if it is.
        if (keep is not None and keep[i]) or (q_d > 0.0 and uniforms[i] * q_d < p_d):
            emitted.append(d)
            continue
        residual = p[i] if residual_from_target else torch.clamp(p[i] - q[i], min=0.0)
        total = float(residual.sum())
        # residual is all zero only when p == q on the support, where rejection has probability 0; p is the
        # correct fallback for the float round-off case.
        emitted.append(_draw(residual / total if total > 0.0 else p[i], generator))
        return emitted, i
    emitted.append(_draw(p[len(drafts)], generator))
    return emitted, len(drafts)


def keyed_accept(
    target_probs: torch.Tensor,
    drafts: list[int],
    noise: KeyedNoise,
    start: int,
    keep: list[bool] | None = None,
    residual_from_target: bool = False,
) -> tuple[list[int], int]:
    """Sample-verify of one request's block (module docstring, keyed).

    target_probs: [G+1, V], row i the distribution of output token start + i. keep: per draft, True to accept it
    whatever the sample (a lossy rule); None for the exact rule. residual_from_target: the planted fault: at the
    first mismatch, the emitted token is a fresh draw from the full p (another key), which may be the rejected
    draft, instead of the target's own sample. Returns (emitted tokens, number of accepted drafts).
    """
    if target_probs.shape[0] != len(drafts) + 1:
        raise ValueError(f"need G+1 target rows for G={len(drafts)} drafts, got {target_probs.shape[0]}")
    samples = keyed_sample(target_probs, noise, start).tolist()

    def fresh_draw(i: int) -> int:  # the planted fault's token: another key's draw from the full p
        return int(keyed_sample(target_probs[i], noise, start + i, salt=SALT_FAULT))

    return sample_verify(samples, drafts, keep, fresh_draw if residual_from_target else None)


def sample_verify(
    samples: list[int], drafts: list[int], keep: list[bool] | None = None, replace: Callable[[int], int] | None = None
) -> tuple[list[int], int]:
    """The longest prefix of drafts that equal the target's own samples at their rows (or that `keep` keeps), then
    the sample at the first mismatch (or after the last draft): (emitted tokens, number of accepted drafts).
    samples: the target's keyed sample of each of the G+1 rows. replace: the planted residual-from-target fault's
    token for a mismatch row, instead of the sample."""
    emitted: list[int] = []
    for i, d in enumerate(drafts):
        if d == samples[i] or (keep is not None and keep[i]):
            emitted.append(d)
            continue
        emitted.append(replace(i) if replace is not None else samples[i])
        return emitted, i
    emitted.append(samples[len(drafts)])
    return emitted, len(drafts)


def topk_accept(target_logits: torch.Tensor, drafts: torch.Tensor | list[int], k: int) -> tuple[list[int], int]:
    """LOSSY greedy acceptance: the longest prefix of drafts each among the target's top k at its row, then the
    target argmax after them. Same shapes and result as `greedy_accept`."""
    drafts = [int(d) for d in (drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts)]
    kept = in_top_k(target_logits[: len(drafts)], drafts, k)
    n = 0
    while n < len(drafts) and kept[n]:
        n += 1
    return drafts[:n] + [int(torch.argmax(target_logits[n]))], n


def in_top_k(scores: torch.Tensor, drafts: list[int], k: int, require_positive: bool = False) -> list[bool]:
    """Per row i of scores [G, V]: fewer than k tokens score strictly higher than drafts[i] (ties count for the
    draft). require_positive: also need scores[i, d] > 0 (probabilities: never keep a token the request's own
    top-k/top-p/min-p filtered out)."""
    if not drafts:
        return []
    index = torch.tensor(drafts, dtype=torch.long, device=scores.device).unsqueeze(1)
    own = scores.gather(1, index)
    ok = (scores > own).sum(dim=1) < k
    if require_positive:
        ok &= own.squeeze(1) > 0
    return ok.tolist()


def threshold_accept(
    target_probs: torch.Tensor,
    drafts: torch.Tensor | list[int],
    threshold_single: float,
    threshold_acc: float,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """SGLang's target-only verification of a linear block with its acceptance thresholds (module docstring).

    target_probs: [G+1, V] the request's target distributions. Returns (emitted tokens, accepted drafts)."""
    drafts = [int(d) for d in (drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts)]
    p = target_probs.to(torch.float64)
    if p.shape[0] != len(drafts) + 1:
        raise ValueError(f"need G+1 target rows for G={len(drafts)} drafts, got {p.shape[0]}")
    acc = max(float(threshold_acc), 1e-9)
    uniforms = torch.rand(len(drafts), generator=generator, dtype=torch.float64, device=p.device).tolist()
    emitted: list[int] = []
    for i, d in enumerate(drafts):
        p_d = float(p[i, d])
        # strict < (SGLang writes <=): the same law for a continuous u, and u == 0 never keeps a p = 0 token
        if uniforms[i] * acc < p_d or p_d >= threshold_single:
            emitted.append(d)
            continue
        residual = p[i].clone()
        residual[d] = 0.0
        total = float(residual.sum())
        emitted.append(_draw(residual / total if total > 0.0 else p[i], generator))
        return emitted, i
    emitted.append(_draw(p[len(drafts)], generator))
    return emitted, len(drafts)


class SimulatedAcceptLengths:
    """Accept lengths (bonus included) whose running mean is exactly `mean`: a deterministic floor/ceil mix.

    Error diffusion: each call adds the fractional part to a carry and returns ceil when the carry reaches 1, so
    after n calls the realised mean is within 1/n of `mean` (SGLang's `match-expected` method, minus its randomness).
    """

    def __init__(self, mean: float, block_size: int):
        if not 1.0 <= mean <= block_size + 1:
            raise ValueError(f"simulated accept length must be in [1, G+1] = [1, {block_size + 1}], got {mean}")
        self.mean = float(mean)
        self.block_size = block_size
        self._floor = math.floor(self.mean)
        self._frac = self.mean - self._floor
        self._carry = 0.0

    def next_length(self) -> int:
        """The next accept length in [1, G+1] (accepted drafts + bonus)."""
        self._carry += self._frac
        if self._carry >= 1.0 - 1e-12:
            self._carry -= 1.0
            return min(self._floor + 1, self.block_size + 1)
        return self._floor


def simulated_accept(
    drafts: list[int], accept_length: int, target_token: Callable[[int], int]
) -> tuple[list[int], int]:
    """Simulated acceptance: commit the first accept_length-1 drafts unchecked, then the target's token after them.

    target_token(row) gives the target's choice (argmax or sample) at a verify row, so the bonus is a real target
    token (SGLang's "real-draft-token" mode). Output quality is meaningless under simulation.
    """
    n = min(accept_length - 1, len(drafts))
    return list(drafts[:n]) + [int(target_token(n))], n


@dataclass
class SpecStats:
    """Per-request speculation counters, reported on every choice as the `spec` object.

    histogram[i] = number of verify steps that accepted exactly i drafts (0..G), so sum(histogram) == verify_steps
    and sum(i * histogram[i]) == accepted_drafts. accept_length = completion tokens / verify steps (bonus included,
    SGLang's definition; the token produced by prefill counts as a completion token, which inflates short outputs).
    """

    block_size: int
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_drafts: int = 0
    histogram: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * (self.block_size + 1)

    def record(self, accepted: int) -> None:
        """Record one verify step that proposed block_size drafts and accepted `accepted` of them."""
        self.verify_steps += 1
        self.draft_tokens += self.block_size
        self.accepted_drafts += accepted
        self.histogram[accepted] += 1

    def to_dict(self, completion_tokens: int) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_drafts": self.accepted_drafts,
            "accept_length": (completion_tokens / self.verify_steps) if self.verify_steps else None,
            "accept_histogram": list(self.histogram),
        }


@dataclass
class ServerSpecTotals:
    """Server-wide sums over finished sequences that ran at least one verify step (a max_tokens=1 request never
    does), for the averages in /get_server_info."""

    requests: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_drafts: int = 0
    completion_tokens: int = 0
    histogram: list[int] = field(default_factory=list)

    def add(self, stats: SpecStats, completion_tokens: int) -> None:
        if len(self.histogram) < len(stats.histogram):
            self.histogram += [0] * (len(stats.histogram) - len(self.histogram))
        for i, h in enumerate(stats.histogram):
            self.histogram[i] += h
        self.requests += 1
        self.verify_steps += stats.verify_steps
        self.draft_tokens += stats.draft_tokens
        self.accepted_drafts += stats.accepted_drafts
        self.completion_tokens += completion_tokens

    def to_dict(self) -> dict:
        steps = self.verify_steps
        return {
            "requests": self.requests,
            "verify_steps": steps,
            "draft_tokens": self.draft_tokens,
            "accepted_drafts": self.accepted_drafts,
            "completion_tokens": self.completion_tokens,
            "avg_accept_length": self.completion_tokens / steps if steps else None,
            "avg_accepted_drafts_per_step": self.accepted_drafts / steps if steps else None,
            "accept_rate": self.accepted_drafts / self.draft_tokens if self.draft_tokens else None,
            "accept_histogram": list(self.histogram),
        }
