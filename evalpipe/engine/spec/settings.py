"""What a server's speculation flags mean, as plain data and torch-free: the acceptance rule (`AcceptRule`, from
`--spec-accept-*`) and the drafter spec (`--drafter`). The HTTP process and the launchers' flag checks read them
without importing the model code; spec/accept.py and spec/drafters.py act on them in the engine process.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalpipe.engine.config import EngineConfig


@dataclass(frozen=True)
class AcceptRule:
    """Which acceptance rule a server runs: "exact" (the default), or one of the LOSSY "topk" / "threshold" rules.

    Thresholds of 1.0 are SGLang's lossless default and mean "exact"; top-k needs K >= 2 (K = 1 is exact greedy).
    """

    topk: int | None = None
    threshold_single: float = 1.0
    threshold_acc: float = 1.0

    def __post_init__(self):
        if self.topk is not None and self.topk < 2:
            raise ValueError(
                f"top-k acceptance needs K >= 2: K = {self.topk} accepts only the target's argmax, "
                "which is the default exact greedy rule"
            )
        for name, value in (("threshold_single", self.threshold_single), ("threshold_acc", self.threshold_acc)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] (1.0 = lossless), got {value}")
        if self.topk is not None and (self.threshold_single < 1.0 or self.threshold_acc < 1.0):
            raise ValueError("choose one lossy acceptance rule: top-k or the probability thresholds, not both")

    @classmethod
    def from_flags(cls, topk: int | None, threshold_single: float | None, threshold_acc: float | None) -> "AcceptRule":
        """From the serve flags, where None means "not given" (thresholds then default to SGLang's 1.0)."""
        return cls(
            topk=topk,
            threshold_single=1.0 if threshold_single is None else float(threshold_single),
            threshold_acc=1.0 if threshold_acc is None else float(threshold_acc),
        )

    @property
    def name(self) -> str:
        if self.topk is not None:
            return "topk"
        return "threshold" if self.threshold_single < 1.0 or self.threshold_acc < 1.0 else "exact"

    @property
    def lossy(self) -> bool:
        return self.name != "exact"

    def lossy_for(self, greedy: bool) -> bool:
        """Does this rule decide a request's acceptance lossily? (thresholds leave greedy requests exact)"""
        return self.name == "topk" or (self.name == "threshold" and not greedy)

    def describe(self) -> dict:
        """The rule as /get_server_info and every choice's `spec` report it."""
        if self.name == "exact":
            return {"rule": "exact", "lossy": False}
        if self.name == "topk":
            return {"rule": "topk", "k": self.topk, "lossy": True, "applies_to": "greedy and sampled requests"}
        return {
            "rule": "threshold",
            "threshold_single": self.threshold_single,
            "threshold_acc": self.threshold_acc,
            "lossy": True,
            "applies_to": "sampled requests (greedy requests are verified exactly, as in SGLang)",
        }

    def label(self) -> str:
        """One short phrase for the serve ready line."""
        if self.name == "exact":
            return "accept exact"
        if self.name == "topk":
            return f"accept topk k={self.topk} (LOSSY)"
        return (
            f"accept threshold single={self.threshold_single:g} acc={self.threshold_acc:g} (LOSSY on sampled requests)"
        )


def accept_rule_from_settings(config: EngineConfig) -> AcceptRule:
    """The acceptance rule of the engine config (`spec_accept_topk`, `spec_accept_threshold_single/acc`);
    exact when none is set. Raises ValueError for a rule that cannot be built (AcceptRule says why)."""
    return AcceptRule.from_flags(
        config.spec_accept_topk, config.spec_accept_threshold_single, config.spec_accept_threshold_acc
    )


DRAFTER_KINDS = ("layerskip:N", "model:PATH", "ngram", "self")


def parse_drafter_spec(spec: str) -> tuple[str, str | int | None]:
    """'layerskip:2' -> ('layerskip', 2); 'model:/p' -> ('model', '/p'); 'ngram'/'self' -> (kind, None)."""
    kind, _, arg = spec.partition(":")
    if kind in ("ngram", "self") and not arg:
        return kind, None
    if kind == "layerskip":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"drafter {spec!r}: layerskip needs a positive layer count, e.g. layerskip:2")
        return kind, int(arg)
    if kind == "model" and arg:
        return kind, arg
    raise ValueError(f"unknown drafter {spec!r}; expected one of {', '.join(DRAFTER_KINDS)}")
