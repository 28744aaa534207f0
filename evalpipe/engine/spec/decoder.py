"""The speculative step: draft a block for every decoding sequence, verify all blocks in one target forward,
accept, and roll the runner back to what was accepted.

Invariant (same as plain decoding): the target runner holds every committed token but the last, which is pending.
A verify step feeds G+1 rows per sequence, request-major (the pending token + G drafts) with all_logits=True;
row i scores the token after draft i. After accepting n drafts the runner is truncated to the pending token plus
those n drafts (`runner.truncate`: its state is position-indexed, so truncation is the rollback) and the bonus
token becomes the new pending token. Drafters are rolled back the same way.

`SpeculativeDecoder` is an engine `Decoder` (engine/contracts.py): `propose`/`accept`/`stats`/`describe`, and the two
hooks: `prepare(seqs)` drafts for all decoding sequences of a step at once, and `release(slot)` frees a finished
sequence's draft state and adds its statistics to the server-wide totals. Its state for a sequence is `seq.spec`
(spec/state.py).
`verify_step(seqs)` runs prepare + target forward + accept directly on a runner (tests, benchmarks).

The acceptance rule is exact unless the server was started with a lossy `AcceptRule` (spec/settings.py); the rule and
whether it decided a request lossily ride on every `spec` object and on `describe()`, as do planted faults
(`debug_faults`, engine/faults.py) when a server runs any.
"""

from __future__ import annotations

import torch

from evalpipe.engine.config import EngineConfig
from evalpipe.engine.contracts import Decoder, Runner
from evalpipe.engine.faults import faults_of
from evalpipe.engine.keyed import SALT_COIN, KeyedNoise
from evalpipe.engine.sampling import sample, sampling_probs
from evalpipe.engine.scheduler import Sequence
from evalpipe.engine.spec.accept import (
    ServerSpecTotals,
    SimulatedAcceptLengths,
    SpecStats,
    greedy_accept,
    in_top_k,
    keyed_accept,
    rejection_accept,
    sample_verify,
    simulated_accept,
    threshold_accept,
    topk_accept,
)
from evalpipe.engine.spec.drafters import Drafter, build_drafter
from evalpipe.engine.spec.settings import AcceptRule, accept_rule_from_settings
from evalpipe.engine.spec.state import SeqSpec


