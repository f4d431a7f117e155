"""The upsample-fold conv in CUDA C++ (row "cuda_conv_up"; csrc/conv_up_sm90.cu, compiled with NVRTC for sm_90a):
conv3x3(nearest_up2(x)) + bias (+ ReLU) at 64 -> 64 channels, the upsample folded into the weights (conv_pack's
phases), each program keeping its class's weights in shared memory and walking tiles of 16 x 16 low-res pixels. It is
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
from .conv_contract import check_conv_args, grow_weight_reason, new_out, output_shape
from .conv_launch import contiguous_bias, conv_row_run, launch_checked, mark_launched, on_device, sm90_spec_reason
from .conv_pack import compose_grow, fold_upsample_weight, packed_weight
from .derived import derived
from .device import sm_count
from .tma import nhwc_map, tensor_map
from .tma_pdl import aligned_nhwc, pdl_args

NAME = "cuda_conv_up"
SOURCE, KERNEL = "conv_up_sm90.cu", "conv_up_sm90"
C = 64  # channels in and out
TILE = 16  # a program's tiles: TILE x TILE low-res pixels
# conv_up_sm90.cu's shared memory: the class's weights (4 taps of 64 x 64), 2 stages of two input boxes (17 x 16
# pixels), the staging box, 5 barriers, and 1024-byte alignment slack.
SMEM = 4 * C * 128 + 2 * 2 * (TILE + 1) * TILE * 128 + TILE * TILE * 128 + 8 * 5 + 1024

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


def _loaded(device) -> bool:
    """Whether the kernel is loaded on this device (one build serves every shape)."""
    return _backend.is_loaded(SOURCE, KERNEL, None, device=device)


def spec_ready(spec) -> bool:
    """True once the kernel is loaded on this device."""
    return _loaded(spec.device)


def pack_classes(groups: Tensor) -> Tensor:
    """Weight groups [G, 64, 64, 3, 3] (fp32 or float64) -> f16 [G * 4 * 4 * 64, 64], the kernel's resident weights:
    for group t and output phase (py, px), its four taps (r, s) (the low-res input at row offset py - 1 + r, column
    offset px - 1 + s), each [C_out][C_in] (K-major). The upsample fold's sums are conv_pack's (fp32), rounded to f16
    once."""
    rows = []
    for w in groups:
        phase = fold_upsample_weight(w)  # [py * 2 + px, C_out, C_in, r, s]
        rows += [phase[ph, :, :, r, s] for ph in range(4) for r in range(2) for s in range(2)]
    return torch.cat(rows).to(torch.float16).contiguous()


def launch(x: Tensor, wp: Tensor, groups: int, b: Tensor | None, out: Tensor, relu: bool, pdl: bool) -> None:
    """x [B, 64, H, W] channels_last f16, 16-byte aligned; wp: pack_classes of `groups` weights; out [B * groups,
    64, 2H, 2W] channels_last (frame i * groups + t from input frame i and group t)."""
    B, _, H, W = x.shape
    x_map = nhwc_map(x, [C, TILE, TILE + 1, 1])  # a tile's rows plus the phase's second tap row
    w_map = tensor_map(wp, [C, wp.shape[0]], [C], [C, 4 * C])
    # The output of column phase px (from element px * 64 on) as (c, low-res column, row phase, low-res row, frame):
    # a tile's 256 pixels of one phase are one box.
    flat = out.permute(0, 2, 3, 1).reshape(-1)  # a view: channels_last memory is [frame, H, W, C]
    dims, strides = [C, W, 2, H, B * groups], [2 * C, 2 * W * C, 4 * W * C, 4 * H * W * C]
    y_maps = [tensor_map(flat[px * C:], dims, strides, [C, TILE, 1, TILE // 2, 1]) for px in range(2)]
    tiles_w, tiles_h = -(-W // TILE), -(-H // TILE)
    tiles = B * tiles_h * tiles_w
    classes = 4 * groups
    programs = classes * max(1, min(sm_count(x.device) // classes, tiles))
    kernel = _backend.get_kernel(SOURCE, KERNEL, None, device=x.device)
    kernel((programs,), (160,), [x_map, w_map, *y_maps, b, groups, tiles_w, tiles_h, tiles, int(relu), int(pdl)],
           smem=SMEM, pdl=pdl)


def _groups(w: Tensor) -> Tensor:
    return w.detach().to(torch.promote_types(w.dtype, torch.float32)).unsqueeze(0)


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], stride, upsample, pre_clamp, residual is not None)

    def kernel(call, wp, pdl):
        try:
            launch(call.x, wp, 1, call.b, call.out, relu, pdl["PDL"])
        except RuntimeError as e:  # NVRTC or the driver refused it; nothing was launched
            give_up(e)
            raise

    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, 2, None, tag=NAME, build=lambda: pack_classes(_groups(w))), kernel)


def grow_launch(x: Tensor, grow_w: Tensor, w: Tensor, b: Tensor | None, grow: int, relu: bool) -> Tensor:
    """conv2d(up2(g(x)), w, b) (ReLU'd if relu), g being TAEHV's TGrow (a bias-free 1x1 conv to grow * 64 channels
    whose group t becomes frame t of each input frame's `grow`): output frame (i, t) is the upsample conv of x[i]
    with the composed weight w . g_t (conv_pack.compose_grow), so g's output is never written. Returns
    [B * grow, 64, 2H, 2W] channels_last, in TGrow's frame order. ValueError where the kernel cannot take it."""
    check_conv_args(NAME, x, w, b, None, 1, 2)
    B, c, H, W = x.shape
    refuse = shape_reason(c, w.shape[0], 1, 2, False, False) or grow_weight_reason(x, grow_w, grow)
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


def grow_ready(x: Tensor, grow_w: Tensor, w: Tensor, grow: int) -> bool:
    """Whether grow_launch on these operands would neither load the kernel nor pack its weight (packing copies from
    the host), so that it may run inside a CUDA-graph capture."""
    return _loaded(x.device) and derived.has(w, (NAME, "grow", grow), also=(grow_w,))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
