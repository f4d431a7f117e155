"""The fused head's g kernel in CUDA C++ for Hopper (csrc/head_g_sm90.cu, compiled with NVRTC for sm_90a): the Gluon
kernel's contract (head_wgmma.py: same inputs, g and new cache), with g's 112 columns in one m64n112k16 wgmma per tap
and k-step, both operands in shared memory (the activated frame box is the transposed A operand as it lies; Gluon's
power-of-two shapes cut the columns 64 + 32 + 16, with the frame loaded into registers for each). head_fused runs it
where `reason` is None and falls back to the Gluon kernel, with one warning, if it cannot compile or launch.

Predicted before it ran (H200, the Wan chunk: B=1, C=256, T=4 + 2 cached, 352x640): 0.30-0.40 ms, HBM-bound (1125 MB
moved, 0.27 ms at the copy ceiling); tensor cores ~0.15 ms at peak, shared memory ~0.16 ms (each m64n112k16 reads 5.5 KB
of operands), the activation ~0.07 ms of issue per SM. Measured (BENCHMARKS.md, runs DD1-DD7, EE1-EE11, FF1-FF12,
GG1-GG9): 0.614 ms first, now 0.41 against the Gluon kernel's 0.66 (0.187 vs 0.222 at T=1), after three fixes that
Nsight Compute and the probe (scripts/head_cuda_probe.py) pointed at: the per-pixel sum of squares as one reduce-scatter
across the warp (it was 40% of the activation warps' stall samples), g stored as 8-byte pairs filling whole sectors, and
two rings instead of one (the weights fill 168 of the 227 KB of shared memory; the 7 slots left hold under two frames,
and with one ring a slot stayed taken from its load through the frame's norm, activation and MMAs). Now the activation
warps wait for the MMA warpgroup (run FF7), which stores g between frames with the tensor pipe drained (probe "no g
store": 0.29 of 0.42 ms, run FF12), and the raw ring's depth limits the loads (one raw slot fewer: +23%); chaining the
wgmmas (one warpgroup.arrive per tap instead of one per wgmma) changed nothing (run FF11). Not kept: a 2-CTA cluster
splitting the weights (0.62 ms: both CTAs activate every frame), g staged for TMA stores, g stored while the next
frame's MMAs run (a fourth accumulator: 0.49 ms; or between taps: 0.47 ms), the activation warps in two groups taking
alternate frames (0.51-0.56 ms, runs GG1-GG2), two MMA warpgroups of 56 columns each (0.60 ms, run GG4); g stored in the
accumulators' own layout (3-5% faster alone, run GG9; the stencil would need a reader for it).
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from .. import _backend
from .head_wgmma import frames_layout, tma_alignment_reason

SOURCE, KERNEL = "head_g_sm90.cu", "head_g_sm90"
G = 112  # g channels (head.GC)
BLOCK_P = 64  # pixels per tile
CHUNK = 64  # channels per ring slot
SMEM_LIMIT = 232448  # sm_90's opt-in shared memory per block
MAX_SLOTS = 12
ACT_SLOTS = 3  # of the slots, those holding activated chunks for the MMAs (2: 0.51 ms, 4: 0.49, 3: 0.41; run FF6)

_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: every later call takes the Gluon kernel, with one warning."""
    _failure.append(f"{type(error).__name__}: {error}")
    warnings.warn(f"taesd_fast: the CUDA head kernel is unavailable ({_failure[0]}); using the Gluon kernel",
                  RuntimeWarning, stacklevel=3)


