"""The tensor-core convs' packed weight: [phases, K rows, N_pad] f16, zero padded, built once per weight (and per
in-place update of it) through the derived-tensor cache. triton_conv, triton_conv_tma, gluon_conv_rows, gluon_conv_tile, gluon_conv_up and
cuda_conv_rows read this layout; gluon_conv_narrow packs its own.

Upsample fold (upsample=2, stride 1). Nearest 2x followed by a 3x3 conv is, for each output phase (oy%2, ox%2), a
2x2 conv on the low-res input: along one axis, output row 2i reads low-res rows i-1 (tap 0) and i (taps 1+2), output
row 2i+1 reads rows i (taps 0+1) and i+1 (tap 2); zero padding maps onto low-res zero padding exactly. That is 4 taps
instead of 9 (2.25x fewer MACs) and the 4x larger upsampled tensor is never written or read. The phase weights are
sums of 1, 2 or 4 of the 3x3 taps, computed in fp32 and rounded to f16 once: one extra f16 rounding of the summed
weights versus upsample-then-conv (about 2^-12 relative rms); the tests bound the error by 2x PyTorch's own f16
error against a float64 reference."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .derived import derived

__all__ = ["Plan", "compose_grow", "fold_upsample_weight", "pack_weight", "packed_weight", "plan"]

# Along one axis, phase p of a nearest-2x upsample reads low-res offsets (p-1, p); row t of _FOLD[p] says which of the
# three 3x3 taps land on low-res tap t.
_FOLD = ((( 1, 0, 0), (0, 1, 1)),   # phase 0: output 2i   <- x[i-1]*w0 + x[i]*(w1+w2)
         (( 1, 1, 0), (0, 0, 1)))   # phase 1: output 2i+1 <- x[i]*(w0+w1) + x[i+1]*w2


def fold_upsample_weight(w: Tensor) -> Tensor:
    """[C_out, C_in, 3, 3] -> fp32 [4, C_out, C_in, 2, 2]: phase (py*2+px) 2x2 weights on the low-res input, whose
    tap (ty, tx) reads x[i + py - 1 + ty, j + px - 1 + tx] for output pixel (2i+py, 2j+px)."""
    fold = torch.tensor(_FOLD, dtype=torch.float32, device=w.device)  # [phase, t, k]
    # phase (py, px): W[o, c, ty, tx] = sum_{ky,kx} fold[py, ty, ky] * fold[px, tx, kx] * w[o, c, ky, kx]
    wp = torch.einsum("pak,qbl,ockl->pqocab", fold, fold, w.float())
    return wp.reshape(4, *w.shape[:2], 2, 2)


def compose_grow(w: Tensor, grow_w: Tensor) -> Tensor:
    """The 3x3 conv weight w [C_out, C, 3, 3] composed with TAEHV TGrow's bias-free 1x1 weight grow_w [G*C, C, 1, 1]
    (G groups: group t becomes output frame t): [G, C_out, C, 3, 3], group t the weight of the conv on frame t of
    TGrow's output, as a conv on TGrow's input. Summed in fp32 (float64 weights: float64), not rounded."""
    c = w.shape[1]
    acc = torch.promote_types(w.dtype, torch.float32)
    g = grow_w.detach().to(acc).reshape(-1, c, c)  # [group, conv input channel, TGrow input channel]
    return torch.einsum("ojyx,tji->toiyx", w.detach().to(acc), g)


@dataclass(frozen=True)
class Plan:
    """Compile-time shape of the implicit GEMM, from the channel counts and the upsample fold.

    Two ways to walk K = taps * C_in:
      * tap mode (C_in >= 16): per tap, contiguous channel chunks of block_k: 16-byte vector loads from NHWC.
      * flat mode (C_in < 16): K is one block (3 -> 27 -> 32); each k decodes to (tap, channel). Padding every tap
        to 16 channels would waste 5x the MMA work for C_in = 3."""

    flat: bool
    ks: int  # taps per axis: 3, or 2 for the upsample fold
    phases: int
    block_k: int
    cin_pad: int  # tap mode: channels per tap in the packed weight (multiple of block_k)
    k_rows: int  # rows of one phase of the packed weight
    block_n: int
    n_pad: int  # columns of the packed weight (multiple of block_n)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=256)  # pure function of four ints, called on every launch
def plan(c_in: int, c_out: int, upsample: int, block_k: int = 0) -> Plan:
    """block_k = 0 picks it from C_in (tap mode: min(64, pow2(C_in)); flat mode ignores it)."""
    ks = 2 if upsample == 2 else 3
    flat = c_in < 16
    if flat:
        bk = max(16, _pow2(ks * ks * c_in))
        cin_pad, k_rows = c_in, bk
    else:
        bk = block_k or min(64, _pow2(c_in))
        cin_pad = -(-c_in // bk) * bk
        k_rows = ks * ks * cin_pad
    bn = min(128, max(16, _pow2(c_out)))
    return Plan(flat, ks, 4 if upsample == 2 else 1, bk, cin_pad, k_rows, bn, -(-c_out // bn) * bn)


def pack_weight(w: Tensor, upsample: int, p: Plan) -> Tensor:
    """[C_out, C_in, 3, 3] -> f16 [phases, k_rows, n_pad], zero padded. Row (tap*cin_pad + c) in tap mode, row
    (tap*C_in + c) in flat mode; tap = ky*ks + kx; column = output channel."""
    c_out, c_in = w.shape[:2]
    wt = fold_upsample_weight(w) if upsample == 2 else w.float().unsqueeze(0)  # [P, C_out, C_in, ks, ks]
    wt = wt.permute(0, 3, 4, 2, 1)  # [P, ky, kx, C_in, C_out]
    if p.flat:
        wt = wt.reshape(p.phases, p.ks * p.ks * c_in, c_out)
        wt = F.pad(wt, (0, p.n_pad - c_out, 0, p.k_rows - wt.shape[1]))
    else:
        wt = F.pad(wt, (0, p.n_pad - c_out, 0, p.cin_pad - c_in))
        wt = wt.reshape(p.phases, p.k_rows, p.n_pad)
    return wt.to(torch.float16).contiguous()  # fp32 sums (the fold) rounded to f16 once


def packed_weight(w: Tensor, upsample: int, p: Plan | None, tag: str = "triton_conv",
                  build=None) -> tuple[Tensor, list]:
    """(w packed for `p` from the cache, packed_now): packed_now is non-empty when the packing ran in this call, so
    the launch goes without PDL (tma_pdl.pdl_args). `build` replaces pack_weight for kernels with their own layout
    (gluon_conv_narrow; p may then be None); `tag` keeps those apart in the cache."""
    packed_now: list = []
    make = build or (lambda: pack_weight(w.detach(), upsample, p))
    wp = derived.get(w, (tag, upsample, p), lambda: packed_now.append(tag) or make())
    return wp, packed_now
