"""The upsample-fold conv in CUDA C++ (row "cuda_conv_up"; csrc/conv_up_sm90.cu, compiled with NVRTC for sm_90a):
conv3x3(nearest_up2(x)) + bias (+ ReLU) at 64 -> 64 channels, the upsample folded into the weights (conv_pack's
phases), each program keeping its class's weights in shared memory and walking tiles of 8 x 8 low-res pixels. It is
built for TAEHV's full-resolution up conv, the largest single conv of a decode step; `grow_launch` folds the TGrow
before it in as well (models/taehv/layers.py grow_conv), so TGrow's output is never written.

Covers 64 -> 64 channels, upsample 2, stride 1, no residual or pre_clamp, sm_90 with NVRTC. x must start 16-byte
aligned (TMA): a view that does not is copied first. A compile or launch failure is remembered: a warning once, the
call raises, and from then on the row's rule names the failure (so the dispatcher skips it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .conv_contract import check_conv_args, new_out, output_shape
from .conv_launch import contiguous_bias, conv_row_run, launch_checked, mark_launched, on_device, sm90_spec_reason
from .conv_pack import compose_grow, fold_upsample_weight
from .derived import derived
from .device import sm_count
from .tma import nhwc_map, tensor_map
from .tma_pdl import aligned_nhwc, pdl_args

NAME = "cuda_conv_up"
SOURCE, KERNEL = "conv_up_sm90.cu", "conv_up_sm90"
C = 64  # channels in and out
W_ROWS = 256  # weight rows per low-res row of a class: offset 0 (both column phases), offset -1, offset +1
# conv_up_sm90.cu's shared memory: weights, 4 stages of three input boxes, two staging boxes, 9 barriers, the bias,
# and 1024-byte alignment slack.
SMEM = 2 * W_ROWS * 128 + 4 * 3 * 9216 + 2 * 16384 + 8 * 9 + 4 * C + 1024

_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: one warning; the row's rule names the failure from then on."""
    _backend.give_up(_failure, "CUDA upsample conv kernel", error)


