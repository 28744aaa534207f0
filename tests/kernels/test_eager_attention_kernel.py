"""The eager runner's forward through the kernels (Triton's CPU interpreter): what a prompt chunk runs on a GPU when
the model is built with sites (the server) -- the attention kernel of the graph step and mHC as `kernels.hyper`.
Float32 on a smaller random model than the tiny one (tests/support/small_dsv4.py: one sliding, one CSA and one HCA
layer; window 8, CSA ratio 4 with top-2 selection, HCA ratio 2): the logits of every row equal the eager chain's
(`backend="reference"`) and a runner that feeds each request in a forward of its own, for a first chunk, a second
chunk that reads the first one's ring and entries beside a request of another length (one group, padded:
engine/forward_batch.py), then 3 rows beside a decode row (lengths too far apart to share one: two groups), and the
route was taken (the sites' call counter)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.forward_batch import group_requests
from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner
from tests.support.small_dsv4 import TOPK, WINDOW, make_small_dsv4

TOL = 1e-4  # float32, IEEE dots in the kernel: op grouping only


def _prompt(n, seed):
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(make_small_dsv4(tmp_path_factory.mktemp("small-dsv4") / "model"))


def test_prompt_chunks_through_the_attention_kernel_equal_the_eager_chain(small_model):
    assert (WINDOW, TOPK) == (8, 2)  # the chunk lengths below are chosen for these
    chain = ModelRunner(small_model, max_seqs=3, max_seq_len=24, sites=SiteSettings(backend="reference"))
    kernel = ModelRunner(small_model, max_seqs=3, max_seq_len=24, sites=SiteSettings(backend="triton"))
    alone = ModelRunner(small_model, max_seqs=3, max_seq_len=24, sites=SiteSettings(backend="reference"))
    layers = len(kernel.model.layers)
    a_seqs = [chain.allocate() for _ in range(2)]
    b_seqs = [kernel.allocate() for _ in range(2)]
    c_seqs = [alone.allocate() for _ in range(2)]
    seed = int(torch.randint(0, 1 << 20, ()))  # fresh prompts every run
    # The interpreter's cost grows with the rows (the mHC kernels run per row), so each length is the least that
    # crosses its boundary. first, 9 rows (positions 0..8): row 8's window of 8 keys leaves key 0 out, and it
    # crosses the CSA (4) and HCA (2) ratios (2 and 4 entries). second, 4 rows (9..12): reads the first chunk's
    # ring and entries, and its rows see 2..3 CSA entries, so the top-2 selection keeps all of them in some rows
    # and drops one in others. other, 5 rows: another length, no history. Then 3 rows beside a decode row: too far
    # apart to share a group (1 * PAD_FACTOR < 3).
    first, second, other = _prompt(9, seed), _prompt(4, seed + 1), _prompt(5, seed + 2)
    steps = [
        ([0], [first]),  # one group: crosses the window and both ratios, no history
        ([0, 1], [second, other]),  # one padded group (4 and 5 rows): request 0 reads its ring and entries
        ([0, 1], [[7, 8, 9], [9]]),  # two groups: 3 rows, and a decode row
    ]
    for idx, rows in steps:
        before = fused_sites.site_counts()
        want = chain.forward([a_seqs[i] for i in idx], rows, all_logits=True)
        got = kernel.forward([b_seqs[i] for i in idx], rows, all_logits=True)
        after = fused_sites.site_counts()
        own = torch.cat([alone.forward([c_seqs[i]], [r], all_logits=True) for i, r in zip(idx, rows)])
        calls = {k: after.get(k, 0) - before.get(k, 0) for k in ("eager_attention_kernel", "eager_mhc_kernels")}
        groups = len(group_requests([len(r) for r in rows]))
        assert groups == (2 if rows[0] == [7, 8, 9] else 1)
        # every layer and group in the attention kernel; the forward's mHC through kernels.hyper (once per forward)
        assert calls == {"eager_attention_kernel": layers * groups, "eager_mhc_kernels": 1}, (calls, groups)
        assert got.shape == want.shape and torch.isfinite(got).all()
        for ref in (want, own):
            assert (got - ref).abs().max().item() < TOL * max(1.0, ref.abs().max().item())
            assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
