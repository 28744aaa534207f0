"""The arms of an A/B: which boots, in what order, which pairs are compared, and what the arms declare different.

Pure functions over the parsed arms, shared by `evalpipe ab`'s flag parsing (commands/ab.py) and the run (run.py).
"""

from __future__ import annotations

import dataclasses

from evalpipe.launchers.sglang import extra_flag_values

TIE_THRESHOLD = 1e-4


def merge_args(common: list[str], own: list[str]) -> list[str]:
    """Common then own arguments; each side's `--` passthrough part goes after every evalpipe flag."""

    def split(args):
        return (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])

    (common_flags, common_rest), (own_flags, own_rest) = split(common), split(own)
    rest = common_rest + own_rest
    return common_flags + own_flags + (["--", *rest] if rest else [])


def declared_flags(a, b) -> list[str]:
    """Option names whose values differ between the arms, plus differing passthrough flags (`native`, the engine
    config those give a native server, is derived from them and names nothing of its own)."""
    names = [
        f.name
        for f in dataclasses.fields(a)
        if f.name not in ("extra_args", "native") and getattr(a, f.name) != getattr(b, f.name)
    ]
    extra_a, extra_b = dict(extra_flag_values(a.extra_args)), dict(extra_flag_values(b.extra_args))
    names += sorted(f for f in set(extra_a) | set(extra_b) if extra_a.get(f, object()) != extra_b.get(f, object()))
    if "set_env" in names:
        names.remove("set_env")
        names += sorted(k for k in set(a.set_env) | set(b.set_env) if a.set_env.get(k) != b.set_env.get(k))
    return names


def arm_labels(order: str) -> list[tuple[str, str]]:
    """'ABBA' -> [('A','A1'), ('B','B1'), ('B','B2'), ('A','A2')]."""
    seen: dict[str, int] = {}
    out = []
    for side in order:
        seen[side] = seen.get(side, 0) + 1
        out.append((side, f"{side}{seen[side]}"))
    return out


def comparison_pairs(labels: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(kind, x, y): A_i vs B_i ('ab'), then A1 vs A_k and B1 vs B_k ('boot')."""
    a = [label for side, label in labels if side == "A"]
    b = [label for side, label in labels if side == "B"]
    pairs = [("ab", x, y) for x, y in zip(a, b)]
    pairs += [("boot", a[0], x) for x in a[1:]] + [("boot", b[0], y) for y in b[1:]]
    return pairs
