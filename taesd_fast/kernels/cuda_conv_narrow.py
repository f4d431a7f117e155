"""The narrow-output conv in CUDA C++ (row "cuda_conv_narrow"; csrc/conv_narrow_sm90.cu, compiled with NVRTC for
sm_90a): TAEHV's last decoder conv, 3x3 from 64 channels to 3 p^2 (3 or 12), as a tensor-core projection of each
input row onto the 27 p^2 (tap, channel) pairs followed by a 9-tap sum, the input read once. `frames_launch` writes
the video frames straight from it (bias, f16 rounding, clamp, pixel shuffle by p, optionally uint8), as
kernels/triton_frames.py does from the conv's output, so that output is never stored (models/taehv/layers.py
narrow_frames takes it where the dispatcher decided this row for the last conv).

Covers 64 -> 3 or 12 channels, stride 1, no upsample, residual, ReLU or pre_clamp, sm_90 with NVRTC. x must start
16-byte aligned (TMA): a view that does not is copied first. A compile or launch failure is remembered: a warning
once, the call raises, and from then on the row's rule names the failure (so the dispatcher skips it).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .. import _backend
from .conv_contract import check_conv_args
from .conv_launch import contiguous_bias, conv_row_run, launch_checked, mark_launched, on_device, sm90_spec_reason
from .conv_pack import packed_weight
from .derived import derived
from .device import sm_count
from .tma import nhwc_map, tensor_map
from .tma_pdl import aligned_nhwc, pdl_args

NAME = "cuda_conv_narrow"
SOURCE, KERNEL = "conv_narrow_sm90.cu", "conv_narrow_sm90"
C_IN = 64
PATCHES = {3: 1, 12: 2}  # output channels -> pixel-shuffle factor p (3 p^2 channels; p consumer warpgroups)
STRIP = 128  # output columns a strip; its input box is 136 columns (two halo columns, rounded up to 8)
CONFIGS = {1: (3, 2), 2: (2, 2)}  # p -> (input rows in flight, programs an SM holds)


def smem(patch: int) -> int:
    """conv_narrow_sm90.cu's shared memory: W' (p blocks of 64 rows x 64 channels), the stages' input rows of 136
    pixels, the f32 projections (27 p^2 rows of 136), the barriers, and 1024-byte alignment slack."""
    stages = CONFIGS[patch][0]
    return patch * 64 * 128 + stages * 136 * 128 + 27 * patch * patch * 136 * 4 + 8 * (2 * stages + 1) + 1024


def _defines(patch: int) -> dict:
    stages, blocks = CONFIGS[patch]
    return {"PATCH": patch, "STAGES": stages, "MIN_BLOCKS": blocks}


_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: one warning; the row's rule names the failure from then on."""
    _backend.give_up(_failure, "CUDA narrow-output conv kernel", error)


def shape_reason(c_in: int, c_out: int, stride: int, upsample: int, pre_clamp: bool, residual: bool,
                 relu: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if c_in != C_IN or c_out not in PATCHES:
        return f"{c_in}->{c_out} channels (the CUDA narrow-output conv does {C_IN}->3 or {C_IN}->12)"
    if stride != 1 or upsample != 1 or pre_clamp or residual or relu:
        return "stride 2, an upsample, pre_clamp, a residual or ReLU (the CUDA narrow-output conv does conv + bias)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90, the conv contract, shape_reason, and no earlier compile failure (NVRTC
    itself is checked by the dispatcher for rows marked nvrtc)."""
    return (sm90_spec_reason(spec, _failure[0] if _failure else None)
            or shape_reason(spec.w_shape[1], spec.w_shape[0], spec.stride, spec.upsample, spec.pre_clamp,
                            spec.residual, spec.relu))


def _loaded(device, patch: int) -> bool:
    return _backend.is_loaded(SOURCE, KERNEL, _defines(patch), device=device)


def spec_ready(spec) -> bool:
    """True once the kernel for this spec's channel count is loaded on this device."""
    return _loaded(spec.device, PATCHES.get(spec.w_shape[0], 1))


def pack(w: Tensor) -> Tensor:
    """w [C_out, 64, 3, 3] -> f16 W' [p * 64, 64] (K-major): row (3 r + s) * C_out + o is tap (r, s) of output
    channel o; the rows past 9 C_out are zero (the M blocks' padding)."""
    c_out = w.shape[0]
    rows = w.detach().permute(2, 3, 0, 1).reshape(9 * c_out, C_IN)  # [(r, s, o), c_in]
    out = torch.zeros(PATCHES[c_out] * 64, C_IN, dtype=torch.float16, device=w.device)
    out[:9 * c_out] = rows.to(torch.float16)
    return out


