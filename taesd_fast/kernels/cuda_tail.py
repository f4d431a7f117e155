"""The TAEHV decoder's tail in one CUDA C++ kernel (csrc/tail_sm90.cu, compiled with NVRTC for sm_90a): TGrow, the
nearest 2x upsample, the 64 -> 64 conv with its bias and ReLU, the last conv 64 -> 3 with its bias, the clamp and
the uint8 (or f16) frames, from the last stage's memory-block output. The full-resolution 64-channel activation h
(84 MB for taew2_1's step at 320x512) stays in shared memory; the unfused path writes it from the upsample conv,
reads it back in the last conv, then passes the last conv's output through triton_frames.

The last conv runs as a projection (the h row times a [27, 64] weight, then tap sums), which takes 4.5x fewer MACs
than 64 -> 16 wgmmas over its 9 taps. Covers a 64-channel input, 3 output channels (patch 1), one or more output
frames per input frame (TGrow's groups, each with its own composed weight), sm_90 with NVRTC. x must be
channels_last f16 and 16-byte aligned (TMA). The kernel's own docstring (the .cu file's head) gives the schedule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _backend
from .conv_pack import compose_grow, fold_upsample_weight
from .derived import derived
from .device import sm_count
from .tma import nhwc_map, tensor_map

NAME = "cuda_tail"
SOURCE, KERNEL = "tail_sm90.cu", "tail_sm90"
C = 64  # channels of x and h
STRIP = 126  # output columns per program (the kernel's STRIP)
STARTUP = 4  # a program's start (its 132 KB of weights) in rows' time, for run_rows
# The kernel's SMEM_BYTES plus alignment slack: folded weights, the projection weight, 4 input rows, the h row, P
# (128 pixels x 33 floats), barriers.
SMEM = 16 * 8192 + 32 * 128 + 4 * 9216 + 8 * 2048 + 128 * 33 * 4 + 40 + 1024


def weights_reason(conv_w: Tensor, last_w: Tensor, patch: int) -> str | None:
    """Why the kernel cannot run a tail with these weights (on their device, in their dtype), or None."""
    if not conv_w.is_cuda or torch.cuda.get_device_capability(conv_w.device) < (9, 0):
        return "needs an sm_90 GPU"
    if conv_w.dtype != torch.float16 or tuple(conv_w.shape) != (C, C, 3, 3):
        return f"upsample conv weight {tuple(conv_w.shape)} {conv_w.dtype} (takes float16 [{C}, {C}, 3, 3])"
    if patch != 1 or tuple(last_w.shape) != (3, C, 3, 3):
        return f"last conv weight {tuple(last_w.shape)} with patch {patch} (takes [3, {C}, 3, 3], patch 1)"
    return _backend.kernels_unavailable_reason(conv_w.device)


def unsupported_reason(x: Tensor, conv_w: Tensor, last_w: Tensor, patch: int) -> str | None:
    """Why the kernel cannot run this tail on x (None: it can)."""
    if not x.is_cuda or x.dtype != torch.float16 or x.dim() != 4 or x.shape[1] != C:
        return f"x {tuple(x.shape)} {x.dtype} on {x.device} (takes float16 [N, {C}, H, W] on an sm_90 GPU)"
    return weights_reason(conv_w, last_w, patch)


def folded_weight(conv_w: Tensor, grow_w: Tensor, built: list | None = None) -> Tensor:
    """f16 [G * 16 * 64, 64]: for each of TGrow's G groups (output frames), conv_w composed with the group's rows of
    grow_w [G * 64, 64, 1, 1], folded over the upsample, as 16 K-major blocks [c_out][c_in] in the kernel's order
    ((py * 2 + ty) * 2 + tx) * 2 + px. Composed and folded in fp32, rounded once (as
    triton_conv_tma.grown_weight)."""
    def build() -> Tensor:
        if built is not None:
            built.append("folded")
        composed = compose_grow(conv_w, grow_w)  # [G, c_out, c_in, 3, 3]
        blocks = [fold_upsample_weight(w).view(2, 2, C, C, 2, 2).permute(0, 4, 5, 1, 2, 3).reshape(16 * C, C)
                  for w in composed]  # [py, px, c_out, c_in, ty, tx] -> [py, ty, tx, px, c_out, c_in]
        return torch.cat(blocks).to(torch.float16).contiguous()

    return derived.get(conv_w, ("cuda_tail", "folded"), build, also=(grow_w,))


def projected_weight(last_w: Tensor, built: list | None = None) -> Tensor:
    """f16 [32, 64], the projection: row ky * 9 + kx * 3 + c is the last conv's
    weight [c, :, ky, kx] (K-major), rows 27-31 zero. The kernel multiplies each h row by it (P) and sums, for output
    pixel (r, x) and channel c, P[r + ky - 1][x + kx - 1][ky * 9 + kx * 3 + c] over the 9 taps."""
    def build() -> Tensor:
        if built is not None:
            built.append("projected")
        w = last_w.detach().float().permute(2, 3, 0, 1).reshape(27, C)  # [(ky, kx, c), c_in]
        return torch.nn.functional.pad(w, (0, 0, 0, 5)).to(torch.float16).contiguous()

    return derived.get(last_w, ("cuda_tail", "projected"), build)


def run_rows(frames: int, Hh: int, Wh: int, sms: int) -> int:
    """Output rows per program: the run length that finishes soonest, counting whole waves of programs (frames x
    strips x row runs, one program per SM) of rows + 2 halo rows + STARTUP rows' worth of loading the weights."""
    strips = -(-Wh // STRIP)
    best = (float("inf"), Hh)
    for runs in range(1, Hh + 1):
        rows = -(-Hh // runs)
        waves = -(-(frames * strips * -(-Hh // rows)) // sms)
        best = min(best, (waves * (rows + 2 + STARTUP), rows))
    return best[1]


def launch(x: Tensor, grow_w: Tensor, conv_w: Tensor, conv_b: Tensor | None, last_w: Tensor,
           last_b: Tensor | None, into: Tensor, patch: int = 1, skip: int = 0, relu: bool = True,
           rows: int | None = None, pdl: bool = False) -> Tensor:
    """Frames of the tail on x [N, 64, H, W] (channels_last f16, 16-byte aligned) into `into` [B, k, 3, 2H, 2W]
    (uint8 or f16, any strides): output frame f = n * G + g (G = grow_w.shape[0] // 64) is frame f % (N G / B) - skip
    of sample f // (N G / B); frames before `skip` are not written. rows: output rows per program (None: about one
    wave). Returns `into`."""
    reason = unsupported_reason(x, conv_w, last_w, patch)
    N, _, H, W = x.shape
    G = grow_w.shape[0] // C
    B = into.shape[0]
    frames = (N * G // B - skip, 3, 2 * H, 2 * W)
    if reason is None and (N * G % B or tuple(into.shape[1:]) != frames
                           or into.dtype not in (torch.uint8, torch.float16)):
        reason = (f"output {tuple(into.shape)} {into.dtype} does not hold {N * G} frames of {2 * H}x{2 * W} in {B} "
                  f"samples (expected [{B}, {', '.join(map(str, frames))}], uint8 or float16)")
    if reason is not None:
        raise ValueError(f"{NAME}: {reason}")
    if not x.is_contiguous(memory_format=torch.channels_last) or x.data_ptr() % 16:
        raise ValueError(f"{NAME}: x must be dense channels_last and 16-byte aligned")
    Hh, Wh = 2 * H, 2 * W
    built: list = []  # weights packed in this call: then no PDL (the kernel reads them before its wait)
    w1 = folded_weight(conv_w, grow_w, built)
    w2 = projected_weight(last_w, built)
    rows = rows or run_rows(N * G, Hh, Wh, sm_count(x.device))
    strips, runs = -(-Wh // STRIP), -(-Hh // rows)
    x_map = nhwc_map(x, [8, 65, 1, 1], swizzle=False)
    w1_map = tensor_map(w1, [C, w1.shape[0]], [C], [C, C])
    w2_map = tensor_map(w2, [C, w2.shape[0]], [C], [C, w2.shape[0]])
    kernel = _backend.get_kernel(SOURCE, KERNEL, device=x.device)
    pdl = bool(pdl and not built)
    kernel((N * G * runs * strips,), (256,),
           [x_map, w1_map, w2_map, conv_b, last_b, into, H, W, G, rows, runs, strips, N * G // B, skip,
            *into.stride(), int(into.dtype == torch.uint8), int(relu), int(pdl)],
           smem=SMEM, pdl=pdl)
    return into
