"""Prompt chunks of different lengths in one forward share one padded attention group (engine/forward_batch.py):
the rule that groups them, and on the default tiny model (float32, the eager chain) that a forward of several
chunks of several lengths gives every row the logits it gets when each request is fed in a forward of its own,
and leaves the same state behind (later chunks and decode rows read the rings and compressed entries it wrote).
The same through the attention kernel: tests/kernels/test_eager_attention_kernel.py."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.forward_batch import PAD_FACTOR, ForwardBatch, group_requests
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner

TOL = 1e-4  # float32: the two sides differ only in how the GEMMs group their rows


def test_requests_within_the_pad_factor_share_a_group():
    assert PAD_FACTOR == 2  # the expectations below are written for it
    assert group_requests([300, 250, 1, 1, 160, 149]) == [[0, 1, 4], [5], [2, 3]]
    assert group_requests([5, 5, 5]) == [[0, 1, 2]]
    assert group_requests([1, 2, 3, 4]) == [[1, 2, 3], [0]]  # 2 * 2 >= 4 joins; 1 * 2 < 3 starts a group
    assert group_requests([7]) == [[0]]
    assert group_requests([5, 7, 5, 4], pad_factor=1) == [[1], [0, 2], [3]]  # equal counts only


def test_a_padded_group_marks_its_padding_and_repeats_each_request_s_last_row():
    runner = ModelRunner(None, max_seqs=3, max_seq_len=256)
    seqs = [runner.allocate() for _ in range(3)]
    runner.pools.reserve({seqs[0]: 10, seqs[1]: 20, seqs[2]: 8})
    batch = ForwardBatch(runner.pools, seqs, [0, 13, 4], [5, 7, 4], torch.zeros(16, dtype=torch.long))
    (group,) = batch.groups
    assert group.n == 7 and group.host_counts == [5, 7, 4]
    assert group.rows.tolist() == [[0, 1, 2, 3, 4, 4, 4], [5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 15, 15, 15]]
    assert group.pos.tolist()[0] == [0, 1, 2, 3, 4, 4, 4] and group.pos.tolist()[2] == [4, 5, 6, 7, 7, 7, 7]
    assert group.real_rows.tolist() == list(range(16))
    assert group.ends().tolist() == [5, 20, 8]
    apart = ForwardBatch(runner.pools, seqs, [0, 13, 4], [5, 7, 4], torch.zeros(16, dtype=torch.long), pad_groups=False)
    assert sorted(g.n for g in apart.groups) == [4, 5, 7] and not any(g.padded for g in apart.groups)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sites' kernels compiled")


@pytest.mark.parametrize(
    "sites,device",
    [(False, "cpu"), (True, "cpu"), pytest.param(True, "cuda", marks=CUDA)],
    ids=["plain", "sites", "sites-cuda"],
)
def test_chunks_of_many_lengths_in_one_forward_equal_each_request_fed_alone(sites, device):
    """Four requests with histories of different lengths (past the tiny model's window of 24 or not, some with
    entries of both compressors, CSA ratio 4 and HCA ratio 2), then chunks of 16-30 rows together (one padded
    group: a padding row's result written back in place of its request's last row fails this), a decode row each,
    and chunks again: every row's logits as when each request is fed alone, forward by forward. On CUDA the sites
    take the attention kernel (a prompt chunk's path in the server)."""
    settings = SiteSettings() if sites else None
    together = ModelRunner(None, device=device, max_seqs=5, max_seq_len=512, sites=settings)
    alone = ModelRunner(None, device=device, max_seqs=5, max_seq_len=512, sites=settings)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh ids every run
    a = [together.allocate() for _ in range(4)]
    b = [alone.allocate() for _ in range(4)]

    def ids(n):
        return torch.randint(2, 256, (n,), generator=gen).tolist()

    for i, n in enumerate((37, 11, 120, 64)):  # histories, each alone on both sides
        prompt = ids(n)
        together.forward([a[i]], [prompt])
        alone.forward([b[i]], [prompt])
    steps = [
        [ids(n) for n in (30, 17, 25, 16)],  # one padded group: 16 * 2 >= 30
        [ids(1) for _ in range(4)],
        [ids(n) for n in (9, 12, 12, 7)],  # one padded group, reading what the padded forward wrote
    ]
    for rows in steps:
        assert len(group_requests([len(r) for r in rows])) == 1
        got = together.forward(a, rows, all_logits=True)
        want = torch.cat([alone.forward([s], [r], all_logits=True) for s, r in zip(b, rows)])
        assert got.shape == want.shape and torch.isfinite(got).all()
        assert (got - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_late_short_chunk_beside_a_long_one_stays_inside_the_position_table():
    """A padded group runs as many compression windows per request as its longest needs; a short chunk that starts
    late then has padding windows past its end, here past max_seq_len (the RoPE table's length). They are written
    to the trash page, and must not index the table with their position: a 3,500-token prompt chunked beside
    others at 8,192 rows a step hit this on an H100 ("index out of bounds" on the device, every later step lost)."""
    together = ModelRunner(None, max_seqs=3, max_seq_len=64)
    alone = ModelRunner(None, max_seqs=3, max_seq_len=64)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh ids every run
    ids = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (40, 40, 20)]
    a, b = [together.allocate() for _ in range(2)], [alone.allocate() for _ in range(2)]
    together.forward([a[1]], [ids[1]])
    alone.forward([b[1]], [ids[1]])
    # a new 40-row prompt beside rows 40-59 of the other: one padded group (20 * 2 >= 40); the late chunk's
    # windows 10-19 run past 64 / 4 = 16, its own last is 14
    rows = [ids[0], ids[2]]
    assert group_requests([len(r) for r in rows]) == [[0, 1]]
    got = together.forward(a, rows, all_logits=True)
    want = torch.cat([alone.forward([s], [r], all_logits=True) for s, r in zip(b, rows)])
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())
    # the entries it wrote are the ones a decode row then reads
    last = [[int(got[39].argmax())], [int(got[59].argmax())]]
    got = together.forward(a, last)
    want = torch.cat([alone.forward([s], [t]) for s, t in zip(b, last)])
    assert (got - want).abs().max().item() < TOL * max(1.0, want.abs().max().item())
