"""The Wan output head's PyTorch arithmetic around its conv: RMS norm, SiLU, the causal window and unpatchify. The
PyTorch rows (dispatch/torch_ops.py), OutputHead and the kernels' PyTorch twins (split_bf16, head_stencil,
head_full_common) all compute these; a leaf module, so the dispatcher can import it without importing a kernel
module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

__all__ = ["activate", "causal_window", "rms_norm", "unpatchify"]


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """Channel-wise (dim 1) L2 norm times sqrt(C) times gamma, in fp32 at least, rounded once to x.dtype
    (diffusers' WanRMS_norm, channel-first)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.normalize(x.to(compute), dim=1, eps=eps) * (x.shape[1] ** 0.5) * gamma.to(compute).reshape(-1, 1, 1, 1)
    return y.to(x.dtype)


def activate(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """RMS norm then SiLU: the conv's input, before the causal frames are put in front."""
    return F.silu(rms_norm(x, gamma, eps))


def causal_window(activated: Tensor, cache: Tensor | None, frames: int = 2) -> Tensor:
    """[cache | activated] along time; no cache means zero frames, the first chunk's causal padding."""
    if cache is None:
        b, c, _, h, w = activated.shape
        cache = activated.new_zeros(b, c, frames, h, w)
    return torch.cat([cache, activated], dim=2)


def unpatchify(x: Tensor, patch: int) -> Tensor:
    """[B, C*p*p, T, H, W] -> [B, C, T, H*p, W*p]: channel (c*p + s)*p + q goes to row offset q and column offset s
    (Wan's order, not pixel_shuffle's). patch 0 leaves x as it is."""
    if not patch:
        return x
    return rearrange(x, "b (c s q) f h w -> b c f (h q) (w s)", q=patch, s=patch)
