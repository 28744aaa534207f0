"""The engine's fused sites (engine/model/fused_sites.py) on CUDA, bf16 default model, through the captured
GraphRunner steps and the eager prefill: Triton (backend auto) against the PyTorch references, same inputs. With the
default candidate budget the CSA sites (candidate_block_mask, indexer_postprocess) must give bitwise-equal logits;
--wo-quant mxfp8 (wo_a_mxfp8 + mxfp8_linear) agrees with its reference to fp32 accumulation order. One line per
arm; each arm builds its model with its site settings.

    python benchmarks/fused_sites_gpu_check.py
"""

from __future__ import annotations

import torch

from evalpipe.engine.model import fused_sites
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.static.graphs import GraphRunner

WIDTH = 6  # a G=5 verify step
STEPS = 12


def run_arm(prompts: list[list[int]], **settings) -> tuple[torch.Tensor, list[int], dict]:
    """A model built with the site settings: prefill (eager), STEPS verify-width and STEPS decode steps (captured);
    all logits and greedy tokens."""
    base = ModelRunner(device="cuda", dtype=torch.bfloat16, max_seqs=16, max_seq_len=512,
                       sites=fused_sites.SiteSettings(**settings))
    info = base.fused_sites
    runner = GraphRunner(base, widths=(1, WIDTH), fused=True)
    seqs = [runner.allocate() for _ in prompts]
    out = [runner.forward(seqs, prompts, all_logits=True)]
    for step in range(STEPS):
        out.append(runner.forward(seqs, [[16 + (step * 7 + i + j) % 200 for j in range(WIDTH)]
                                         for i in range(len(seqs))], all_logits=True))
    tokens = []
    last = out[-1].view(len(seqs), WIDTH, -1)[:, -1].argmax(-1)
    for _ in range(STEPS):
        tokens.append(int(last[0]))
        logits = runner.forward(seqs, [[int(t)] for t in last])
        out.append(logits)
        last = logits.argmax(-1)
    return torch.cat([o.float() for o in out]), tokens, info


def main() -> None:
    assert torch.cuda.is_available(), "needs CUDA"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(16, 272, (n,), generator=gen).tolist() for n in (150, 37, 90, 210)]
    failures = 0
    ref, ref_tok, _ = run_arm(prompts, backend="reference")
    got, got_tok, _ = run_arm(prompts, backend="auto")
    same = torch.equal(ref, got)
    failures += not same
    print(f"CSA sites (default budget) triton vs reference: logits bitwise equal {same}, "
          f"max |diff| {float((ref - got).abs().max()):.3g}, greedy tokens equal {ref_tok == got_tok}")
    narrow, _, _ = run_arm(prompts, candidate_blocks=2, candidate_block_size=4)
    print(f"candidate budget 2 blocks x 4 entries: max |diff| vs default {float((narrow - got).abs().max()):.3g} "
          f"(selection narrowed)")
    qref, qref_tok, info = run_arm(prompts, wo_quant="mxfp8", backend="reference")
    qgot, qgot_tok, _ = run_arm(prompts, wo_quant="mxfp8", backend="auto")
    rel = float((qref - qgot).abs().max() / qref.abs().max())
    failures += rel > 0.05
    print(f"wo-quant mxfp8 ({info['wo_quant_layers']} layers) triton vs reference: max rel |diff| {rel:.3g}, "
          f"greedy tokens equal {qref_tok == qgot_tok}; vs unquantized max |diff| "
          f"{float((qgot - got).abs().max()):.3g}")
    print("site calls (host side, captures + eager):", fused_sites.site_counts())
    print("RESULT:", "all checks passed" if not failures else f"{failures} failure(s)")


if __name__ == "__main__":
    main()