def shape_reason(c_in: int, c_out: int, stride: int, upsample: int, pre_clamp: bool, residual: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if (c_in, c_out) != (C, C):
        return f"{c_in}->{c_out} channels (the CUDA upsample conv does {C}->{C})"
    if upsample != 2 or stride != 1 or pre_clamp or residual:
        return "no upsample fold, stride 2, pre_clamp or a residual (the CUDA upsample conv does up 2 + conv + bias)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90, the conv contract, shape_reason, and no earlier compile failure (NVRTC
    itself is checked by the dispatcher for rows marked nvrtc)."""
    return (sm90_spec_reason(spec, _failure[0] if _failure else None)
            or shape_reason(spec.w_shape[1], spec.w_shape[0], spec.stride, spec.upsample, spec.pre_clamp,
                            spec.residual))


def spec_ready(spec) -> bool:
    """True once the kernel is loaded on this device (one build serves every shape)."""
    return _backend.is_loaded(SOURCE, KERNEL, None, device=spec.device)


def pack_classes(groups: Tensor) -> Tensor:
    """Weight groups [G, 64, 64, 3, 3] (fp32 or float64) -> f16 [G * 2 * 2 * 256, 64], the kernel's resident
    weights: for group t, output row phase py and low-res row r (offset py - 1 + r), 256 rows [C_out][C_in] (K-major):
    column offset 0 for column phases 0 and 1 (rows px * 64 + c_out), then offset -1 (phase 0), then +1 (phase 1).
    The upsample fold's sums are conv_pack's (fp32), rounded to f16 once."""
    rows = []
    for w in groups:
        phase = fold_upsample_weight(w)  # [py * 2 + px, C_out, C_in, r, s]; tap s reads column j + px - 1 + s
        for py in range(2):
            p0, p1 = phase[2 * py], phase[2 * py + 1]
            for r in range(2):
                rows += [p0[:, :, r, 1], p1[:, :, r, 0], p0[:, :, r, 0], p1[:, :, r, 1]]
    return torch.cat(rows).to(torch.float16).contiguous()


def launch(x: Tensor, wp: Tensor, groups: int, b: Tensor | None, out: Tensor, relu: bool, pdl: bool) -> None:
    """x [B, 64, H, W] channels_last f16, 16-byte aligned; wp: pack_classes of `groups` weights; out [B * groups,
    64, 2H, 2W] channels_last (frame i * groups + t from input frame i and group t)."""
    B, _, H, W = x.shape
    x_map = nhwc_map(x, [C, 8, 9, 1])  # 9 rows x 8 columns: a tile's 8 rows plus the phase's second row
    w_map = tensor_map(wp, [C, wp.shape[0]], [C], [C, W_ROWS])
    # Output rows as (row phase, low-res row): a warpgroup's tile is 8 rows of one phase, 16 pixels wide.
    y_map = tensor_map(out, [C, 2 * W, 2, H, B * groups], [C, 2 * W * C, 4 * W * C, 4 * H * W * C], [C, 16, 1, 8, 1])
    tiles_w, tiles_h = -(-W // 8), -(-H // 8)
    tiles = B * tiles_h * tiles_w
    classes = 2 * groups
    programs = classes * max(1, min(sm_count(x.device) // classes, -(-tiles // 2)))
    kernel = _backend.get_kernel(SOURCE, KERNEL, None, device=x.device)
    kernel((programs,), (288,), [x_map, w_map, y_map, b, groups, tiles_w, tiles_h, tiles, int(relu), int(pdl)],
           smem=SMEM, pdl=pdl)


def _groups(w: Tensor) -> Tensor:
    return w.detach().to(torch.promote_types(w.dtype, torch.float32)).unsqueeze(0)


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], stride, upsample, pre_clamp, residual is not None)

    def packed():
        packed_now: list = []
        wp = derived.get(w, (NAME, 1), lambda: packed_now.append(NAME) or pack_classes(_groups(w)))
        return wp, packed_now

    def kernel(call, wp, pdl):
        try:
            launch(call.x, wp, 1, call.b, call.out, relu, pdl["PDL"])
        except RuntimeError as e:  # NVRTC or the driver refused it; nothing was launched
            give_up(e)
            raise

    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse, packed, kernel)


def grow_launch(x: Tensor, grow_w: Tensor, w: Tensor, b: Tensor | None, grow: int, relu: bool) -> Tensor:
    """conv2d(up2(g(x)), w, b) (ReLU'd if relu), g being TAEHV's TGrow (a bias-free 1x1 conv to grow * 64 channels
    whose group t becomes frame t of each input frame's `grow`): output frame (i, t) is the upsample conv of x[i]
    with the composed weight w . g_t (conv_pack.compose_grow), so g's output is never written. Returns
    [B * grow, 64, 2H, 2W] channels_last, in TGrow's frame order. ValueError where the kernel cannot take it."""
    check_conv_args(NAME, x, w, b, None, 1, 2)
    B, c, H, W = x.shape
    refuse = shape_reason(c, w.shape[0], 1, 2, False, False)
    if refuse is None and (tuple(grow_w.shape) != (grow * c, c, 1, 1) or grow_w.dtype != x.dtype
                           or grow_w.device != x.device):
        refuse = (f"grow_w must be a ({grow * c}, {c}, 1, 1) {x.dtype} tensor on {x.device} for grow={grow}, got "
                  f"{tuple(grow_w.shape)} {grow_w.dtype} on {grow_w.device}")
    if refuse is not None:
        raise ValueError(f"{NAME}: {refuse}")
    x = aligned_nhwc(x)
    b, copied = contiguous_bias(b)
    packed_now: list = []
    wp = derived.get(w, (NAME, "grow", grow),
                     lambda: packed_now.append(NAME) or pack_classes(compose_grow(w, grow_w)), also=(grow_w,))
    out = new_out(output_shape((B * grow, c, H, W), w.shape, 1, 2), x)
    with on_device(x):
        try:
            launch(x, wp, grow, b, out, relu, pdl_args(x, packed_now + copied)["PDL"])
        except RuntimeError as e:
            give_up(e)
            raise
    mark_launched(NAME, x, w, 1, 2, False, b is not None, False, relu, ("grow", grow))
    return out


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
