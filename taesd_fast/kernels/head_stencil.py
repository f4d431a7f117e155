"""The second half of every form of the Wan head: head_stencil, our NVRTC kernel (csrc/head_bf16.cu), which adds
the bias and the 9 spatial taps of g (head_g_layout) and clamps:

    out[b, c, t, h, w] = clamp(bias[c] + sum_ij g[b, t, h+i-1, w+j-1, (i*3+j)*C_out + c], -1, 1)

It reads g through strides (dense, or pixel-major as the split conv's GEMM gives it) and with a patch p writes the
unpatchified video directly. A torch.library op with a PyTorch twin (head_stencil_ref, same tap order) that runs on
CPU. The split conv (split_bf16) and the fused g kernels (head_full_common) both end with it.

Row bands: head_stencil computes output rows [lo, lo+rows) of an image of height H_global from a g that holds global
rows [max(lo-g_off, 0), min(lo+rows+g_off, H_global)): g_off halo rows on each side, clipped at the true image
border, which is exactly what conv_n128 gives on the matching row slice of its input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .derived import derived
from .head_g_layout import GC
from .head_math import unpatchify

_CL3D = torch.channels_last_3d

__all__ = ["bias32", "head_stencil", "head_stencil_cuda", "head_stencil_ref", "launch_head_stencil", "new_out",
           "stencil_defines", "stencil_ready"]


def _check_stencil(g: Tensor, bias: Tensor, depth: int, lo: int, rows: int, H_global: int, g_off: int,
                   patch: int = 0) -> int:
    """Raise ValueError naming expected and actual shapes; return g_start (global row of g row 0)."""
    if bias.dim() != 1:
        raise ValueError(f"head_stencil: bias must be [C_out], got shape {tuple(bias.shape)}")
    nch = bias.shape[0]
    if patch < 0 or (patch and nch % (patch * patch)):
        raise ValueError(f"head_stencil: patch must be 0 (none) or p >= 1 with C_out={nch} divisible by p*p, "
                         f"got {patch}")
    if not (0 <= lo and rows >= 1 and lo + rows <= H_global):
        raise ValueError(f"head_stencil: band rows [{lo}, {lo + rows}) is not inside an image of height {H_global}")
    if g_off < 0 or (g_off == 0 and (lo > 0 or lo + rows < H_global)):
        raise ValueError(
            f"head_stencil: a band [{lo}, {lo + rows}) inside an image of height {H_global} needs g_off >= 1 "
            f"halo rows (the 3x3 taps reach one row past the band), got g_off={g_off}"
        )
    g_start, g_end = max(lo - g_off, 0), min(lo + rows + g_off, H_global)
    if g.dim() != 5:
        raise ValueError(f"head_stencil: g must be [B, T, rows_g, W, GC] (from conv_n128), got shape {tuple(g.shape)}")
    if g.shape[1] != depth or g.shape[2] != g_end - g_start:
        raise ValueError(
            f"head_stencil: g must be [B, T={depth}, rows_g={g_end - g_start}, W, GC] for output rows "
            f"[{lo}, {lo + rows}) of height {H_global} with g_off={g_off} (g holds global rows [{g_start}, {g_end})), "
            f"got {tuple(g.shape)}"
        )
    if g.shape[4] < 9 * nch:
        raise ValueError(
            f"head_stencil: g needs >= 9*C_out = {9 * nch} channels for C_out={nch}, got shape {tuple(g.shape)}"
        )
    return g_start




def new_out(like: Tensor, b: int, nch: int, depth: int, rows: int, w: int, patch: int = 0) -> Tensor:
    """[B, C_out, T, rows, W] channels-last (memory order (B, T, rows, W, C_out)), or with a patch p the video
    [B, C_out/p², T, rows*p, W*p] contiguous: as the kernel writes them."""
    if patch:
        return like.new_empty((b, nch // (patch * patch), depth, rows * patch, w * patch))
    return torch.empty((b, nch, depth, rows, w), dtype=like.dtype, device=like.device, memory_format=_CL3D)


def head_stencil_ref(g: Tensor, bias: Tensor, depth: int, lo: int, rows: int, H_global: int, g_off: int,
                     patch: int = 0) -> Tensor:
    """PyTorch twin of the kernel; same tap order, so bit-equal on the same g."""
    g_start = _check_stencil(g, bias, depth, lo, rows, H_global, g_off, patch)
    nch, (b, t, _, w, gc) = bias.shape[0], g.shape
    # canvas row r holds global row lo-1+r, zero outside the image; columns 0 and W+1 are the zero border.
    canvas = g.new_zeros((b, t, rows + 2, w + 2, gc), dtype=torch.float32)
    a, e = max(lo - 1, 0), min(lo + rows + 1, H_global)
    canvas[:, :, a - (lo - 1): e - (lo - 1), 1: w + 1] = g[:, :, a - g_start: e - g_start].float()
    acc = bias.float().view(1, 1, 1, 1, nch).expand(b, t, rows, w, nch).clone()
    for i in range(3):
        for j in range(3):
            k = i * 3 + j
            acc = acc + canvas[:, :, i: i + rows, j: j + w, k * nch: (k + 1) * nch]
    out = new_out(g, b, nch, depth, rows, w, patch)
    out.copy_(unpatchify(acc.clamp(-1, 1).permute(0, 4, 1, 2, 3), patch))
    return out


@torch.library.custom_op("taesd_fast::head_stencil", mutates_args=())
def head_stencil(g: Tensor, bias: Tensor, depth: int, lo: int, rows: int, H_global: int, g_off: int,
                 patch: int = 0) -> Tensor:
    """g [B, T=depth, rows_g, W, GC] (bf16 or f32, channels dense), bias [C_out] -> [B, C_out, T, rows, W]
    channels_last_3d, g.dtype; with patch p >= 1 the video unpatchify(out, p), contiguous, written directly."""
    return head_stencil_ref(g, bias, depth, lo, rows, H_global, g_off, patch)


def _kernel_strides_ok(g: Tensor) -> bool:
    # Vector loads: dense channels, every used stride a multiple of 4 elements, 16-byte aligned base.
    return (g.stride(4) == 1 and g.data_ptr() % 16 == 0
            and all(st % 4 == 0 for st, sz in zip(g.stride()[:4], g.shape[:4]) if sz > 1))


@head_stencil.register_kernel("cuda")
def head_stencil_cuda(g: Tensor, bias: Tensor, depth: int, lo: int, rows: int, H_global: int, g_off: int,
                      patch: int = 0) -> Tensor:
    """head_stencil's CUDA implementation; the fused head calls it directly, being inside an op of its own."""
    from .._backend import kernels_available

    g_start = _check_stencil(g, bias, depth, lo, rows, H_global, g_off, patch)
    b, t, _, w, _ = g.shape
    if g.dtype not in (torch.bfloat16, torch.float32) or max(b, t) > 65535 or not kernels_available(g.device):
        return head_stencil_ref(g, bias, depth, lo, rows, H_global, g_off, patch)
    if not _kernel_strides_ok(g):
        g = g.clone(memory_format=torch.contiguous_format)
    out = new_out(g, b, bias.shape[0], depth, rows, w, patch)
    launch_head_stencil(g, bias.to(device=g.device, dtype=torch.float32).contiguous(), out, lo, H_global, g_start,
                        patch)
    return out


