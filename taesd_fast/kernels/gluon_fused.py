"""Row "gluon_fused" (kind head_full): the fused head (head_full_common.py) with its g kernel for Hopper in Gluon (TMA,
asynchronous wgmma, warp specialisation, weights resident in shared memory; the device code is gluon_fused_kernel.py).

What: the same g and new cache as triton_fused's Triton kernels (RMS norm + SiLU of the raw features, then the causal
temporal GEMM into the 112 spatial-tap channels of g; head_stencil does the rest), for sm_90.

Why: the Triton "roll" kernel reloads its 3 x 64 KB of weights from L2 for every 32-pixel tile, and its three fp32
accumulators keep occupancy low: 1.57 ms for the Wan chunk, against 0.163 ms to read it.

How: a persistent grid, one program per SM. The weights W^T [3 taps, 112, C] bf16 (168 KB at C = 256) are loaded
once per program and stay in shared memory, in column pieces of 64 + 32 + 16 rows (tensor shapes are powers of two).
A program walks its 64-pixel tiles; for each tile the window frames (the 2 cached ones, then the T feature frames)
stream through a ring of NSLOT 8 KB slots (7 fit beside the weights), each as C/64 TMA boxes [64 channels,
64 pixels]. Four partitions, synchronised by mbarriers per slot (ready -> act -> free, freed by both MMA warpgroups):
  * loader (1 warp): TMA loads into freed slots;
  * activator (8 warps): per feature frame, each pixel's sum of squares over the C/64 resident chunks, then RMS
    norm + SiLU chunk by chunk, written back in place (the reference's two bf16 roundings); cached frames pass;
  * MMA, two warpgroups: the default partition for g's columns 0-95 (pieces of 64 + 32) and a worker for columns
    96-111. Each loads every chunk into registers (the wgmma A operand); window frame s feeds output frames s-2,
    s-1 and s (taps 2, 1, 0) in three fp32 accumulators; output s-2 is complete after frame s and leaves as bf16 g;
    frames T, T+1 also leave through TMA stores as the new cache (the wide warpgroup). The frames are unrolled (T is
    a compile-time constant, up to MAX_T), so the accumulators rotate by renaming: register copies of an
    accumulator made ptxas serialise every wgmma. One warpgroup holding all 112 columns (168 accumulator
    registers) spilled 504 bytes; split, the kernel spills 184 (T = 4), no wgmma is serialised, and the narrow
    pieces run beside the wide ones.

What limits it: the loader alone streams the chunk in about half the kernel's time; the activation and the MMAs
each add to that, and the 32- and 16-column pieces cost about as much as 64-column ones (a narrow wgmma costs about
as much as a wide one). A single 128-column piece would need 24 KB more of weights, leaving 4 slots: one frame, no
prefetch.

Covers C a multiple of 64 up to 256, C_out <= 12 (g's 112 columns), 1 <= T <= MAX_T, H*W a multiple of 8 and
16-byte aligned strides (TMA), sm_90 with Gluon: row "gluon_fused" (spec_unsupported_reason, run, spec_ready). Tensors
whose frames are not 16-byte aligned are copied to contiguous ones first.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .device import is_sm90, sm_count
from .gluon_fused_kernel import MAXNREG, head_g_kernel
from .gluon_import import GLUON_ERROR as _GLUON_ERROR
from .gluon_import import TensorDescriptor, gl
from .head_full_common import contract_spec_reason, hopper_operands, packed_taps, row_run
from .head_g_layout import GC as G  # g channels: 9 spatial taps x 12 outputs, padded
from .head_stencil import stencil_ready
from .tma_pdl import frames_layout, frames_tma_reason

NAME = "gluon_fused"
BLOCK_P = 64  # pixels per tile: one wgmma M
CHUNK = 64  # channels per TMA box (128-byte rows)
MAX_T = 16  # frames are unrolled at compile time
SMEM_BYTES = 232448  # sm_90's opt-in shared memory per block (227 KB)


def _slots(c: int) -> int:
    """Ring slots that fit beside the resident weights (and the barriers)."""
    return min((SMEM_BYTES - 3 * G * c * 2 - 1024) // (CHUNK * BLOCK_P * 2), 4 * (c // CHUNK))


def shape_reason(c: int, t: int, h: int, w: int, device: torch.device | str) -> str | None:
    """Why contiguous features of this shape cannot take the kernel, or None."""
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    device = torch.device(device)
    if not is_sm90(device):
        return "needs an sm_90 GPU (wgmma)"
    if c % CHUNK or c > 256:
        return f"C={c} (needs a multiple of {CHUNK} up to 256: the weights stay in shared memory)"
    if t > MAX_T:
        return f"T={t} > {MAX_T} (frames are unrolled at compile time)"
    if (h * w) % 8:
        return f"H*W={h * w} is not a multiple of 8 (TMA needs 16-byte strides)"
    return None


def unsupported_reason(features: Tensor, cache: Tensor | None) -> str | None:
    """Why these (flat-pixel) tensors cannot take the kernel as they are, or None. Shapes as head_full_common checks
    them."""
    _, c, t, h, w = features.shape
    reason = shape_reason(c, t, h, w, features.device)
    return reason if reason is not None else frames_tma_reason(features, cache)


def _desc(t: Tensor, frames: int, layout) -> "TensorDescriptor":
    """TMA descriptor over t's frames (frames_layout), boxes [1, 64, 1, 64]."""
    return TensorDescriptor(t, *frames_layout(t, frames), [1, CHUNK, 1, BLOCK_P], layout)