class SpeculativeDecoder(Decoder):
    all_logits = True

    def __init__(
        self,
        target: Runner,
        drafter: Drafter,
        *,
        block_size: int = 5,
        simulate_acc_len: float | None = None,
        accept_rule: AcceptRule | None = None,
        debug_faults: tuple[str, ...] = (),
    ):
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
        self._live: dict[int, Sequence] = {}  # target slot -> sequence, for release()

    # -- engine hooks ------------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence]) -> None:
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
            seq.spec.drafts, seq.spec.q = list(d), q

    def propose(self, seq: Sequence) -> list[int]:
        spec = seq.spec
        if spec is None or spec.base_len != len(seq.prompt) + len(seq.output) - 1:
            self.prepare([seq])  # not prepared with its step: draft this sequence alone
            spec = seq.spec
        return [seq.last_token] + spec.drafts

    def accept(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        argmax: list[int] | None = None,
        samples: list[int] | None = None,
    ) -> list[int]:
        """Accept against this sequence's verify rows ([g+1, V]), roll back, return the committed tokens. `argmax`:
        the rows' argmax already on the host (greedy requests), which the exact greedy rule uses; `samples`: the
        rows' keyed samples, drawn with the step's (`takes_samples`), which sample-verify uses."""
        spec = seq.spec
        drafts, params = spec.drafts, seq.params
        if logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"expected {len(drafts) + 1} verify rows, got {logits.shape[0]}")
        start = len(seq.output)  # verify row i scores output token start + i (the keyed sampler's counter)
        if spec.sim is not None:
            tokens, n = simulated_accept(
                drafts,
                spec.sim.next_length(),
                lambda row: int(sample(sampling_probs(logits[row], params), seq.generator, start + row)),
            )
        elif params.greedy or "greedy-sampling" in self.debug_faults:
            rule = self.accept_rule
            tokens, n = (
                topk_accept(logits, drafts, rule.topk) if rule.name == "topk" else greedy_accept(logits, drafts, argmax)
            )
        elif samples is not None:
            tokens, n = sample_verify(samples, drafts)
        elif isinstance(seq.generator, KeyedNoise):
            tokens, n = self._keyed_accept(sampling_probs(logits, params), spec, seq.generator, start)
        else:
            tokens, n = self._sampled_accept(sampling_probs(logits, params), spec, seq.generator)
        if "stale-kv-after-reject" not in self.debug_faults:
            self.target.truncate(seq.slot, spec.base_len + 1 + n)
        self.drafter.rollback(seq, spec.base_len + 1, n)
        spec.stats.record(n)
        spec.drafts, spec.q = [], None
        return tokens

    def takes_samples(self, seq: Sequence) -> bool:
        """Exact sample-verify needs only the rows' keyed samples; a lossy rule, simulated acceptance and the
        planted sampling faults need the distributions themselves."""
        return (
            seq.spec is not None
            and seq.spec.sim is None
            and not self.accept_rule.lossy
            and not {"greedy-sampling", "residual-from-target"} & set(self.debug_faults)
        )

    def _sampled_accept(
        self, p: torch.Tensor, spec: SeqSpec, generator: torch.Generator | None
    ) -> tuple[list[int], int]:
        rule, drafts = self.accept_rule, spec.drafts
        if rule.name == "threshold":
            return threshold_accept(p, drafts, rule.threshold_single, rule.threshold_acc, generator)
        keep = in_top_k(p[: len(drafts)], drafts, rule.topk, require_positive=True) if rule.name == "topk" else None
        q = spec.q if spec.q is not None else p[:0]
        return rejection_accept(
            p, q, drafts, generator, keep=keep, residual_from_target="residual-from-target" in self.debug_faults
        )

    def _keyed_accept(self, p: torch.Tensor, spec: SeqSpec, noise: KeyedNoise, start: int) -> tuple[list[int], int]:
        """Sample-verify (spec/accept.py keyed_accept); a lossy rule keeps drafts by its own test first: top-k on
        p, or SGLang's thresholds with a keyed coin per row."""
        rule, drafts = self.accept_rule, spec.drafts
        keep = None
        if rule.name == "topk":
            keep = in_top_k(p[: len(drafts)], drafts, rule.topk, require_positive=True)
        elif rule.name == "threshold" and drafts:
            coins = noise.uniforms(start, len(drafts), 1, p.device, salt=SALT_COIN)[:, 0].tolist()
            acc = max(float(rule.threshold_acc), 1e-9)
            own = [float(p[i, d]) for i, d in enumerate(drafts)]
            keep = [u * acc < pd or pd >= rule.threshold_single for u, pd in zip(coins, own)]
        return keyed_accept(
            p, drafts, noise, start, keep=keep, residual_from_target="residual-from-target" in self.debug_faults
        )

    def stats(self, seq: Sequence) -> dict | None:
        stats = seq.spec.stats if seq.spec is not None else SpecStats(self.block_size)
        # simulate_acc_len and the acceptance rule ride on every response so that no consumer can mistake a simulated
        # or lossy run for an exact one; `lossy` says whether the rule decided THIS request lossily
        out = {
            **stats.to_dict(completion_tokens=len(seq.output)),
            "simulate_acc_len": self.simulate_acc_len,
            "accept": self.accept_rule.describe(),
            "lossy": self.accept_rule.lossy_for(seq.params.greedy),
        }
        return {**out, "debug_faults": list(self.debug_faults)} if self.debug_faults else out

    def release(self, slot: int) -> None:
        seq = self._live.pop(slot, None)
        if seq is not None and seq.spec is not None:
            self.totals.add(seq.spec.stats, len(seq.output))
        self.drafter.release(slot)

    def grammar_blocker(self) -> str | None:
        """An acceptance that commits drafts without the exact test could commit a token the grammar forbids."""
        if self.simulate_acc_len:
            return "simulated speculative acceptance (--simulate-acc-len) commits drafts unchecked"
        if self.accept_rule.lossy:
            return (
                f"the lossy speculative acceptance rule ({self.accept_rule.label()}) may accept drafts the "
                "grammar forbids"
            )
        return None

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
    def verify_step(self, seqs: list[Sequence]) -> list[list[int]]:
        """One speculative step for sequences already prefilled on the target: draft, one target forward over
        all blocks, accept and roll back. Appends the committed tokens to each seq.output and returns them."""
        self.prepare(seqs)
        rows = [self.propose(seq) for seq in seqs]
        logits = self.target.forward([seq.slot for seq in seqs], rows, all_logits=True)
        out, offset = [], 0
        for seq, r in zip(seqs, rows):
            tokens = self.accept(seq, logits[offset : offset + len(r)])
            seq.output.extend(tokens)
            out.append(tokens)
            offset += len(r)
        return out

    def _spec(self, seq: Sequence) -> SeqSpec:
        if seq.spec is None:
            sim = SimulatedAcceptLengths(self.simulate_acc_len, self.block_size) if self.simulate_acc_len else None
            seq.spec = SeqSpec(stats=SpecStats(self.block_size), sim=sim)
            self._live[seq.slot] = seq
        return seq.spec


SPECULATIVE_MODES = ("off", "block")


def default_drafter(runner: Runner) -> str:
    """layerskip over the first three quarters of the target's layers (layerskip:3 for the tiny model): no extra
    weights, and natural partial acceptance even with random weights (tiny model, G=5: layerskip:3 accepts about
    0.9 drafts per step spread over 0..4; layerskip:2 accepts 0 on ~88% of steps)."""
    return f"layerskip:{max(1, (3 * int(runner.config.num_hidden_layers)) // 4)}"


def decoder_from_settings(config: EngineConfig, runner: Runner) -> SpeculativeDecoder | None:
    """The engine's decoder for the engine config: None (plain decoding) unless `speculative == "block"`.

    Reads `speculative`, `block_size`, `drafter` (None: `default_drafter`), `simulate_acc_len` (None: off) and the
    acceptance rule (`accept_rule_from_settings`)."""
    if config.speculative not in SPECULATIVE_MODES:
        raise ValueError(f"speculative mode must be one of {SPECULATIVE_MODES}, got {config.speculative!r}")
    if config.speculative == "off":
        return None
    drafter = build_drafter(config.drafter or default_drafter(runner), runner.eager_runner)
    return SpeculativeDecoder(
        runner,
        drafter,
        block_size=config.block_size,
        simulate_acc_len=config.simulate_acc_len,
        accept_rule=accept_rule_from_settings(config),
        debug_faults=faults_of(config),
    )