def stencil_defines(nch: int, g_f32: bool = False, patch: int = 0, gc: int = GC) -> dict[str, int]:
    """The stencil kernel's compile-time constants (also the key it is loaded under)."""
    return {"NCH": nch, "GC": gc, "G_F32": int(g_f32), "PATCH": patch}


def launch_head_stencil(g: Tensor, b32: Tensor, out: Tensor, lo: int, H_global: int, g_start: int,
                        patch: int = 0) -> None:
    """Raw launch into a caller-made `out`: [B, C_out, T, rows, W] channels_last_3d, or with patch p the contiguous
    video [B, C_out/p², T, rows*p, W*p] (tests poison it first). Arguments as checked by _check_stencil; g strides
    as _kernel_strides_ok requires."""
    import ctypes

    from .._backend import get_kernel

    b, t, rows_g, w, gc = g.shape
    rows = out.shape[3] // max(patch, 1)
    if out.numel() == 0:
        return
    k = get_kernel("head_bf16.cu", "head_stencil", stencil_defines(b32.shape[0], g.dtype == torch.float32, patch, gc),
                   device=g.device)
    threads = 256
    strides = [ctypes.c_int64(st) for st in g.stride()[:4]]
    k(((rows * w + threads - 1) // threads, t, b), (threads,),
      [g, b32, out, rows, w, rows_g, lo, H_global, g_start, *strides])


@head_stencil.register_fake
def _head_stencil_fake(g: Tensor, bias: Tensor, depth: int, lo: int, rows: int, H_global: int, g_off: int,
                       patch: int = 0) -> Tensor:
    _check_stencil(g, bias, depth, lo, rows, H_global, g_off, patch)
    return new_out(g, g.shape[0], bias.shape[0], depth, rows, g.shape[3], patch)


def bias32(weight: Tensor, bias: Tensor | None) -> Tensor:
    """The stencil's bias operand: fp32, contiguous, zeros where the conv has none; cached on the source tensor
    (torch.compile traces the plain expression instead: data_ptr-keyed caches do not trace)."""
    build = lambda: (weight.new_zeros(weight.shape[0]) if bias is None else bias).float().contiguous()  # noqa: E731
    if torch.compiler.is_compiling():
        return build()
    with torch.no_grad():  # parameters require grad; the cached copy must not hold an autograd graph
        return derived.get(weight if bias is None else bias, ("bias32", bias is None), build)


def stencil_ready(spec) -> bool:
    """True once the stencil for a head or head_full spec (C_out, patch) is loaded on its device: launching it then
    loads nothing (safe inside a CUDA-graph capture)."""
    from .. import _backend

    return _backend.is_loaded("head_bf16.cu", "head_stencil", stencil_defines(spec.w_shape[0], patch=spec.patch),
                              spec.device)
