"""The engine's fused sites (engine/model/fused_sites.py) on CUDA, bf16 default model, through the captured
GraphRunner steps and the eager prefill: Triton (backend auto) against the PyTorch references, same inputs. With the
default candidate budget the CSA sites (candidate_block_mask, indexer_postprocess) must give bitwise-equal logits;
--wo-quant mxfp8 (wo_a_mxfp8 + mxfp8_linear) agrees with its reference to fp32 accumulation order. One line per
arm; each arm builds its model with its site settings.

    python -m benchmarks.engine.fused_sites_gpu_check [--smoke]
"""

from __future__ import annotations

import argparse

import torch

from evalpipe.engine.model import fused_sites
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.static.graphs import GraphRunner

WIDTH = 6  # a G=5 verify step
STEPS = 12


def run_arm(
    prompts: list[list[int]], device: str = "cuda", model: str | None = None, **settings
) -> tuple[torch.Tensor, list[int], dict]:
    """A model built with the site settings: prefill (eager), STEPS verify-width and STEPS decode steps (captured);
    all logits and greedy tokens."""
    base = ModelRunner(
        model,
        device=device,
        dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        max_seqs=16,
        max_seq_len=512,
        sites=fused_sites.SiteSettings(**settings),
    )
    info = base.fused_sites
    runner = GraphRunner(base, widths=(1, WIDTH), fused=True)
    seqs = [runner.allocate() for _ in prompts]
    out = [runner.forward(seqs, prompts, all_logits=True)]
    for step in range(STEPS):
        out.append(
            runner.forward(
                seqs, [[16 + (step * 7 + i + j) % 200 for j in range(WIDTH)] for i in range(len(seqs))], all_logits=True
            )
        )
    tokens = []
    last = out[-1].view(len(seqs), WIDTH, -1)[:, -1].argmax(-1)
    for _ in range(STEPS):
        tokens.append(int(last[0]))
        logits = runner.forward(seqs, [[int(t)] for t in last])
        out.append(logits)
        last = logits.argmax(-1)
    return torch.cat([o.float() for o in out]), tokens, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check on the CPU: the tiny model, float32, the static step un-captured, 2 short prompts, 1 step each",
    )
    args = ap.parse_args()
    global STEPS
    device, model, lengths = "cuda", None, (150, 37, 90, 210)
    if args.smoke:
        device, model, lengths, STEPS = "cpu", "evalpipe-tiny-dsv4", (20, 9), 1
    else:
        assert torch.cuda.is_available(), "needs CUDA"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(16, 272, (n,), generator=gen).tolist() for n in lengths]
    rows = []  # (arm, max |diff| against its reference, greedy tokens equal, check)
    ref, ref_tok, _ = run_arm(prompts, device, model, backend="reference")
    got, got_tok, _ = run_arm(prompts, device, model, backend="auto")
    same = torch.equal(ref, got)
    rows.append(
        (
            "CSA sites (default budget), triton vs reference",
            float((ref - got).abs().max()),
            ref_tok == got_tok,
            "bitwise equal" if same else "FAIL: not bitwise equal",
        )
    )
    narrow, _, _ = run_arm(prompts, device, model, candidate_blocks=2, candidate_block_size=4)
    rows.append(
        (
            "candidate budget 2 blocks x 4 entries, vs default",
            float((narrow - got).abs().max()),
            None,
            "selection narrowed (no check)",
        )
    )
    qref, qref_tok, info = run_arm(prompts, device, model, wo_quant="mxfp8", backend="reference")
    qgot, qgot_tok, _ = run_arm(prompts, device, model, wo_quant="mxfp8", backend="auto")
    rel = float((qref - qgot).abs().max() / qref.abs().max())
    rows.append(
        (
            f"wo-quant mxfp8 ({info['wo_quant_layers']} layers), triton vs reference",
            rel,
            qref_tok == qgot_tok,
            f"max rel diff {rel:.3g} <= 0.05" if rel <= 0.05 else f"FAIL: max rel diff {rel:.3g} > 0.05",
        )
    )
    rows.append(("wo-quant mxfp8 vs unquantized", float((qgot - got).abs().max()), None, "(no check)"))
    failures = sum(row[3].startswith("FAIL") for row in rows)
    print(f"device {device}, {len(prompts)} prompts, {STEPS} verify-width and {STEPS} decode steps per arm")
    print("| arm | max diff | greedy tokens equal | check |\n|---|---:|---|---|")
    for arm, diff, tokens_equal, check in rows:
        print(f"| {arm} | {diff:.3g} | {'-' if tokens_equal is None else tokens_equal} | {check} |")
    print("site calls (host side, captures + eager):", fused_sites.site_counts())
    print("RESULT:", "all checks passed" if not failures else f"{failures} failure(s)")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
