"""The speculative step: draft a block for every decoding sequence, verify all blocks in one target forward,
accept, and roll the runner back to what was accepted.

Invariant (same as plain decoding): the target runner holds every committed token but the last, which is pending.
A verify step feeds G+1 rows per sequence, request-major (the pending token + G drafts) with all_logits=True;
row i scores the token after draft i. After accepting n drafts the runner is truncated to the pending token plus
those n drafts (`runner.truncate`: its state is position-indexed, so truncation is the rollback) and the bonus
token becomes the new pending token. Drafters are rolled back the same way.

`SpeculativeDecoder` implements the engine's `Decoder` protocol (`propose`/`accept`/`stats`/`describe`) plus two
batch hooks the engine calls when present: `prepare(seqs)` drafts for all decoding sequences of a step at once, and
`release(slot)` frees a finished sequence's draft state and adds its statistics to the server-wide totals.
`verify_step(seqs)` runs prepare + target forward + accept directly on a runner (tests, benchmarks).

The acceptance rule is exact unless the server was started with a lossy `AcceptRule` (spec/settings.py); the rule and
whether it decided a request lossily ride on every `spec` object and on `describe()`, as do planted faults
(`debug_faults`, engine/faults.py) when a server runs any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from evalpipe.engine.faults import faults_of
from evalpipe.engine.sampling import sample, sampling_probs
from evalpipe.engine.spec.accept import (
    ServerSpecTotals,
    SimulatedAcceptLengths,
    SpecStats,
    greedy_accept,
    in_top_k,
    rejection_accept,
    simulated_accept,
    threshold_accept,
    topk_accept,
)
from evalpipe.engine.spec.settings import AcceptRule, accept_rule_from_settings


@dataclass
class _SeqSpec:
    """Per-sequence speculation state, kept in `seq.state["spec"]`."""

    stats: SpecStats
    sim: SimulatedAcceptLengths | None
    drafts: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    base_len: int = 0  # target length (committed tokens - 1) when the current block was drafted


class SpeculativeDecoder:
    all_logits = True

    def __init__(self, target: Any, drafter: Any, *, block_size: int = 5, simulate_acc_len: float | None = None,
                 accept_rule: AcceptRule | None = None, debug_faults: tuple[str, ...] = ()):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.accept_rule = accept_rule or AcceptRule()
        if simulate_acc_len is not None:
            SimulatedAcceptLengths(simulate_acc_len, block_size)  # validates the range
            if self.accept_rule.lossy:
                raise ValueError("simulated acceptance checks no draft, so an acceptance rule has nothing to decide")
        self.target = target
        self.drafter = drafter
        self.block_size = block_size
        self.width = block_size + 1
        self.simulate_acc_len = simulate_acc_len
        self.totals = ServerSpecTotals()
        self.debug_faults = tuple(debug_faults)  # planted bugs (engine/faults.py), evaluation of evaluations only
        self._live: dict[int, Any] = {}  # target slot -> sequence, for release()

    # -- engine hooks ------------------------------------------------------------------------------
    def prepare(self, seqs: list[Any]) -> None:
        """Draft the next block of every decoding sequence (one batched drafter pass per draft position)."""
        if not seqs:
            return
        widths = []
        for seq in seqs:
            spec = self._spec(seq)
            spec.base_len = len(seq.prompt) + len(seq.output) - 1
            # fixed width G, shortened only where the block would run past the runner's context
            widths.append(max(0, min(self.block_size, int(self.target.max_seq_len) - spec.base_len - 1)))
        drafts, qs = self.drafter.propose(seqs, widths)
        for seq, d, q in zip(seqs, drafts, qs):
            spec = seq.state["spec"]
            spec.drafts, spec.q = list(d), q

    def propose(self, seq: Any) -> list[int]:
        spec = seq.state.get("spec")
        if spec is None or spec.base_len != len(seq.prompt) + len(seq.output) - 1:
            self.prepare([seq])  # engine without the batch hook: draft this sequence alone
            spec = seq.state["spec"]
        return [seq.last_token] + spec.drafts

    def accept(self, seq: Any, logits: torch.Tensor, argmax: list[int] | None = None) -> list[int]:
        """Accept against this sequence's verify rows ([g+1, V]), roll back, return the committed tokens. `argmax`:
        the rows' argmax already on the host (greedy requests), which the exact greedy rule uses."""
        spec: _SeqSpec = seq.state["spec"]
        drafts, params = spec.drafts, seq.params
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"expected {len(drafts) + 1} verify rows, got {logits.shape[0]}")
        if spec.sim is not None:
            tokens, n = simulated_accept(
                drafts, spec.sim.next_length(),
                lambda row: int(sample(sampling_probs(logits[row], params), seq.generator)),
            )
        elif params.greedy or "greedy-sampling" in self.debug_faults:
            rule = self.accept_rule
            tokens, n = (topk_accept(logits, drafts, rule.topk) if rule.name == "topk"
                         else greedy_accept(logits, drafts, argmax))
        else:
            tokens, n = self._sampled_accept(sampling_probs(logits, params), spec, seq.generator)
        if "stale-kv-after-reject" not in self.debug_faults:
            self.target.truncate(seq.slot, spec.base_len + 1 + n)
        self.drafter.rollback(seq, spec.base_len + 1, n)
        spec.stats.record(n)
        spec.drafts, spec.q = [], None
        return tokens

    def _sampled_accept(self, p: torch.Tensor, spec: _SeqSpec, generator: Any) -> tuple[list[int], int]:
        rule, drafts = self.accept_rule, spec.drafts
        if rule.name == "threshold":
            return threshold_accept(p, drafts, rule.threshold_single, rule.threshold_acc, generator)
        keep = in_top_k(p[: len(drafts)], drafts, rule.topk, require_positive=True) if rule.name == "topk" else None
        q = spec.q if spec.q is not None else p[:0]
        return rejection_accept(p, q, drafts, generator, keep=keep,
                                residual_from_target="residual-from-target" in self.debug_faults)

    def stats(self, seq: Any) -> dict | None:
        spec = seq.state.get("spec")
        stats = spec.stats if spec is not None else SpecStats(self.block_size)
        # simulate_acc_len and the acceptance rule ride on every response so that no consumer can mistake a simulated
        # or lossy run for an exact one; `lossy` says whether the rule decided THIS request lossily
        out = {**stats.to_dict(completion_tokens=len(seq.output)), "simulate_acc_len": self.simulate_acc_len,
               "accept": self.accept_rule.describe(), "lossy": self.accept_rule.lossy_for(seq.params.greedy)}
        return {**out, "debug_faults": list(self.debug_faults)} if self.debug_faults else out

    def release(self, slot: int) -> None:
        seq = self._live.pop(slot, None)
        if seq is not None and "spec" in seq.state:
            self.totals.add(seq.state["spec"].stats, len(seq.output))
        self.drafter.release(slot)

    def describe(self) -> dict:
        return {
            "mode": "block",
            "block_size": self.block_size,
            "verify_rows_per_request": self.width,
            "drafter": self.drafter.name,
            "simulate_acc_len": self.simulate_acc_len,
            "accept": self.accept_rule.describe(),
            "totals": self.totals.to_dict(),
            **({"debug_faults": list(self.debug_faults)} if self.debug_faults else {}),
        }

    # -- direct use on a runner --------------------------------------------------------------------
    def verify_step(self, seqs: list[Any]) -> list[list[int]]:
        """One speculative step for sequences already prefilled on the target: draft, one target forward over
        all blocks, accept and roll back. Appends the committed tokens to each seq.output and returns them."""
        self.prepare(seqs)
        rows = [self.propose(seq) for seq in seqs]
        logits = self.target.forward([seq.slot for seq in seqs], rows, all_logits=True)
        out, offset = [], 0
        for seq, r in zip(seqs, rows):
            tokens = self.accept(seq, logits[offset: offset + len(r)])
            seq.output.extend(tokens)
            out.append(tokens)
            offset += len(r)
        return out

    def _spec(self, seq: Any) -> _SeqSpec:
        spec = seq.state.get("spec")
        if spec is None:
            sim = SimulatedAcceptLengths(self.simulate_acc_len, self.block_size) if self.simulate_acc_len else None
            spec = seq.state["spec"] = _SeqSpec(stats=SpecStats(self.block_size), sim=sim)
            self._live[seq.slot] = seq
        return spec