_compiled: set = set()  # specialisations launched so far (see spec_ready)


def _key(device, c: int, t: int, has_cache: bool, ints: tuple) -> tuple:
    # Gluon, like Triton, compiles one binary per constexpr set and per int argument that is 1 or a multiple of 16.
    return (str(torch.device(device)), c, t, has_cache, tuple((v == 1, v % 16 == 0) for v in ints))


def _ints(b: int, h: int, w: int) -> tuple:
    tiles = -(-(h * w) // BLOCK_P)
    return (h * w, b * tiles, tiles)


def launch(features: Tensor, cache: Tensor | None, gs: Tensor, wt: Tensor, g: Tensor, new_cache: Tensor,
           eps: float) -> None:
    """features [B, C, T, H, W] and cache [B, C, 2, H, W] bf16 with flat pixels; gs = scale * gamma fp32 [C];
    wt = W^T [3, 112, C] bf16 (pack_weight_taps transposed); g [B, T, H, W, 112] and new_cache [B, C, 2, H, W]
    contiguous outputs. The caller checks `unsupported_reason` first."""
    b, c, t, h, w = features.shape
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    x_desc = _desc(features, t, layout)
    c_desc = _desc(cache, 2, layout) if cache is not None else x_desc
    nc_desc = _desc(new_cache, 2, layout)
    w_descs = [TensorDescriptor.from_tensor(wt.reshape(3 * G, c), [n, CHUNK],
                                            gl.NVMMASharedLayout.get_default_for([n, CHUNK], gl.bfloat16))
               for n in (64, 32, 16)]
    ints = _ints(b, h, w)
    grid = min(ints[1], sm_count(features.device))
    head_g_kernel[(grid,)](x_desc, c_desc, nc_desc, *w_descs, gs, g, new_cache, *ints, float(eps),
                            T=t, C=c, HAS_CACHE=cache is not None, NSLOT=_slots(c), num_warps=4, maxnreg=MAXNREG)
    _compiled.add(_key(features.device, c, t, cache is not None, ints))


def spec_ready(spec) -> bool:
    """True once this shape's kernel and the stencil are loaded: a launch then compiles nothing (safe inside a
    CUDA-graph capture)."""
    b, c, t, h, w = spec.x_shape
    return stencil_ready(spec) and _key(spec.device, c, t, bool(spec.residual), _ints(b, h, w)) in _compiled


def spec_unsupported_reason(spec) -> str | None:
    """The fused head's contract (head_full_common), then this kernel's shape rule."""
    reason = contract_spec_reason(spec)
    if reason is None:
        b, c, t, h, w = spec.x_shape
        reason = shape_reason(c, t, h, w, spec.device)
    return reason


def launch_g(features: Tensor, cache: Tensor | None, gs: Tensor, weight: Tensor, g: Tensor, new_cache: Tensor,
             eps: float) -> None:
    """The row's g kernel for head_full_common.fused_head_with."""
    _, c, t, h, w = features.shape
    features, cache = hopper_operands(NAME, shape_reason(c, t, h, w, features.device), features, cache)
    launch(features, cache, gs, packed_taps(weight, transposed=True), g, new_cache, eps)


run = row_run(NAME)
