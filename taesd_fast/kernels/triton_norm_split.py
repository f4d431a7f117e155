"""Triton RMS norm + SiLU for the Wan head, written straight into the conv's causal window.

    window[:, :, :2] = cache (or zeros);  window[:, :, 2:] = bf16(silu(bf16(rms_norm_fp32(features))))

Row "triton_norm_split" (kind head_full): this kernel, then split_head_conv. The window is NCDHW and contiguous,
which is what split_head_conv's cuBLAS form reads in place, so the whole head is this kernel + conv_n128 +
head_stencil, where eager PyTorch spends most of the head's time on the norm, SiLU and cat (each a full pass).

One program: BLOCK_P pixels of one frame, all C channels in BK-channel chunks, read twice (sum of squares,
then activate); the second read mostly hits L2.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import split_bf16
from .head_full_common import offsets_reason, per_sample_offsets_fit, scaled_gamma
from .head_math import activate, causal_window
from .head_stencil import stencil_ready
from .triton_bf16 import INTERPRETED, bf16
from .triton_import import TRITON_ERROR, tl, triton

NAME = "triton_norm_split"

POISON = False  # tests set this: NaN-fill the window before the kernel, so an unwritten element shows

if triton is not None:

    @triton.jit
    def _rms_silu_kernel(x_ptr, gs_ptr, y_ptr, HW, sxb, sxc, sxt, syb, syc, syt, eps,
                         C: tl.constexpr, BK: tl.constexpr, BLOCK_P: tl.constexpr, INTERP: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        t = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        pm = p < HW
        ck = tl.arange(0, BK)
        x_fr = x_ptr + b * sxb + t * sxt + ck[:, None] * sxc + p[None, :]  # [BK, BLOCK_P], pixels contiguous
        y_fr = y_ptr + b * syb + t * syt + ck[:, None] * syc + p[None, :]
        ss = tl.zeros([BLOCK_P], dtype=tl.float32)
        for kc in range(0, C, BK):
            x = tl.load(x_fr + kc * sxc, mask=pm[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=0)
        inv = tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(ss), eps))  # F.normalize's 1 / max(||x||, eps)
        for kc in range(0, C, BK):
            x = tl.load(x_fr + kc * sxc, mask=pm[None, :], other=0.0).to(tl.float32)
            gs = tl.load(gs_ptr + kc + ck)  # sqrt(C) * gamma, fp32
            v = bf16(x * inv[None, :] * gs[:, None], INTERP).to(tl.float32)  # the norm's rounding
            tl.store(y_fr + kc * syc, bf16(v / (1.0 + tl.exp(-v)), INTERP), mask=pm[None, :])  # F.silu's


def unsupported_reason(x_shape, dtype, device_type: str) -> str | None:
    if TRITON_ERROR is not None:
        return TRITON_ERROR
    if device_type != "cuda":
        return "needs a CUDA tensor"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (expected torch.bfloat16)"
    c = x_shape[1]
    if len(x_shape) != 5 or c < 16 or c & (c - 1):
        return f"features {tuple(x_shape)}: expected [B, C, T, H, W] with C a power of two >= 16"
    if max(x_shape[0], x_shape[2]) > 65535:
        return "B or T > 65535"
    return offsets_reason(*x_shape[1:])


def activated_window(features: Tensor, cache: Tensor | None, gamma: Tensor, eps: float,
                     block_p: int = 128, bk: int = 64, num_warps: int = 4) -> Tensor:
    """[cache | silu(rms_norm(features))] as one contiguous NCDHW bf16 tensor [B, C, T+2, H, W].
    Default config: the best of a sweep on the H200 (about 2.9 TB/s at the Wan chunk size)."""
    b, c, t, h, w = features.shape
    if features.stride(4) != 1 or features.stride(3) != w:  # pixels of a frame must be one contiguous run
        features = features.contiguous()
    if not per_sample_offsets_fit(features) or offsets_reason(c, t, h, w):  # int32 offsets in the kernel
        return causal_window(activate(features, gamma, eps), cache).contiguous()
    window = features.new_empty((b, c, t + 2, h, w))
    if POISON:
        window.fill_(float("nan"))
    if cache is None:
        window[:, :, :2].zero_()  # the first chunk's causal zero padding
    else:
        window[:, :, :2].copy_(cache)
    gs = scaled_gamma(gamma, c**0.5)
    y = window[:, :, 2:]
    grid = (triton.cdiv(h * w, block_p), t, b)
    with torch.cuda.device(features.device) if features.is_cuda else contextlib.nullcontext():
        _rms_silu_kernel[grid](
            features, gs, y, h * w, features.stride(0), features.stride(1), features.stride(2),
            y.stride(0), y.stride(1), y.stride(2), eps,
            C=c, BK=min(bk, c), BLOCK_P=block_p, INTERP=INTERPRETED, num_warps=num_warps)
    return window


@torch.library.custom_op("taesd_fast::activated_window", mutates_args=())
def activated_window_op(features: Tensor, cache: Tensor | None, gamma: Tensor, eps: float) -> Tensor:
    """The op form (torch.compile, opcheck): the Triton kernel on CUDA (or under TRITON_INTERPRET=1), else its
    PyTorch twin, head_math.causal_window(head_math.activate(...)), materialised contiguous."""
    if features.is_cuda or (triton is not None and INTERPRETED):
        return activated_window(features, cache, gamma, eps)
    return causal_window(activate(features, gamma, eps), cache).contiguous()


@activated_window_op.register_fake
def _(features, cache, gamma, eps):
    b, c, t, h, w = features.shape
    return features.new_empty((b, c, t + 2, h, w))


def head_full_norm_split(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
                         eps: float, patch: int = 0) -> tuple[Tensor, Tensor]:
    """dispatch.head_full's signature: this kernel's window, then split_head_conv (cuBLAS GEMM + our stencil)."""
    window = activated_window_op(x, cache, gamma, eps)
    return split_bf16.split_head_conv(window, weight, bias, patch=patch), window[:, :, -2:]


def spec_unsupported_reason(spec) -> str | None:
    """Row "triton_norm_split": this kernel's rule on the features, then split_head_conv's on the window."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    return (unsupported_reason(spec.x_shape, spec.dtype, spec.device.split(":")[0])
            or split_bf16.spec_unsupported_reason(spec))


def spec_ready(spec) -> bool:
    """True once the stencil for the window is loaded. The Triton activation kernel is not tracked: a size it never
    ran with may still compile on first launch (the dispatcher times every shape, so runs it, before a capture)."""
    return stencil_ready(spec)


run = head_full_norm_split
