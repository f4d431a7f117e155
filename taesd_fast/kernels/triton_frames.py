"""TAEHV's output frames in one pass (Triton): the decoder's last conv output [N*k, 3p^2, h, w] -> clamp to [0, 1],
unpatchified (pixel shuffle by p), optionally uint8 (round(255 * v)), written into [N, k', 3, h*p, w*p].

PyTorch does this as a strided copy through the pixel shuffle's permutation plus, for uint8, three more passes
(scale, round, convert); that ran at ~1 TB/s. Here each program reads one row of input pixels (all 3p^2 channels)
once and writes its 3 x p output rows, every thread storing p adjacent pixels. The values equal PyTorch's
`pixel_shuffle(y).clamp(0, 1)` (and `.mul(255).round().to(torch.uint8)`, the scaled value rounded to y's dtype as
PyTorch stores it, then to the nearest integer, ties to even) bit for bit. Not a dispatch row: a bandwidth-bound
pass with nothing to tune; TAEHV._postprocess takes it wherever `unsupported_reason` is None."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .triton_import import TRITON_ERROR, tl, triton, triton_unavailable_reason

BLOCK_W = 128  # input pixels per program (one row segment)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_launched: set = set()  # the exact calls (see _call) launched in this process: their compiled kernel is loaded


def _call(y: Tensor, into: Tensor, patch: int, skip: int) -> tuple:
    """What the launch's compiled kernel depends on: the constexprs, and the sizes, strides and pointer alignments
    Triton specialises on."""
    return (str(y.device), patch, y.dtype, into.dtype, tuple(y.shape), y.stride(), tuple(into.shape), into.stride(),
            skip, y.data_ptr() % 16, into.data_ptr() % 16)


def ready(y: Tensor, into: Tensor, patch: int, skip: int = 0) -> bool:
    """True once this exact call was launched in this process (a CUDA-graph capture must not load a module; a
    capture's warm-up makes the same call first)."""
    return _call(y, into, patch, skip) in _launched


def unsupported_reason(y: Tensor, into: Tensor, patch: int) -> str | None:
    """Why the kernel cannot write y's frames into `into` (None: it can)."""
    reason = triton_unavailable_reason(y.device)
    if reason is not None:
        return reason
    if patch < 1 or patch & (patch - 1):
        return f"patch size {patch} is not a power of two"
    if y.dim() != 4 or y.shape[1] != 3 * patch * patch:
        return f"input {tuple(y.shape)} is not [N*k, {3 * patch * patch}, h, w]"
    if y.dtype not in _DTYPES:
        return f"input dtype {y.dtype} (takes float16, bfloat16 or float32)"
    if into.dtype not in (y.dtype, torch.uint8):
        return f"output dtype {into.dtype} (takes the input's {y.dtype} or uint8)"
    if into.device != y.device:
        return f"output on {into.device}, input on {y.device}"
    return None


if triton is not None:

    @triton.jit
    def _frames_kernel(y_ptr, o_ptr, H_IN, W_IN, K_OUT, K_IN, SKIP,
                       sy_img, sy_c, sy_h, sy_w, so_n, so_f, so_c, so_h, so_w,
                       P: tl.constexpr, BLOCK_W: tl.constexpr, UINT8: tl.constexpr, ROUND_TO: tl.constexpr):
        row = tl.program_id(0)  # one input row: output frame (sample, frame) x input row yy
        yy = row % H_IN
        f = row // H_IN
        sample = f // K_OUT
        frame = f % K_OUT
        img = (sample * K_IN + SKIP + frame).to(tl.int64)
        xs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        # [dy, x, dx] tiles: input channel c*P*P + dy*P + dx of pixel (yy, x) is output pixel (yy*P + dy, x*P + dx).
        dy = tl.arange(0, P)[:, None, None]
        x3 = xs[None, :, None]
        dx = tl.arange(0, P)[None, None, :]
        ok = (x3 < W_IN) & (dy < P) & (dx < P)
        src = y_ptr + img * sy_img + yy * sy_h + x3.to(tl.int64) * sy_w + (dy * P + dx) * sy_c
        dst = (o_ptr + sample.to(tl.int64) * so_n + frame.to(tl.int64) * so_f + (yy * P + dy).to(tl.int64) * so_h
               + (x3 * P + dx).to(tl.int64) * so_w)
        for c in tl.static_range(3):
            v = tl.load(src + c * P * P * sy_c, mask=ok, other=0.0).to(tl.float32)
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, 0.0), 1.0))  # clamp; NaN stays NaN, as torch.clamp
            if UINT8:
                m = v * 255.0  # exact in float32 for a float16 / bfloat16 v
                if ROUND_TO == 1:
                    m = m.to(tl.float16).to(tl.float32)
                elif ROUND_TO == 2:
                    m = m.to(tl.bfloat16).to(tl.float32)
                r = tl.floor(m + 0.5)  # round half to even (torch.round): a tie rounded up to an odd value goes down
                odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
                r = tl.where(((r - m) == 0.5) & odd, r - 1.0, r)
                tl.store(dst + c * so_c, r.to(tl.uint8), mask=ok)
            else:
                tl.store(dst + c * so_c, v.to(o_ptr.dtype.element_ty), mask=ok)


def write_frames(y: Tensor, into: Tensor, patch: int, skip: int = 0) -> Tensor:
    """clamp(pixel_shuffle(y, patch), 0, 1) of y [N*k, 3*patch^2, h, w] (any strides) without the first `skip`
    frames of each of the N samples, written into `into` [N, k - skip, 3, h*patch, w*patch] (any strides; uint8:
    round(255 * v)). Returns `into`. ValueError where the kernel cannot take the call."""
    if triton is None:
        raise RuntimeError(f"triton_frames: {TRITON_ERROR}")
    reason = unsupported_reason(y, into, patch)
    n, k_out = into.shape[:2]
    nk, _, h, w = y.shape
    if reason is None and (nk % n or nk // n - skip != k_out
                           or tuple(into.shape[2:]) != (3, h * patch, w * patch)):
        reason = (f"output {tuple(into.shape)} does not hold input {tuple(y.shape)} in {n} samples after "
                  f"skipping {skip} frames each")
    if reason is not None:
        raise ValueError(f"triton_frames: {reason}")
    if into.numel() == 0:
        return into
    round_to = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 0}[y.dtype]
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # (CPU: the interpreter)
        _frames_kernel[(n * k_out * h, triton.cdiv(w, BLOCK_W))](
            y, into, h, w, k_out, nk // n, skip, *y.stride(), *into.stride(),
            P=patch, BLOCK_W=BLOCK_W, UINT8=into.dtype == torch.uint8, ROUND_TO=round_to, num_warps=4)
    _launched.add(_call(y, into, patch, skip))
    return into