def _slots(c: int) -> int:
    """Slots of both rings (8 KB each, and 3 barriers' room) that fit beside the resident weights (and 1 KB of
    alignment)."""
    free = SMEM_LIMIT - 1024 - 3 * (c // CHUNK) * G * 128 - 8
    return min(MAX_SLOTS, free // (CHUNK * BLOCK_P * 2 + 24))


def _smem(c: int) -> int:
    return 3 * (c // CHUNK) * G * 128 + _slots(c) * (CHUNK * BLOCK_P * 2 + 24) + 8 + 1024


def _arch(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def shape_reason(c: int, h: int, w: int, device: torch.device | str) -> str | None:
    """Why contiguous features of this shape cannot take the kernel, or None (any frame count T: it is an argument)."""
    device = torch.device(device)
    if device.type != "cuda" or _arch(device) != (9, 0):
        return "needs an sm_90 GPU (wgmma, setmaxnreg: compiled for sm_90a)"
    if c % CHUNK or c > 256:
        return f"C={c} (needs a multiple of {CHUNK} up to 256: the weights stay in shared memory)"
    if (h * w) % 8:
        return f"H*W={h * w} is not a multiple of 8 (TMA needs 16-byte strides)"
    if c * 2 * h * w >= 2**31:
        return f"one sample's new cache has C*2*H*W = {c * 2 * h * w} >= 2**31 elements (int32 offsets)"
    return None


def reason(features: Tensor, cache: Tensor | None) -> str | None:
    """Why these flat-pixel bf16 tensors cannot take the kernel, or None."""
    _, c, _, h, w = features.shape
    why = shape_reason(c, h, w, features.device)
    if why is None and _failure:
        why = _failure[0]
    if why is None:
        why = tma_alignment_reason(features, cache) or _backend.kernels_unavailable_reason(features.device)
    if why is None and features.is_cuda and torch.cuda.is_current_stream_capturing() and not spec_ready(
            features.device, c):
        why = "not compiled before this CUDA-graph capture"
    return why


def _defines(c: int) -> dict[str, int]:
    return {"CHUNKS": c // CHUNK, "SLOTS": _slots(c), "ACT_SLOTS": ACT_SLOTS}


def spec_ready(device, c: int) -> bool:
    """True once the kernel for C is compiled and loaded (launching it then compiles nothing; T and the cache are
    arguments)."""
    return _backend.is_loaded(SOURCE, KERNEL, _defines(c), device)


def _frames_map(x: Tensor, frames: int):
    """TMA descriptor over x's frames (head_wgmma.frames_layout, innermost first), boxes of 64 pixels x 64 channels
    of one frame."""
    shape, strides = frames_layout(x, frames)
    return _backend.tensor_map(x, shape[::-1], strides[-2::-1], [BLOCK_P, 1, CHUNK, 1])


def launch(features: Tensor, cache: Tensor | None, gs: Tensor, wt: Tensor, g: Tensor, new_cache: Tensor,
           eps: float, source: str = SOURCE) -> None:
    """As head_wgmma.launch: features [B, C, T, H, W] and cache [B, C, 2, H, W] bf16 with flat pixels; gs = scale *
    gamma fp32 [C]; wt = W^T [3, 112, C] bf16; g [B, T, H, W, 112] and new_cache [B, C, 2, H, W] contiguous outputs.
    The caller checks `reason` first; `source` names a variant of the kernel's source (the probe's)."""
    b, c, t, h, w = features.shape
    if cache is None and t == 1:
        new_cache[:, :, 0].zero_()  # the window's causal zero frame; the kernel skips zero frames
    x_map = _frames_map(features, t)
    c_map = _frames_map(cache, 2) if cache is not None else x_map
    w_map = _backend.tensor_map(wt.reshape(3 * G, c), [c, 3 * G], [c], [CHUNK, G])
    tiles = -(-(h * w) // BLOCK_P)
    nc_map = _frames_map(new_cache, 2)
    kernel = _backend.get_kernel(source, KERNEL, _defines(c), device=features.device)
    grid = min(b * tiles, _sm_count(features.device))
    args = [x_map, c_map, w_map, nc_map, gs, g, h * w, b * tiles, tiles, t, int(cache is not None), float(eps)]
    kernel((grid,), (kernel.max_threads,), args, smem=_smem(c))  # the source's __launch_bounds__ sets the block


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
