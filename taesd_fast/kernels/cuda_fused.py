"""Row "cuda_fused" (kind head_full): the fused head (head_full_common.py) with its g kernel in CUDA C++ for Hopper
(csrc/head_g_sm90.cu, compiled with NVRTC for sm_90a): the Gluon kernel's contract (gluon_fused.py: same inputs, g
and new cache), with g's 112 columns in one m64n112k16 wgmma per tap and k-step, both operands in shared memory (the
activated frame box is the transposed A operand as it lies; Gluon's power-of-two shapes cut the columns 64 + 32 + 16,
with the frame loaded into registers for each).

Design points: the per-pixel sum of squares is one reduce-scatter across the warp; g is stored as 8-byte pairs that
fill whole sectors; the frames stream through two rings (raw and activated), because the weights fill 168 of the
227 KB of shared memory and with one ring a slot stayed taken from its load through the frame's norm, activation
and MMAs. The MMA warpgroup stores g between frames with the tensor pipe drained.

Covers C a multiple of 64 up to 256, C_out <= 12, any T, H*W a multiple of 8 (TMA strides), sm_90 with NVRTC.
Tensors whose frames are not 16-byte aligned are copied to contiguous ones first. A compile or launch failure is
remembered: a warning once, the call raises, and from then on the row's rule names the failure.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .device import capability, sm_count
from .head_full_common import contract_spec_reason, hopper_operands, packed_taps, row_run
from .head_g_layout import GC as G
from .head_stencil import stencil_ready
from .tma import tensor_map
from .tma_pdl import frames_layout, frames_tma_reason

NAME = "cuda_fused"
SOURCE, KERNEL = "head_g_sm90.cu", "head_g_sm90"
BLOCK_P = 64  # pixels per tile
CHUNK = 64  # channels per ring slot
SMEM_LIMIT = 232448  # sm_90's opt-in shared memory per block
MAX_SLOTS = 12
ACT_SLOTS = 3  # of the slots, those holding activated chunks for the MMAs (3 measured best of 2-4)

_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: one warning; the row's rule names the failure from then on."""
    _backend.give_up(_failure, "CUDA head kernel", error)


def _slots(c: int) -> int:
    """Slots of both rings (8 KB each, and 3 barriers' room) that fit beside the resident weights (and 1 KB of
    alignment)."""
    free = SMEM_LIMIT - 1024 - 3 * (c // CHUNK) * G * 128 - 8
    return min(MAX_SLOTS, free // (CHUNK * BLOCK_P * 2 + 24))


def _smem(c: int) -> int:
    return 3 * (c // CHUNK) * G * 128 + _slots(c) * (CHUNK * BLOCK_P * 2 + 24) + 8 + 1024


def shape_reason(c: int, h: int, w: int, device: torch.device | str) -> str | None:
    """Why contiguous features of this shape cannot take the kernel, or None (any frame count T: it is an argument)."""
    device = torch.device(device)
    if device.type != "cuda" or capability(device) != (9, 0):
        return "needs an sm_90 GPU (wgmma, setmaxnreg: compiled for sm_90a)"
    if c % CHUNK or c > 256:
        return f"C={c} (needs a multiple of {CHUNK} up to 256: the weights stay in shared memory)"
    if (h * w) % 8:
        return f"H*W={h * w} is not a multiple of 8 (TMA needs 16-byte strides)"
    if c * 2 * h * w >= 2**31:
        return f"one sample's new cache has C*2*H*W = {c * 2 * h * w} >= 2**31 elements (int32 offsets)"
    return None


def _call_reason(c: int, h: int, w: int, device) -> str | None:
    """shape_reason, then an earlier compile or launch failure in this process."""
    return shape_reason(c, h, w, device) or (_failure[0] if _failure else None)


def unsupported_reason(features: Tensor, cache: Tensor | None) -> str | None:
    """Why these flat-pixel bf16 tensors cannot take the kernel as they are, or None."""
    _, c, _, h, w = features.shape
    return (_call_reason(c, h, w, features.device) or frames_tma_reason(features, cache)
            or _backend.kernels_unavailable_reason(features.device))


def _defines(c: int) -> dict[str, int]:
    return {"CHUNKS": c // CHUNK, "SLOTS": _slots(c), "ACT_SLOTS": ACT_SLOTS}


def spec_ready(spec) -> bool:
    """True once the kernel for C and the stencil are compiled and loaded (launching them then compiles nothing; T
    and the cache are arguments): safe inside a CUDA-graph capture."""
    return stencil_ready(spec) and _backend.is_loaded(SOURCE, KERNEL, _defines(spec.x_shape[1]), spec.device)


def spec_unsupported_reason(spec) -> str | None:
    """The fused head's contract (head_full_common), this kernel's shape rule, no earlier compile failure (NVRTC
    itself is checked by the dispatcher for rows marked nvrtc)."""
    reason = contract_spec_reason(spec)
    if reason is None:
        b, c, t, h, w = spec.x_shape
        reason = _call_reason(c, h, w, spec.device)
    return reason


def _frames_map(x: Tensor, frames: int):
    """TMA descriptor over x's frames (tma_pdl.frames_layout, innermost first), boxes of 64 pixels x 64 channels
    of one frame."""
    shape, strides = frames_layout(x, frames)
    return tensor_map(x, shape[::-1], strides[-2::-1], [BLOCK_P, 1, CHUNK, 1])


def launch(features: Tensor, cache: Tensor | None, gs: Tensor, wt: Tensor, g: Tensor, new_cache: Tensor,
           eps: float) -> None:
    """As gluon_fused.launch: features [B, C, T, H, W] and cache [B, C, 2, H, W] bf16 with flat pixels; gs = scale *
    gamma fp32 [C]; wt = W^T [3, 112, C] bf16; g [B, T, H, W, 112] and new_cache [B, C, 2, H, W] contiguous outputs.
    The caller checks `unsupported_reason` first."""
    b, c, t, h, w = features.shape
    if cache is None and t == 1:
        new_cache[:, :, 0].zero_()  # the window's causal zero frame; the kernel skips zero frames
    x_map = _frames_map(features, t)
    c_map = _frames_map(cache, 2) if cache is not None else x_map
    w_map = tensor_map(wt.reshape(3 * G, c), [c, 3 * G], [c], [CHUNK, G])
    tiles = -(-(h * w) // BLOCK_P)
    nc_map = _frames_map(new_cache, 2)
    kernel = _backend.get_kernel(SOURCE, KERNEL, _defines(c), device=features.device)
    grid = min(b * tiles, sm_count(features.device))
    args = [x_map, c_map, w_map, nc_map, gs, g, h * w, b * tiles, tiles, t, int(cache is not None), float(eps)]
    kernel((grid,), (kernel.max_threads,), args, smem=_smem(c))  # the source's __launch_bounds__ sets the block


def launch_g(features: Tensor, cache: Tensor | None, gs: Tensor, weight: Tensor, g: Tensor, new_cache: Tensor,
             eps: float) -> None:
    """The row's g kernel for head_full_common.fused_head_with. A compile or launch failure is remembered (give_up)
    and raised."""
    _, c, _, h, w = features.shape
    features, cache = hopper_operands(NAME, _call_reason(c, h, w, features.device), features, cache)
    try:
        launch(features, cache, gs, packed_taps(weight, transposed=True), g, new_cache, eps)
    except RuntimeError as err:  # NVRTC or the driver refused it: remembered (the row's rule says so from now on)
        give_up(err)
        raise


run = row_run(NAME)
