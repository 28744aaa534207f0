"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams per row, collapsed into a block's input
by `pre`, re-expanded by `post`, and mixed by a Sinkhorn-projected (doubly stochastic) `comb`."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from evalpipe.engine.primitives import unweighted_rms_norm


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation of [T, hc, hc] (column first, `iters` column passes in all).

    On CPU the ~60 tiny sequential ops run in numpy, where one op costs ~1 us instead of ~5 us through torch; with
    many rows the matrices are laid out hc-major so each sum is a few contiguous adds over T. Both numpy layouts
    add the hc terms in the same sequential order, so results do not depend on the batch size."""
    if comb.device.type == "cpu" and comb.dtype == torch.float32 and comb.shape[-1] >= 2:
        e = np.float32(eps)
        if comb.shape[0] < 8:
            add, div = np.add.reduce, np.divide  # the ufuncs themselves: no Python wrapper per call
            a = comb.numpy()
            a = a / (add(a, axis=-2, keepdims=True) + e)
            for _ in range(iters - 1):
                div(a, add(a, axis=-1, keepdims=True) + e, out=a)
                div(a, add(a, axis=-2, keepdims=True) + e, out=a)
            return torch.from_numpy(a)
        b = np.ascontiguousarray(comb.numpy().transpose(1, 2, 0))  # [hc_in, hc_out, T]
        hc = b.shape[0]
        rows = [b[i] for i in range(hc)]  # views [hc_out, T]
        cols = [b[:, j] for j in range(hc)]  # views [hc_in, T]

        def col_pass():  # divide by the sum over hc_in (axis -2 of the [T, hc, hc] matrix)
            acc = rows[0] + rows[1]
            for r in rows[2:]:
                acc += r
            acc += e
            b.__itruediv__(acc)

        def row_pass():  # divide by the sum over hc_out (axis -1)
            acc = cols[0] + cols[1]
            for c in cols[2:]:
                acc += c
            acc += e
            b.__itruediv__(acc[:, None, :])

        col_pass()
        for _ in range(iters - 1):
            row_pass()
            col_pass()
        return torch.from_numpy(b.transpose(2, 0, 1))
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, config):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc, self.iters, self.eps, self.norm_eps = (config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps,
                                                        config.rms_norm_eps)
        hc = self.hc
        self.pre_b, self.post_b, comb_b = self.base.split([hc, hc, hc * hc])
        self.comb_b = comb_b.view(hc, hc)
        self.pre_s, self.post_s, self.comb_s = (float(s) for s in self.scale)

    def __call__(self, streams: torch.Tensor):
        """streams [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        hc = self.hc
        flat = streams.flatten(1)
        mixes = F.linear(unweighted_rms_norm(flat if flat.dtype == torch.float32 else flat.float(), self.norm_eps),
                         self.fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre = torch.sigmoid(pre_w * self.pre_s + self.pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.post_s + self.post_b)
        comb = torch.softmax(comb_w.reshape(-1, hc, hc) * self.comb_s + self.comb_b, dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = torch.matmul(pre.unsqueeze(1), streams).squeeze(1) if streams.dtype == torch.float32 else \
            (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """New streams: post-weighted block output plus comb^T-mixed old streams."""
        dtype = streams.dtype
        if dtype != torch.float32:
            post, comb = post.to(dtype), comb.to(dtype)
        return torch.baddbmm(post.unsqueeze(-1) * block_out.unsqueeze(-2), comb.transpose(-1, -2), streams)


class HyperHead:
    """Final collapse of the streams before the model norm."""

    def __init__(self, fn, base, scale, config):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def __call__(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
