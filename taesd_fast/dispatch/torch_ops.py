"""The PyTorch rows of the dispatch table: what runs on CPU, under autograd, in backend "torch", and on the GPU
wherever no kernel was measured faster (cuDNN / cuBLAS)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import head_math  # the head's PyTorch pieces (norm, window, unpatchify)


def soft_clamp(x: Tensor) -> Tensor:
    """TAESD's latent clamp to (-3, 3), as upstream writes it (so the PyTorch path stays bit-identical)."""
    return torch.tanh(x / 3) * 3


def conv2d(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False) -> Tensor:
    if pre_clamp:
        x = soft_clamp(x)
    if upsample != 1:
        x = F.interpolate(x, scale_factor=upsample, mode="nearest")
    y = F.conv2d(x, w, b, stride=stride, padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual
    return torch.relu(y) if relu else y


def past_frames(x: Tensor, memory: Tensor | None, frames: int) -> Tensor:
    """For x [B*frames, C, H, W] (`frames` consecutive frames per sample): each frame's predecessor within its
    sample, memory [B, C, H, W] (zeros when None) before each sample's first. Keeps x's memory format. With one
    frame per sample (a streaming step) the past is the memory itself, returned as is (callers only read it)."""
    nt, c, h, wd = x.shape
    if frames == 1 and memory is not None and memory.dtype == x.dtype and memory.stride() == x.stride():
        return memory
    past = torch.empty_like(x)
    shifted = past.view(nt // frames, frames, c, h, wd)
    shifted[:, 0] = 0 if memory is None else memory
    shifted[:, 1:] = x.view(nt // frames, frames, c, h, wd)[:, :-1]
    return past


def mem_conv(x, memory, w, b, frames, relu) -> Tensor:
    """A memory block's first conv: conv2d(cat([x, past]), w, b) (ReLU'd if relu), past = past_frames(x, memory,
    frames)."""
    return conv2d(torch.cat([x, past_frames(x, memory, frames)], 1), w, b, 1, None, relu)


def head(x, w, b) -> Tensor:
    return F.conv3d(x, w, b, padding=(0, 1, 1)).clamp(-1.0, 1.0)


def head_full(x, cache, gamma, w, b, eps, patch=0) -> tuple[Tensor, Tensor]:
    window = head_math.causal_window(head_math.activate(x, gamma, eps), cache)
    return head_math.unpatchify(head(window, w, b), patch), window[:, :, -2:]
