"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams per row, collapsed into a block's input
by `pre`, re-expanded by `post`, and mixed by a Sinkhorn-projected (doubly stochastic) `comb`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.engine.model.primitives import unweighted_rms_norm
from evalpipe.kernels.hyper import sinkhorn


class HyperConnection:
    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, config):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float()
        self.hc, self.iters, self.eps, self.norm_eps = (
            config.hc_mult,
            config.hc_sinkhorn_iters,
            config.hc_eps,
            config.rms_norm_eps,
        )
        hc = self.hc
        self.pre_b, self.post_b, comb_b = self.base.split([hc, hc, hc * hc])
        self.comb_b = comb_b.view(hc, hc)
        self.pre_s, self.post_s, self.comb_s = (float(s) for s in self.scale)

    def __call__(self, streams: torch.Tensor):
        """streams [T, hc, D] -> (post [T, hc], comb [T, hc, hc], collapsed [T, D])."""
        hc = self.hc
        flat = streams.flatten(1)
        mixes = F.linear(
            unweighted_rms_norm(flat if flat.dtype == torch.float32 else flat.float(), self.norm_eps), self.fn
        )
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre = torch.sigmoid(pre_w * self.pre_s + self.pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.post_s + self.post_b)
        comb = torch.softmax(comb_w.reshape(-1, hc, hc) * self.comb_s + self.comb_b, dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (
            torch.matmul(pre.unsqueeze(1), streams).squeeze(1)
            if streams.dtype == torch.float32
            else (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        )
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