SPECULATIVE_MODES = ("off", "block")


def default_drafter(runner: Any) -> str:
    """layerskip over the first three quarters of the target's layers (layerskip:3 for the tiny model): no extra
    weights, and natural partial acceptance even with random weights (tiny model, G=5: layerskip:3 accepts about
    0.9 drafts per step spread over 0..4; layerskip:2 accepts 0 on ~88% of steps)."""
    return f"layerskip:{max(1, (3 * int(runner.config.num_hidden_layers)) // 4)}"


def decoder_from_settings(settings: Any, runner: Any) -> SpeculativeDecoder | None:
    """The engine's decoder for the server settings: None (plain decoding) unless `speculative == "block"`.

    Reads `speculative`, `block_size`, `drafter` (None: `default_drafter`), `simulate_acc_len` (None: off) and the
    acceptance rule (`accept_rule_from_settings`)."""
    from evalpipe.engine.spec.drafters import build_drafter

    mode = getattr(settings, "speculative", "off") or "off"
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative mode must be one of {SPECULATIVE_MODES}, got {mode!r}")
    if mode == "off":
        return None
    spec = getattr(settings, "drafter", None) or default_drafter(runner)
    return SpeculativeDecoder(runner, build_drafter(spec, getattr(runner, "eager_runner", runner)), block_size=int(getattr(settings, "block_size", 5)),
                              simulate_acc_len=getattr(settings, "simulate_acc_len", None),
                              accept_rule=accept_rule_from_settings(settings), debug_faults=faults_of(settings))
