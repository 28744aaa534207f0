"""GPU serving speed, one run does it all: CUDA graphs and the fused verify path vs plain decoding and
transformers `generate`, on a mid-size DeepSeek-V4-shaped model with random weights.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m benchmarks.serving.gpu_serving [--out DIR]

Protocol (the `evalpipe bench` protocol, in-process through the real Engine loop): 4096 random input ids (seed 42,
byte-tokenizer specials excluded), exactly 1024 output tokens (ignore EOS), batch 1, temperature 0, block size 5,
simulated acceptance 5.5 (floor/ceil mix), 1 warm-up + 6 measured rounds per arm; a round frees its sequence, so
every round prefills afresh. Decode rate = (final completion tokens - tokens of the first event) / (time of the last
event - time of the first event): prefill excluded, timestamps taken when the engine emits each event.

Arms: speculation off; speculation on with --fused off; speculation on with --fused on (all three through
`GraphRunner`: captured decode / 6-row verify steps); transformers `generate` on the same weights (slow: fewer
tokens and rounds, printed in its row). Under simulation the drafts' content is irrelevant, so the speculative arms
draft with `RepeatDrafter` (no model, no GPU work): the cycle measured is the verify path the fused A/B is about.

Also measured in the same run: device-to-device copy bandwidth (bytes read + written), kernels per verify cycle
(torch.profiler over one engine step, fused off vs on, plus the eager count of the captured verify step), and the
achieved weight bandwidth = active weight bytes per target forward x target forwards per second, as a share of the
copy bandwidth.

`--smoke` runs a small config with few tokens (also on `--device cpu`, where CUDA graphs are off: a dry run of the
script logic).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import gpu_bench
from evalpipe.engine.engine import Engine
from evalpipe.engine.model.config import TINY_CONFIG_PATH, load_config
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.static.graphs import GraphRunner
from evalpipe.engine.tokenizer import load_tokenizer

# ---- model -------------------------------------------------------------------------------------------------------

CONFIGS = ("v4-top2", "v4-top6")


def bench_config(smoke: bool, name: str = "v4-top2") -> dict:
    """DeepSeek-V4 shaped: V4-Flash's attention geometry (hidden 4096, 512-dim shared-KV heads, q/o low rank, mHC x4,
    CSA ratio 4 with a 512-wide indexer top-k, ratio-2 heavily-compressed layers so the C2 verify kernel is on the
    hot path, hash-MoE first layers), cut to 6 layers. `v4-top2`: 8 routed experts, 2 per token (~2.1 B parameters,
    the first config measured); `v4-top6`: 12 routed experts, 6 per token plus the shared one -- V4's routing width
    (6 routed + 1 shared per token), so a step reads ~1.3x more weight bytes (~2.7 B parameters)."""
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {CONFIGS}, got {name!r}")
    cfg = json.loads(Path(TINY_CONFIG_PATH).read_text())
    if smoke:
        cfg.update(max_position_embeddings=2048)
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], original_max_position_embeddings=256)
        return cfg
    cfg.update(
        vocab_size=32768,
        hidden_size=4096,
        num_hidden_layers=6,
        num_attention_heads=32,
        head_dim=512,
        partial_rotary_factor=0.125,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 2},
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        max_position_embeddings=8192,
    )
    if name == "v4-top6":
        cfg.update(n_routed_experts=12, num_experts_per_tok=6)
    cfg["rope_parameters"] = dict(cfg["rope_parameters"], original_max_position_embeddings=512)
    return cfg


def random_state(config, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights drawn on the device (the scales of evalpipe.engine.model.weights.init_tiny_weights)."""
    from transformers import DeepseekV4ForCausalLM

    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in DeepseekV4ForCausalLM(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name in sorted(shapes):
        shape, _ = shapes[name]
        if name.endswith("tid2eid"):
            state[name] = torch.randint(0, config.n_routed_experts, shape, generator=gen, device=device)
            continue
        leaf = name.rsplit(".", 1)[-1]
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if "norm" in name:
            t = 1.0 + 0.1 * t
        elif leaf in ("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias"):
            t = 0.5 * t
        elif leaf in ("scale", "hc_scale"):
            t = 1.0 + 0.1 * t
        elif "embed_tokens" not in name:
            t = t / shape[-1] ** 0.5
        state[name] = t.to(dtype)  # one dtype in the file: transformers loads it as-is; the engine upcasts its
        #                            float32 parameters (norms, sinks, mHC) itself
    return state


def weight_bytes(runner) -> dict:
    """Bytes one decode forward must read: every weight but the embedding table (one row) and the routed experts
    (num_experts_per_tok of n_routed_experts per MoE layer)."""
    m, c = runner.model, runner.config
    seen, total, routed = set(), 0, 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for layer in m.layers:
        for obj in (
            layer.attn,
            layer.attn.compressor,
            layer.attn.indexer,
            getattr(layer.attn.indexer, "compressor", None),
            layer.mlp,
            layer.attn_hc,
            layer.ffn_hc,
        ):
            if obj is None:
                continue
            for name, t in vars(obj).items():
                if name in ("gate_up", "down"):
                    routed += t.numel() * t.element_size()
                    continue
                if isinstance(t, (list, tuple)):
                    for u in t:
                        add(u)
                else:
                    add(t)
        add(layer.attn_norm)
        add(layer.mlp_norm)
    add(m.lm_head)
    add(m.norm)
    active = total + routed * c.num_experts_per_tok // c.n_routed_experts
    return {"dense_bytes": total, "routed_bytes": routed, "active_bytes": active}


# ---- measurements ---------------------------------------------------------------------------------------------


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (median of 20 timed copies)."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * nbytes / statistics.median(times)


class RepeatDrafter:
    """Proposes the last committed token G times: no model, no device work. Only for simulated acceptance, where
    the verify step accepts a prescribed count whatever the drafts are."""

    name = "repeat"

    def propose(self, seqs, widths):
        return [[s.last_token] * w for s, w in zip(seqs, widths)], [None] * len(seqs)

    def rollback(self, seq, committed_before, accepted):
        pass

    def release(self, key):
        pass

    def describe(self):
        return {"drafter": self.name}


def run_round(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    """One request through the engine loop; per-event (time, tokens) as the streamed protocol sees them."""
    events = []
    seq = Sequence(prompt=list(prompt), params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    seq.on_event = lambda ev: events.append((time.perf_counter(), len(ev.token_ids), ev.completion_tokens, ev.spec))
    engine.submit([seq])
    while seq.status is not Status.FINISHED:
        engine.step()
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    content = [e for e in events if e[1] > 0]
    first, last = content[0], content[-1]
    tokens = last[2] - first[2]
    rate = tokens / (last[0] - first[0])
    spec = events[-1][3]
    return {
        "tok_s": rate,
        "completion_tokens": last[2],
        "events": len(content),
        "accept_length": spec["accept_length"] if spec else 1.0,
        "finish": seq.finish_reason,
    }


def count_kernels(fn, top: int = 0) -> dict:
    """Kernels (CUDA device events that are not memcpy/memset) launched while fn runs, via torch.profiler; with
    `top`, also the kernels that took the most device time (name, count, total us)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return {"kernels": None, "memcpy": None}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = memcpy = 0
    busy = 0.0
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name or "memset" in name:
            memcpy += 1
        else:
            kernels += 1
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        busy += us
        rec = by_name.setdefault(e.name[:90], [0, 0.0])
        rec[0] += 1
        rec[1] += us
    out = {"kernels": kernels, "memcpy": memcpy, "device_busy_us": round(busy, 1)}
    if top:
        out["top"] = sorted(([n, c, round(t, 1)] for n, (c, t) in by_name.items()), key=lambda r: -r[2])[:top]
    return out


def hf_generate_arm(model_dir: str, prompt: list[int], device: str, dtype, new_tokens: int, rounds: int) -> dict:
    from transformers import DeepseekV4ForCausalLM
    from transformers.generation.streamers import BaseStreamer

    # every parameter in the run dtype (transformers 5.17 keeps norms/mHC in float32 when loading and then feeds a
    # float32 activation into a bf16 projection; the engine keeps those in float32 itself)
    model = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device=device, dtype=dtype).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.tensor([prompt], device=device)
    rates = []
    for r in range(rounds + 1):
        clock = Clock()
        n = 4 if r == 0 else new_tokens
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
        if device == "cuda":
            torch.cuda.synchronize()
        got = out.shape[1] - ids.shape[1]
        t = clock.times[1:]  # first put is the prompt; then one put per new token (the first comes from prefill)
        if r > 0:
            rates.append((got - 1) / (t[-1] - t[0]))
    step_kernels = count_kernels(
        lambda: model.generate(
            ids[:, :64],
            attention_mask=torch.ones_like(ids[:, :64]),
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
        )
    )
    model = None  # drop the weights before the caller's next arm (a lambda above holds the name)
    return {"rounds": rates, "new_tokens": new_tokens, "kernels_3_tokens_64_prompt": step_kernels}


# ---- main -----------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="small config, few tokens (script check; on the CPU without a GPU)"
    )
    ap.add_argument(
        "--config",
        default="v4-top2",
        choices=CONFIGS,
        help="model shape: v4-top2 (8 experts, 2 per token) or v4-top6 (12 experts, 6 per token)",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_serving.json")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per arm (default 6; smoke 1)")
    ap.add_argument("--hf-tokens", type=int, default=None, help="new tokens per transformers round (default 24)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers generate arm")
    ap.add_argument("--only-hf", action="store_true", help="only the transformers generate arm (same weights)")
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        args.device = "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu --smoke for a dry run", file=sys.stderr)
        return 2
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    smoke = args.smoke
    input_len, output_len = (64, 12) if smoke else (4096, 1024)
    rounds = args.rounds or (1 if smoke else 6)
    hf_tokens = args.hf_tokens or (4 if smoke else 24)
    hf_rounds = 1 if smoke else 3
    block, sim = 5, 5.5
    torch.manual_seed(0)
    report: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "smoke": smoke,
        "config": args.config,
        "argv": sys.argv,
    }
    import transformers
    import triton

    report["transformers"], report["triton"] = transformers.__version__, triton.__version__
    print(
        f"device {report['device']}  torch {torch.__version__}  triton {triton.__version__}  "
        f"transformers {transformers.__version__}",
        flush=True,
    )

    bw = copy_bandwidth(dev, 4 << 30)
    report["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth (read + write): {bw / 1e12:.3f} TB/s", flush=True)

    from evalpipe.engine.model.weights import save_checkpoint

    config = load_config(bench_config(smoke, args.config))
    tmp = Path(tempfile.mkdtemp(prefix="gpu_serving_"))
    model_dir = tmp / "model"
    t0 = time.perf_counter()
    state = random_state(config, dev, dtype)
    params = sum(t.numel() for t in state.values())
    save_checkpoint(config, {k: v.cpu() for k, v in state.items()}, model_dir)
    del state
    print(f"random checkpoint: {params / 1e9:.3f} B parameters, written in {time.perf_counter() - t0:.1f}s", flush=True)
    report["parameters"] = params

    gen = torch.Generator().manual_seed(42)
    prompt = torch.randint(16, config.vocab_size, (input_len,), generator=gen).tolist()  # no specials
    if args.only_hf:
        hf = hf_generate_arm(str(model_dir), prompt, dev, dtype, hf_tokens, hf_rounds)
        report["arms"] = {"transformers generate": hf}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gpu_serving_hf_{args.config}.json").write_text(json.dumps(report, indent=2, default=str))
        med = statistics.median(hf["rounds"])
        print(
            f"transformers generate: median {med:.2f} tok/s, rounds {[round(r, 2) for r in hf['rounds']]} "
            f"({hf_tokens} new tokens per round after a {input_len}-token prompt); kernels for 3 new tokens "
            f"after a 64-token prompt: {hf['kernels_3_tokens_64_prompt']}",
            flush=True,
        )
        return 0
    max_seq = input_len + output_len + 2 * (block + 1)
    tokenizer = load_tokenizer(None)

    base = ModelRunner(str(model_dir), device=dev, dtype=dtype, max_seqs=2, max_seq_len=max_seq)
    wb = weight_bytes(base)
    report["weight_bytes"] = wb
    active = wb["active_bytes"]
    print(
        f"active weight bytes per forward {active / 1e9:.3f} GB -> bandwidth limit {bw / active:.0f} forwards/s",
        flush=True,
    )

    arms = {}
    kernel_counts = {}

    def arm(name, graph_kwargs, spec):
        t0 = time.perf_counter()
        graph = GraphRunner(base, **graph_kwargs)
        decoder = SpeculativeDecoder(graph, RepeatDrafter(), block_size=block, simulate_acc_len=sim) if spec else None
        engine = Engine(graph, tokenizer, max_batch=1, max_tokens_per_step=input_len, decoder=decoder)
        graph.capture_all()
        setup = time.perf_counter() - t0
        results = []
        for r in range(rounds + 1):
            res = run_round(engine, prompt, output_len)
            tag = "warm-up" if r == 0 else f"round {r}"
            print(
                f"  {name:<22} {tag:<8} {res['tok_s']:9.1f} tok/s  accept {res['accept_length']:.3f}  "
                f"tokens {res['completion_tokens']} ({res['finish']})",
                flush=True,
            )
            if r > 0:
                results.append(res)
        # kernels per cycle: one engine step of a running request (graph replay), and the captured step eagerly
        seq = Sequence(prompt=list(prompt[:64]), params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.submit([seq])
        engine.step()  # prefill
        per_step = count_kernels(engine.step)
        t_steps = []
        while seq.status is not Status.FINISHED:
            t0 = time.perf_counter()
            engine.step()
            t_steps.append(time.perf_counter() - t0)
        width = block + 1 if spec else 1
        step = graph.steps[(1, width)]
        step.fill_padding()
        eager = count_kernels(lambda: step._run(), top=60)
        if dev == "cuda":  # device time of one replay, and of the eager (un-captured) step
            eager["replay_us"] = round(gpu_bench.replay_us(step.graph, 5), 1)
        eager["engine_step_wall_us"] = round(statistics.median(t_steps) * 1e6, 1) if t_steps else None
        for row in eager.get("top", [])[:15]:
            print(f"      {row[1]:5d} x {row[2]:10.1f} us  {row[0]}", flush=True)
        graph.runner.free(graph.pad_slot)
        kernel_counts[name] = {"engine_step": per_step, "captured_step_eager": eager}
        brief = {k: v for k, v in eager.items() if k != "top"}
        print(
            f"  {name:<22} setup+capture {setup:.1f}s; profiler: engine step {per_step}, "
            f"captured step run eagerly {brief}",
            flush=True,
        )
        arms[name] = {
            "rounds": [r["tok_s"] for r in results],
            "accept_length": statistics.median(r["accept_length"] for r in results),
            "completion_tokens": [r["completion_tokens"] for r in results],
            "kernels": kernel_counts[name],
        }

    print("arms (batch 1, temperature 0, ignore EOS):", flush=True)
    arm("spec off", dict(widths=(1,), buckets=(1,), fused=True), spec=False)
    arm("spec on, fused off", dict(widths=(block + 1,), buckets=(1,), fused=False), spec=True)
    arm("spec on, fused on", dict(widths=(block + 1,), buckets=(1,), fused=True), spec=True)
    base = None  # drop the weights (the arm closure above holds the name)
    if dev == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        hf = hf_generate_arm(str(model_dir), prompt, dev, dtype, hf_tokens, hf_rounds)
        arms["transformers generate"] = {
            "rounds": hf["rounds"],
            "accept_length": 1.0,
            "kernels": {"generate_3_tokens": hf["kernels_3_tokens_64_prompt"]},
            "note": f"{hf_tokens} new tokens per round, {hf_rounds} rounds",
        }
    report["arms"] = arms
    report["protocol"] = {
        "input_len": input_len,
        "output_len": output_len,
        "rounds": rounds,
        "warmup": 1,
        "block_size": block,
        "simulate_acc_len": sim,
        "batch": 1,
        "temperature": 0,
    }

    # ---- table ----
    lines = [
        f"GPU: {report['device']}; model: DeepSeek-V4-shaped ({args.config}), {params / 1e9:.2f} B parameters "
        f"({active / 1e9:.2f} GB active bf16 weights per forward); copy bandwidth {bw / 1e12:.2f} TB/s "
        f"-> weight-read limit {bw / active:.0f} forwards/s",
        "| arm | median decode tok/s | rounds (tok/s) | accept length | kernels per cycle | weight BW share |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, a in arms.items():
        med = statistics.median(a["rounds"])
        fwd = med / a["accept_length"]
        share = fwd * active / bw
        k = a["kernels"]
        if "engine_step" in k:
            kern = f"{k['engine_step']['kernels']} ({k['captured_step_eager']['kernels']} eager)"
        else:
            kern = f"{k['generate_3_tokens']['kernels']} for 3 tokens"
        rounds_s = ", ".join(f"{x:.1f}" for x in a["rounds"])
        lines.append(f"| {name} | {med:.1f} | {rounds_s} | {a['accept_length']:.3f} | {kern} | {share:.1%} |")
    off = statistics.median(arms["spec off"]["rounds"])
    fo = arms["spec on, fused off"]["rounds"]
    fn = arms["spec on, fused on"]["rounds"]
    lines.append("")
    lines.append(f"spec off: {off / (bw / active):.1%} of the weight-read limit (target >= 60%)")
    lines.append(f"spec on fused on / spec off: {statistics.median(fn) / off:.2f}x (target >= 3x)")
    lines.append(
        f"fused on vs off: median {statistics.median(fn):.1f} vs {statistics.median(fo):.1f} tok/s "
        f"({statistics.median(fn) / statistics.median(fo) - 1:+.1%}); spread on [{min(fn):.1f}, {max(fn):.1f}]"
        f", off [{min(fo):.1f}, {max(fo):.1f}]"
    )
    if "transformers generate" in arms:
        hfm = statistics.median(arms["transformers generate"]["rounds"])
        lines.append(f"spec off / transformers generate: {off / hfm:.1f}x (target >= 50x)")
    report["table"] = lines
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_serving_{args.config}.json").write_text(json.dumps(report, indent=2, default=str))
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
