"""The CI gate of `evalpipe compare --fail-on` and `evalpipe ab --fail-on`: which verdicts fail a build.

One owner for the verdict a comparison gives, its MDE, and the exit code a failed gate returns, so that compare,
ab and their reports read the same figures.
"""

from __future__ import annotations

import click

GATE_FAILED_EXIT = 4  # as `evalpipe qualify`: a gate failed
GATE_VERDICTS = ("inferior", "inconclusive", "not-evaluable")


def verdict_of(result: dict) -> dict:
    """{verdict, mde_pts, margin_pts} of a run comparison (greedy or repeated); verdict None for a bench one."""
    g = result.get("greedy")
    if g:
        return {"verdict": g.get("verdict"), "mde_pts": g.get("mde_pts"), "margin_pts": g.get("margin_pts")}
    r = result.get("repeated_stats")
    if r:
        iv = r.get("interval") or {}
        return {
            "verdict": iv.get("verdict"),
            "mde_pts": (r.get("power") or {}).get("mde_pts"),
            "margin_pts": iv.get("margin_pts"),
        }
    return {"verdict": None, "mde_pts": None, "margin_pts": None}


def parse_fail_on(text: str | None) -> frozenset[str]:
    """'inferior,inconclusive' -> the set; a word outside GATE_VERDICTS is a usage error."""
    words = frozenset(w.strip() for w in (text or "").split(",") if w.strip())
    unknown = sorted(words - set(GATE_VERDICTS))
    if unknown:
        raise click.BadParameter(
            f"unknown verdict(s) {', '.join(unknown)}; choose from {', '.join(GATE_VERDICTS)}", param_hint="--fail-on"
        )
    return words


FAIL_ON_HELP = (
    f"Comma-separated verdicts that fail the command with exit code {GATE_FAILED_EXIT} (for CI), from: "
    f"{', '.join(GATE_VERDICTS)}; e.g. --fail-on inferior,inconclusive. The comparison is still written "
    "in full. Without it a finished comparison exits 0 whatever its verdict."
)