def launch(x: Tensor, wp: Tensor, b: Tensor | None, pdl: bool, out: Tensor | None = None,
           frames: Tensor | None = None, k_in: int = 0, skip: int = 0) -> None:
    """x [B, 64, H, W] channels_last f16, 16-byte aligned; wp: pack(w). Either out [B, C_out, H, W] channels_last
    f16, or frames [samples, k_out, 3, H p, W p] (f16 or uint8, its last three dims dense) for input frames
    sample * k_in + skip + t, t < k_out."""
    B, _, H, W = x.shape
    patch = wp.shape[0] // 64
    x_map = nhwc_map(x, [C_IN, STRIP + 8, 1, 1])
    w_map = tensor_map(wp, [C_IN, wp.shape[0]], [C_IN], [C_IN, wp.shape[0]])
    strips = -(-W // STRIP)
    if frames is None:
        work, strides, k = B, (0, 0), (B, B, 0, 0)
    else:
        work = frames.shape[0] * frames.shape[1]
        strides = frames.stride()[:2]
        k = (k_in, frames.shape[1], skip, int(frames.dtype == torch.uint8))
    total = work * strips * H
    programs = max(1, min(sm_count(x.device) * CONFIGS[patch][1], total))
    kernel = _backend.get_kernel(SOURCE, KERNEL, _defines(patch), device=x.device)
    kernel((programs,), (patch * 128 + 32,),
           [x_map, w_map, b, out, frames, ctypes.c_int64(strides[0]), ctypes.c_int64(strides[1]), *k, H, W, strips,
            total, int(pdl)], smem=smem(patch), pdl=pdl)


def _packed(w: Tensor) -> tuple[Tensor, list]:
    return packed_weight(w, 1, None, tag=NAME, build=lambda: pack(w))


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], stride, upsample, pre_clamp, residual is not None, relu)

    def kernel(call, wp, pdl):
        try:
            launch(call.x, wp, call.b, pdl["PDL"], out=call.out)
        except RuntimeError as e:  # NVRTC or the driver refused it; nothing was launched
            give_up(e)
            raise

    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse, lambda: _packed(w),
                          kernel)


def frames_reason(x: Tensor, w: Tensor, into: Tensor, skip: int) -> str | None:
    """Why frames_launch cannot write conv(x, w)'s frames into `into`, or None."""
    reason = shape_reason(x.shape[1], w.shape[0], 1, 1, False, False, False)
    if reason is not None:
        return reason
    patch = PATCHES[w.shape[0]]
    nk, _, h, wd = x.shape
    n, k_out = into.shape[:2]
    if into.dim() != 5 or nk % n or nk // n - skip != k_out or tuple(into.shape[2:]) != (3, h * patch, wd * patch):
        return (f"frames {tuple(into.shape)} do not hold input {tuple(x.shape)} in {n} samples after skipping {skip} "
                f"frames each (expected [N, k - skip, 3, H*{patch}, W*{patch}])")
    if into.dtype not in (torch.uint8, x.dtype):
        return f"frames dtype {into.dtype} (expected uint8 or the input's {x.dtype})"
    if into.stride()[2:] != (h * patch * wd * patch, wd * patch, 1):
        return "frames whose last three dims are not dense"
    return None


def frames_launch(x: Tensor, w: Tensor, b: Tensor | None, into: Tensor, skip: int = 0) -> Tensor:
    """clamp(pixel_shuffle(conv2d(x, w, b, padding=1), p), 0, 1) of x [N*k, 64, H, W] (k frames per sample,
    time-major) without each sample's first `skip` frames, written into `into` [N, k - skip, 3, H p, W p] (f16 or
    uint8: round(255 v)), the conv's f16 output never stored. The values equal the plain row's output passed through
    kernels/triton_frames.py bit for bit. Returns `into`; ValueError where the kernel cannot take the call."""
    check_conv_args(NAME, x, w, b, None, 1, 1)
    reason = frames_reason(x, w, into, skip)
    if reason is not None:
        raise ValueError(f"{NAME}: {reason}")
    if into.numel() == 0:
        return into
    x = aligned_nhwc(x)
    b, copied = contiguous_bias(b)
    wp, packed_now = _packed(w)
    with on_device(x):
        try:
            launch(x, wp, b, pdl_args(x, packed_now + copied)["PDL"], frames=into, k_in=x.shape[0] // into.shape[0],
                   skip=skip)
        except RuntimeError as e:
            give_up(e)
            raise
    mark_launched(NAME, x, w, 1, 1, False, b is not None, False, False, ("frames",))
    return into


def frames_ready(x: Tensor, w: Tensor) -> bool:
    """Whether frames_launch on these operands would neither load the kernel nor pack its weight, so that it may
    run inside a CUDA-graph capture (a capture may not load a module, and a weight packed there would live in the
    graph's memory pool while the cache keeps it)."""
    return _loaded(x.device, PATCHES.get(w.shape[0], 1)) and derived.has(w, (NAME, 1, None))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
