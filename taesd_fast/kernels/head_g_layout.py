"""The layout of g, the Wan head's intermediate between its temporal GEMM and its spatial stencil, and the weight
packed into that layout.

g[b, t, h, w, n] holds, for output frame t and pixel (h, w), the 3x3 spatial taps' partial sums: n = (i*3 + j)*12 + o
for tap (i, j) and output channel o < 12. That is 9 x 12 = 108 used channels, padded to GC = 112 so each pixel's
channels start 16-byte aligned in bf16 (112 x 2 = 224 bytes): the stencil's vector loads and the TMA boxes of the
Hopper g kernels need that. Every head kernel (split conv, Triton, Gluon and CUDA g kernels, the stencil) reads and
writes this one layout."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

GC = 112  # g channels per pixel: 9 taps x 12 outputs = 108, padded to a 16-byte multiple
CAUSAL = 2  # cached frames in front of the features: the temporal kernel has 3 taps

__all__ = ["CAUSAL", "GC", "pack_weight"]


def pack_weight(weight: Tensor, gc: int = GC) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> [gc, C_in, 3, 1, 1] with row (i*3+j)*C_out + c = W[c, :, :, i, j]; pad rows 0."""
    c_out, c_in = weight.shape[:2]
    wp = weight.permute(3, 4, 0, 1, 2).reshape(9 * c_out, c_in, 3)
    wp = F.pad(wp, (0, 0, 0, 0, 0, gc - 9 * c_out))
    return wp.reshape(gc, c_in, 3, 1, 1)
