"""The comparison's plots as base64 PNGs (matplotlib Agg), for the self-contained HTML page."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evalpipe.compare.report.text import label, num  # noqa: E402

COLORS = {"a": "#4c72b0", "b": "#dd8452"}


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plot_per_question(result: dict) -> str:
    """Per-question accuracy, A on x and B on y: rates for repeated lanes, jittered 0/1 for greedy ones."""
    fig, ax = plt.subplots(figsize=(5, 5))
    if result.get("repeated_stats"):
        pq = result["repeated_stats"]["per_question"]
        xs = np.array([q["rate_a"] for q in pq])
        ys = np.array([q["rate_b"] for q in pq])
        ax.scatter(xs, ys, alpha=0.7, color=COLORS["b"])
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("per-question success rate")
    else:
        pq = result.get("per_question") or []
        xs = np.array([float(q["correct_a"]) for q in pq])
        ys = np.array([float(q["correct_b"]) for q in pq])
        rng = np.random.default_rng(0)
        ax.scatter(
            xs + rng.uniform(-0.12, 0.12, xs.size),
            ys + rng.uniform(-0.12, 0.12, ys.size),
            s=10,
            alpha=0.5,
            color=COLORS["b"],
        )
        for x in (0, 1):
            for y in (0, 1):
                n = int(np.sum((xs == x) & (ys == y)))
                ax.annotate(f"n={n}", (x, y + 0.2), ha="center", fontsize=11, weight="bold")
        ax.set_xticks([0, 1], ["wrong", "right"])
        ax.set_yticks([0, 1], ["wrong", "right"])
        ax.set_title("per-question correctness (jittered)")
        ax.plot([-0.3, 1.3], [-0.3, 1.3], color="gray", lw=0.8, ls="--")
        ax.set_xlim(-0.3, 1.4)
        ax.set_ylim(-0.3, 1.4)
    ax.set_xlabel(label(result, "a"))
    ax.set_ylabel(label(result, "b"))
    return _png(fig)


def plot_accept_lengths(result: dict) -> str | None:
    sp = result["spec"]
    if not (sp["a"]["histogram"] or sp["b"]["histogram"]):
        return None
    keys = sorted({int(k) for arm in ("a", "b") for k in sp[arm]["histogram"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for i, arm in enumerate(("a", "b")):
        h = sp[arm]["histogram"]
        total = sum(h.values()) or 1
        ax.bar(
            np.array(keys) + (i - 0.5) * width,
            [h.get(str(k), 0) / total for k in keys],
            width=width,
            label=f"{label(result, arm)} (mean {num(sp[arm]['accept_length_mean'], 2)})",
            color=COLORS[arm],
        )
    ax.set_xlabel("accept length (tokens per verify step)")
    ax.set_ylabel("share")
    ax.set_title("accept-length distribution")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_latency(result: dict) -> str | None:
    sd = result["speed"]
    if not (sd["a"]["latency_s"] or sd["b"]["latency_s"]):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "latency_s", "latency (s)"), (axes[1], "tokens_per_s", "tokens/s per response")):
        vals = [v for arm in ("a", "b") for v in sd[arm][key]]
        if not vals:
            ax.set_visible(False)
            continue
        bins = np.histogram_bin_edges(vals, bins=30)
        for arm in ("a", "b"):
            if sd[arm][key]:
                ax.hist(sd[arm][key], bins=bins, alpha=0.55, label=label(result, arm), color=COLORS[arm])
        ax.set_title(title)
        ax.legend(fontsize=8)
    return _png(fig)


def plot_bench(result: dict) -> str:
    metrics = result["metrics"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5))
    for ax, (name, m) in zip(np.atleast_1d(axes), metrics.items()):
        for i, arm in enumerate(("a", "b")):
            vals = m.get(f"values_{arm}") or []
            ax.scatter(
                np.full(len(vals), i) + np.linspace(-0.1, 0.1, len(vals)) if vals else [],
                vals,
                color=COLORS[arm],
                alpha=0.8,
            )
            if vals:
                ax.hlines(np.median(vals), i - 0.2, i + 0.2, color="black")
        ax.set_xticks([0, 1], ["A", "B"])
        ax.set_title(f"{name}: B/A {num(m.get('ratio'))}")
    return _png(fig)
