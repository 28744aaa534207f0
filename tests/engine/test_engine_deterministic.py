"""`EngineConfig(deterministic=True)`, built by `build` into the engine loop in process with the default model: one
prompt's greedy tokens are the same alone, in a batch of 8 with other prompts, after a prefix-cache hit on its own
first pages, and with block speculation (ngram) on, chunked prefill (48 rows a step) throughout.

On the CPU (CI) this proves that the switch reaches the model (`SiteSettings.deterministic`) through `build` and that
the CPU serving path keeps every arm's tokens equal with it on -- not batch invariance: the CPU path runs the PyTorch
references, and kernels/batch_invariant.py's aten overrides act on CUDA tensors only (the kernels' own invariance is
tests/kernels/'s). On a CUDA machine the same test runs in bfloat16 with CUDA graphs, where it is the engine-level
check of the invariant kernels, beside a check that inside `invariant_ops` a GEMM's or a reduction's row is bitwise
the same alone and among 63 other rows (benchmarks/serving/deterministic_gpu.py runs the large arms)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.loop import build_engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.kernels.batch_invariant import invariant_ops

NEW_TOKENS = 12
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=CUDA)]


def engine(device: str, dtype: str, **fields):
    config = EngineConfig(
        deterministic=True,
        device=device,
        dtype=dtype,
        max_batch=8,
        max_tokens_per_step=48,
        max_seq_len=512,
        **fields,
    )
    return build_engine(config, build, lambda c: load_tokenizer(None))


def run(eng, prompts: list[list[int]]) -> list[Sequence]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(prompt=list(p), params=params) for p in prompts]
    eng.submit(seqs)
    while any(s.status is not Status.FINISHED for s in seqs):
        eng.step()
    return seqs


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh prompts every run
    lengths = [199] + torch.randint(20, 200, (7,), generator=gen).tolist()  # the first: two full pages of 64 and more
    return [[1] + torch.randint(2, 256, (int(n),), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("device,dtype", DEVICES)
def test_greedy_tokens_depend_on_the_prompt_alone(prompts, device, dtype):
    target = prompts[0]
    plain = engine(device, dtype, prefix_cache="off")
    assert plain.runner.model.deterministic
    alone = run(plain, [target])[0].output
    assert len(alone) == NEW_TOKENS
    assert run(plain, [target] + prompts[1:])[0].output == alone  # a batch of 8

    cached = engine(device, dtype, prefix_cache="on")
    run(cached, [target[:150]])  # indexes the target's first two pages
    hit = run(cached, [target])[0]
    assert hit.cached_tokens == 128 and hit.output == alone

    spec = engine(device, dtype, prefix_cache="off", speculative="block", drafter="ngram")
    assert run(spec, [target])[0].output == alone


def row_ops(device: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Ops of the model's kinds over [B, 777] rows: a linear, a folded 3-d matmul, a bmm, a sum and a mean."""
    w = torch.randn(1000, 777, generator=gen, device=device).to(dtype)
    w3 = torch.randn(7, 111, 50, generator=gen, device=device).to(dtype)
    bias = torch.randn(1000, generator=gen, device=device).to(dtype)
    return {
        "linear": lambda x: F.linear(x, w),
        "linear with bias": lambda x: F.linear(x, w, bias),
        "matmul 3-d": lambda x: torch.matmul(x.view(x.shape[0], 7, 111), w[:50, :111].t()),
        "bmm": lambda x: torch.bmm(x.view(x.shape[0], 7, 111).transpose(0, 1), w3).transpose(0, 1),
        "sum": lambda x: x.float().sum(-1),
        "mean": lambda x: x.float().pow(2).mean(-1, keepdim=True),
    }


def test_row_ops_shapes():
    """The CUDA check's ops keep one output row per input row (run here on the CPU, where nothing is claimed)."""
    rows = torch.randn(5, 777)
    for name, op in row_ops("cpu", torch.float32, torch.Generator().manual_seed(0)).items():
        assert op(rows).shape[0] == 5 and torch.allclose(op(rows[2:3])[0], op(rows)[2], atol=1e-3), name


@CUDA
@pytest.mark.parametrize("gemm", ["tiles", "slabs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_rows_inside_invariant_ops_are_the_same_alone_and_in_a_batch(dtype, gemm):
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 1 << 20, ())))
    rows = torch.randn(150, 777, generator=gen, device="cuda").to(dtype)  # three 64-row slabs, the last padded
    rows[3] = float("nan")  # a neighbour's NaN stays in its row
    rows[140] = float("inf")
    with invariant_ops(gemm=gemm):
        for name, op in row_ops("cuda", dtype, gen).items():
            batch = op(rows)
            for at in (0, 37, 64, 137):  # slots of the first, second and last slab
                assert torch.equal(op(rows[at : at + 1])[0], batch[at]), (name, at)
                assert torch.equal(op(rows[at : at + 5])[0], batch[at]), (name, at)  # a row first among 5
