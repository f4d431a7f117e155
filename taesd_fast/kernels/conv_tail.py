"""A 64->64 conv (bias, residual, ReLU) and the small 3x3 conv after it (64 -> c2 <= 7, bias, no ReLU) in two
kernels instead of two convs: the TAESD decoder's last Block and its 64->3 output conv.

Why: at 256^2 B=1 the 64->3 conv is ~10 us of a ~160 us decode (BENCHMARKS.md, run X1's timeline): a row-streaming
kernel of 4 rows per program whose N=16 wgmmas and three shifted input boxes per row move 8 MB of activations
through shared memory for 3 output channels.

How: the row-streaming kernel (conv_halo, TAIL_N > 0) computes the Block's output row as usual and, instead of
storing it, multiplies it (f16, the value the next conv would read) by the next conv's weights arranged
[c_in, tap * c2 + c]: one [64 px, 64] x [64, 32] wgmma per row gives every tap's contribution of every pixel (fp32,
P: [B, H, W, 32], the same bytes as the f16 activation it replaces). The taps' shifted sum needs neighbouring
rows and strips that other programs own, so a second, small kernel (_tail_sum_kernel) adds them:
y[b, y, x, c] = bias[c] + sum over (dy, dx) of P[b, y + dy - 1, x + dx - 1, (3 dy + dx) c2 + c] (zero outside the
image: the conv's padding). Numerics: the 64-channel dot products are fp32 (wgmma), the 9-tap sum fp32, one f16
rounding at the end, as in the unfused conv.

Predicted (written before it ran; H200, 256^2 B=1): the 64->3 kernel's ~10 us replaced by a ~1-2 us sum kernel,
plus ~0.5 us in the Block conv (one narrow wgmma per row): decode ~7 us faster. B=64: the same bytes as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import conv_halo
from ._gluon import GLUON_ERROR
from .conv_tc import (_TRITON_ERROR, _as_nhwc, _capability, _interpreting, _plan, check_conv3x3_tc, conv3x3_tc_ref,
                      pack_weight, pdl_args, triton_unavailable_reason)
from .derived import derived

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # conv_tc records why (_TRITON_ERROR)
    triton = tl = None

__all__ = ["conv3x3_tail", "tail_ref", "unsupported_reason", "pack_tail", "tail_sum", "launch"]

MAX_TAIL_CHANNELS = 3  # 9 * c2 columns of P, padded to TAIL_N = 32 (the f16 row's 128 bytes per pixel)
TAIL_N = 32


def check_tail(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, w2: Tensor, b2: Tensor | None) -> tuple:
    """Output shape of the pair, or ValueError naming what is wrong."""
    check_conv3x3_tc(x, w, b, residual, 1, 1)
    B, _, H, W = x.shape
    if w2.dim() != 4 or tuple(w2.shape[1:]) != (w.shape[0], 3, 3):
        raise ValueError(f"conv3x3_tail: the second weight must be [C2, {w.shape[0]}, 3, 3], got {tuple(w2.shape)}")
    if w2.dtype != x.dtype or w2.device != x.device:
        raise ValueError(f"conv3x3_tail: the second weight must be {x.dtype} on {x.device}, got {w2.dtype} on "
                         f"{w2.device}")
    if b2 is not None and (tuple(b2.shape) != (w2.shape[0],) or b2.dtype != x.dtype or b2.device != x.device):
        raise ValueError(f"conv3x3_tail: the second bias must be {x.dtype} [{w2.shape[0]}] on {x.device}, got "
                         f"{b2.dtype} {tuple(b2.shape)} on {b2.device}")
    return (B, w2.shape[0], H, W)


def tail_ref(x, w, b, residual, relu, w2, b2, dtype=None) -> Tensor:
    """The pair as two convs (conv_tc's PyTorch twin): what the fused kernels must match."""
    h = conv3x3_tc_ref(x, w, b, residual, 1, relu)
    return conv3x3_tc_ref(h, w2, b2, None, 1, False)  # channels_last, like the kernels' output


def unsupported_reason(x_shape, w_shape, w2_shape, dtype, device: str, residual: bool) -> str | None:
    """Why the fused pair cannot run (dispatch then runs the two convs), or None."""
    if not device.startswith("cuda"):
        return "CPU tensor"
    if dtype != torch.float16:
        return f"{dtype} (the fused pair is f16)"
    if tuple(w_shape) != (64, 64, 3, 3):
        return f"first conv {tuple(w_shape)} (the fused pair takes a 64->64 3x3 conv first)"
    if len(w2_shape) != 4 or w2_shape[1] != 64 or tuple(w2_shape[2:]) != (3, 3) or w2_shape[0] > MAX_TAIL_CHANNELS:
        return f"second conv {tuple(w2_shape)} (64 -> at most {MAX_TAIL_CHANNELS} channels, 3x3)"
    if x_shape[3] < 64:
        return f"W={x_shape[3]} (< 64: the row-streaming kernel's strips)"
    reason = triton_unavailable_reason(device) or GLUON_ERROR
    if reason is None and _capability(torch.device(device)) != 9:
        reason = "needs an sm_90 GPU (wgmma)"
    return reason


def pack_tail(w2: Tensor) -> Tensor:
    """[c2, 64, 3, 3] -> f16 [64, TAIL_N]: row c_in, column tap * c2 + c (tap = 3 dy + dx), zero padded."""
    c2 = w2.shape[0]
    t = w2.float().permute(1, 2, 3, 0).reshape(64, 9 * c2)  # [c_in, (dy, dx, c)]
    return torch.nn.functional.pad(t, (0, TAIL_N - 9 * c2)).to(torch.float16).contiguous()


if triton is not None:

    @triton.jit
    def _tail_sum_kernel(p_ptr, b_ptr, y_ptr, H, W, n_px, C2: tl.constexpr, TAIL: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # P is the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        px = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = px < n_px
        xx = px % W
        yy = (px // W) % H
        n = tl.arange(0, TAIL)
        acc = tl.zeros([BLOCK, TAIL], tl.float32)
        for tap in tl.static_range(9):
            sy = yy + tap // 3 - 1
            sx = xx + tap % 3 - 1
            inside = ok & (sy >= 0) & (sy < H) & (sx >= 0) & (sx < W)
            src = (px + (tap // 3 - 1) * W + (tap % 3 - 1)).to(tl.int64) * TAIL  # the neighbour's row of P
            mine = (n >= tap * C2) & (n < tap * C2 + C2)  # this tap's columns
            acc += tl.load(p_ptr + src[:, None] + n[None, :], mask=inside[:, None] & mine[None, :], other=0.0)
        for c in tl.static_range(C2):
            out = tl.sum(tl.where(((n % C2 == c) & (n < 9 * C2))[None, :], acc, 0.0), axis=1)
            if HAS_BIAS:
                out += tl.load(b_ptr + c).to(tl.float32)
            tl.store(y_ptr + px.to(tl.int64) * C2 + c, out.to(tl.float16), mask=ok)


def tail_sum(p: Tensor, b2: Tensor | None, out: Tensor, pdl: dict | None = None) -> None:
    """out (channels_last f16 [B, c2, H, W]) = bias + the shifted sum of P (fp32 [B, H, W, TAIL_N])."""
    B, c2, H, W = out.shape
    n_px = B * H * W
    block = 128
    _tail_sum_kernel[(-(-n_px // block),)](p, b2 if b2 is not None else p, out, H, W, n_px, C2=c2, TAIL=TAIL_N,
                                           HAS_BIAS=b2 is not None, BLOCK=block, num_warps=4,
                                           **(pdl or {"PDL": False}))


def launch(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, relu: bool, w2: Tensor,
           b2: Tensor | None) -> Tensor:
    """Both kernels; returns channels_last f16 [B, c2, H, W]."""
    out_shape = check_tail(x, w, b, residual, w2, b2)
    x = _as_nhwc(x)
    residual = None if residual is None else _as_nhwc(residual)
    plan = _plan(64, 64, 1, 0)
    wp = derived.get(w, ("conv_tc", 1, plan), lambda: pack_weight(w.detach(), 1, plan))
    tp = derived.get(w2, ("conv_tail",), lambda: pack_tail(w2.detach()))
    B, _, H, W = x.shape
    p = torch.empty(B, H, W, TAIL_N, device=x.device, dtype=torch.float32)
    out = torch.empty(out_shape, device=x.device, dtype=torch.float16, memory_format=torch.channels_last)
    from . import conv_tc

    if conv_tc.POISON_OUTPUT:  # tests: an element either kernel leaves unwritten shows as NaN
        p.fill_(float("nan"))
        out.fill_(float("nan"))
    conv_halo.launch(x, wp, b if b is None else b.contiguous(), residual, p, relu, pdl=pdl_args(x), tail=tp)
    tail_sum(p, None if b2 is None else b2.contiguous(), out, pdl_args(x))
    _launched.add(_ready_key(x.device, w2.shape[0], b is not None, residual is not None, relu, b2 is not None))
    return out


_launched: set = set()  # what ran in this process: those launches compile nothing inside a CUDA-graph capture


def _ready_key(device, c2: int, bias: bool, residual: bool, relu: bool, bias2: bool) -> tuple:
    return (str(torch.device(device)), int(c2), bool(bias), bool(residual), bool(relu), bool(bias2))


def spec_ready(spec) -> bool:
    return _ready_key(spec.device, spec.tail_shape[0], spec.bias, spec.residual, spec.relu, spec.tail_bias) in _launched


# --------------------------------------------------------------------------- the op


@torch.library.custom_op("taesd_fast::conv3x3_tail", mutates_args=())
def conv3x3_tail(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, relu: bool, w2: Tensor,
                 b2: Tensor | None) -> Tensor:
    """conv2d(relu?(conv2d(x, w, b) + residual), w2, b2), both 3x3 'same'. CUDA: the two kernels; CPU: the twin."""
    check_tail(x, w, b, residual, w2, b2)
    if x.is_cuda and not _interpreting():
        if _TRITON_ERROR is not None:
            raise RuntimeError(f"conv3x3_tail: {_TRITON_ERROR}")
        return launch(x, w, b, residual, relu, w2, b2)
    return tail_ref(x, w, b, residual, relu, w2, b2)


@conv3x3_tail.register_fake
def _(x, w, b, residual, relu, w2, b2):
    shape = check_tail(x, w, b, residual, w2, b2)
    return torch.empty(shape, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)


def run(x, w, b, stride, residual, relu, w2, b2) -> Tensor:
    """dispatch's conv2d_tail candidate signature. Eager calls launch directly (the op layer is for torch.compile)."""
    if torch.compiler.is_compiling() or not x.is_cuda:
        return torch.ops.taesd_fast.conv3x3_tail(x, w, b, residual, relu, w2, b2)
    return launch(x, w, b, residual, relu, w2, b2)
