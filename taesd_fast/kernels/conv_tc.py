"""taesd_fast::conv3x3_tc: Triton tensor-core implicit-GEMM 3x3 conv on channels_last (NHWC) f16, with the
epilogue (bias, residual, ReLU), an optional nearest-2x upsample in front and an optional soft clamp fused in.

    y = conv2d(up(c(x)), w, b, stride, padding=1) (+ residual); relu(y) if relu
    up = nearest 2x upsample if upsample == 2 else identity;  c = 3*tanh(x/3) if pre_clamp else identity
    x: [B, C_in, H, W] f16   w: [C_out, C_in, 3, 3] f16   b: [C_out] f16 | None
    residual: [B, C_out, Ho, Wo] f16 | None;  Ho = 2H (upsample) or (H - 1) // stride + 1
    fp32 accumulation; the output is channels_last. `conv3x3_tc_ref` is the PyTorch twin (fp32 maths, any device).

Implicit GEMM: M = output pixels, N = C_out, K = taps * C_in. One program computes a [BLOCK_M, BLOCK_N] tile of
output pixels x output channels; it loops over the taps (ky, kx) and chunks of BLOCK_K input channels and loads the
shifted input rows with masks (the masks are the zero padding). Two ways to walk K:
  * tap mode (C_in >= 16): per tap, contiguous channel chunks: 16-byte vector loads straight from NHWC.
  * flat mode (C_in < 16): K = taps * C_in is one block (3 -> 27 -> 32); each k decodes to (tap, channel). Padding
    every tap to 16 channels would waste 5x the MMA work for C_in = 3.
The weight is packed once per (weight, version) into [phases, K rows, N_pad] f16 with zero padding, so weight loads
need no masks (`pack_weight`, cached on the weight tensor).

Upsample fold (upsample=2, stride 1). Nearest 2x followed by a 3x3 conv is, for each output phase (oy%2, ox%2), a
2x2 conv on the low-res input: along one axis, output row 2i reads low-res rows i-1 (tap 0) and i (taps 1+2), output
row 2i+1 reads rows i (taps 0+1) and i+1 (tap 2); zero padding maps onto low-res zero padding exactly. That is 4 taps
instead of 9 (2.25x fewer MACs) and the 4x larger upsampled tensor is never written or read. The phase weights are
sums of 1, 2 or 4 of the 3x3 taps, computed in fp32 and rounded to f16 once: this changes rounding slightly versus
upsample-then-conv (one extra f16 rounding of the summed weights, about 2^-12 relative rms); the tests bound the
error by 2x PyTorch's own f16 error against an fp32/fp64 reference.

pre_clamp: the decoder's Clamp (3*tanh(x/3)) is applied to x as it is loaded, in fp32, rounded to f16 for the MMA.

Layout: x and residual are read as dense NHWC. Inputs in any other layout are accepted but copied to channels_last
first (one extra pass), so the dispatcher should offer this op for channels_last inputs only.

Launch configs come from a small deterministic heuristic per shape (`default_config`, overridable through TUNED or
an explicit `config=` to `conv3x3_tc_launch`): no autotuning at call time, since calls may be captured in CUDA graphs.
Sizes (H, W, M, ...) are not specialised, so one compiled kernel serves every image size of a layer.

Predicted gain (written before any measurement on the GPU; H200, f16 dense MMA ceiling ~690 TFLOP/s, HBM 4.24 TB/s):
  * 64->64 stride 1 at 256^2, B=64: 2*64*256^2*576*64 = 309 GFLOP. cuDNN channels_last at ~183 TFLOP/s = 1.69 ms,
    plus separate passes for + residual (read 2 x 537 MB, write 537 MB: ~0.38 ms) and ReLU (~0.25 ms): 1.9-2.3 ms.
    Memory floor of the fused kernel: read x (537 MB) (+ residual 537 MB) and write y (537 MB) = 0.25-0.38 ms.
    Compute at a plausible 400-500 TFLOP/s for a Triton wgmma kernel with K=576: 0.62-0.77 ms. Predicted ~0.7-0.9 ms,
    i.e. ~2x over cuDNN's conv alone and ~2.5x over conv + epilogue passes.
  * upsample + 64->64 at 128^2 -> 256^2, B=64: the folded conv is 137 GFLOP (0.3 ms at 450 TFLOP/s), reads 134 MB and
    writes 537 MB (0.16 ms floor); cuDNN needs the interpolate pass (~0.16 ms) + a 1.69 ms conv. Predicted ~4-5x.
  * 64->3 at 256^2, B=64: memory bound (read 537 MB = 0.13 ms); N padded to 16 wastes MMA work that is not the limit.
  * 64->64 stride 2 at 256^2 -> 128^2, B=16: 19 GFLOP, 0.04 ms of MMA and 0.04 ms of traffic: predicted ~0.06 ms.
  * 4->64 / 16->64 with pre_clamp at 32^2, B=64: a few MB; launch latency dominates outside CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .conv3x3 import check_f16_operands, f16_3x3_reason
from .derived import derived

try:  # Triton is optional: without it the module still imports and the op runs its PyTorch twin on CPU.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _TRITON_ERROR: str | None = None
except Exception as e:  # ImportError, or a broken install raising something else
    triton = tl = None
    _TRITON_ERROR = f"triton not importable ({type(e).__name__}: {e})"

__all__ = [
    "TCConfig", "TUNED", "MAX_CHANNELS", "conv3x3_tc", "conv3x3_tc_ref", "conv3x3_tc_launch", "check_conv3x3_tc",
    "unsupported_reason", "triton_available", "triton_unavailable_reason", "default_config", "pack_weight",
    "fold_upsample_weight", "output_shape", "conv3x3_math", "is_ready", "spec_unsupported_reason", "spec_ready", "run_conv2d", "flops",
]

MAX_CHANNELS = 256
POISON_OUTPUT = False  # tests set this: NaN-fill the output before launch, so unwritten elements show
_MAX_PIXELS = 2**31 - 2**20  # pixel indices are int32 in the kernel (element offsets are int64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device | str | None = "cuda") -> str | None:
    """Why the Triton kernel cannot run on `device` here, or None. Under TRITON_INTERPRET=1 any device works."""
    if _TRITON_ERROR is not None:
        return _TRITON_ERROR
    if _interpreting():
        return None
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return f"device {dev} (the Triton kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 8:  # f16 mma.sync with fp32 accumulation as Triton emits it: Ampere and newer
        return f"compute capability {major}.{minor} (needs >= 8.0)"
    return None


def triton_available(device: torch.device | str | None = "cuda") -> bool:
    return triton_unavailable_reason(device) is None


# --------------------------------------------------------------------------- shapes and checks


def output_shape(x_shape, w_shape, stride: int, upsample: int) -> tuple:
    B, _, H, W = x_shape
    if upsample == 2:
        return (B, w_shape[0], 2 * H, 2 * W)
    return (B, w_shape[0], (H - 1) // stride + 1, (W - 1) // stride + 1)


def unsupported_reason(x_shape, w_shape, dtype, stride: int, upsample: int = 1) -> str | None:
    """Why (x, w, stride, upsample) is outside what the kernel handles, or None. Shapes only: no tensors."""
    reason = f16_3x3_reason(x_shape, w_shape, dtype, stride, MAX_CHANNELS)
    if reason is not None:
        return reason
    if upsample not in (1, 2):
        return f"upsample {upsample} (expected 1 or 2)"
    if upsample == 2 and stride != 1:
        return "upsample=2 needs stride 1 (the fold is for nearest-2x upsample followed by a stride-1 conv)"
    B, _, H, W = x_shape
    if min(B, H, W) < 1:
        return f"empty input {tuple(x_shape)}"
    _, _, Ho, Wo = output_shape(x_shape, w_shape, stride, upsample)
    if max(B * H * W, B * Ho * Wo) >= _MAX_PIXELS:
        return f"B*H*W={B * H * W}, B*Ho*Wo={B * Ho * Wo} pixels (expected < {_MAX_PIXELS})"
    return None


def check_conv3x3_tc(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int,
                     upsample: int) -> tuple:
    """Validate arguments; raise ValueError naming what is wrong and what was expected. Returns the output shape."""
    check_f16_operands("conv3x3_tc", x, w, b, residual, dtype_error=ValueError)
    reason = unsupported_reason(x.shape, w.shape, x.dtype, stride, upsample)
    if reason is not None:
        raise ValueError(f"conv3x3_tc: {reason}")
    c_out = w.shape[0]
    if b is not None and tuple(b.shape) != (c_out,):
        raise ValueError(f"conv3x3_tc: b must have shape ({c_out},), got {tuple(b.shape)}")
    out_shape = output_shape(x.shape, w.shape, stride, upsample)
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"conv3x3_tc: residual must have the output shape {out_shape}, got {tuple(residual.shape)}")
    return out_shape


def _new_out(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=torch.channels_last)


# --------------------------------------------------------------------------- reference twin


def conv3x3_math(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                 upsample: int = 1, pre_clamp: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """The op's maths op by op in PyTorch (clamp, upsample, conv, + bias + residual, ReLU), computed in `dtype`
    (default: x's). float64 gives the reference the tests measure errors against; x's own f16 gives what the model
    runs without kernels. Uses the unfolded 3x3 weight: the function the kernel approximates."""
    cast = lambda t: None if t is None else t.to(dtype or x.dtype)  # noqa: E731
    h = cast(x)
    if pre_clamp:
        h = torch.tanh(h / 3) * 3
    if upsample == 2:
        h = F.interpolate(h, scale_factor=2, mode="nearest")
    y = F.conv2d(h, cast(w), cast(b), stride=stride, padding=1)
    if residual is not None:
        y = y + cast(residual)
    return torch.relu(y) if relu else y


def conv3x3_tc_ref(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                   upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """PyTorch twin: fp32 maths, one rounding to x.dtype."""
    out_shape = check_conv3x3_tc(x, w, b, residual, stride, upsample)
    y = conv3x3_math(x, w, b, residual, stride, relu, upsample, pre_clamp, dtype=torch.float32)
    return _new_out(out_shape, x).copy_(y)


# --------------------------------------------------------------------------- weight packing

# Along one axis, phase p of a nearest-2x upsample reads low-res offsets (p-1, p); row t of _FOLD[p] says which of the
# three 3x3 taps land on low-res tap t (see the module docstring).
_FOLD = ((( 1, 0, 0), (0, 1, 1)),   # phase 0: output 2i   <- x[i-1]*w0 + x[i]*(w1+w2)
         (( 1, 1, 0), (0, 0, 1)))   # phase 1: output 2i+1 <- x[i]*(w0+w1) + x[i+1]*w2


def fold_upsample_weight(w: Tensor) -> Tensor:
    """[C_out, C_in, 3, 3] -> fp32 [4, C_out, C_in, 2, 2]: phase (py*2+px) 2x2 weights on the low-res input, whose
    tap (ty, tx) reads x[i + py - 1 + ty, j + px - 1 + tx] for output pixel (2i+py, 2j+px)."""
    fold = torch.tensor(_FOLD, dtype=torch.float32, device=w.device)  # [phase, t, k]
    # phase (py, px): W[o, c, ty, tx] = sum_{ky,kx} fold[py, ty, ky] * fold[px, tx, kx] * w[o, c, ky, kx]
    wp = torch.einsum("pak,qbl,ockl->pqocab", fold, fold, w.float())
    return wp.reshape(4, *w.shape[:2], 2, 2)


@dataclass(frozen=True)
class _Plan:
    """Compile-time shape of one launch, derived from the shapes and the config."""

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
def _plan(c_in: int, c_out: int, upsample: int, block_k: int = 0) -> _Plan:
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
    return _Plan(flat, ks, 4 if upsample == 2 else 1, bk, cin_pad, k_rows, bn, -(-c_out // bn) * bn)


def pack_weight(w: Tensor, upsample: int, plan: _Plan) -> Tensor:
    """[C_out, C_in, 3, 3] -> f16 [phases, k_rows, n_pad], zero padded. Row (tap*cin_pad + c) in tap mode, row
    (tap*C_in + c) in flat mode; tap = ky*ks + kx; column = output channel."""
    c_out, c_in = w.shape[:2]
    wt = fold_upsample_weight(w) if upsample == 2 else w.float().unsqueeze(0)  # [P, C_out, C_in, ks, ks]
    wt = wt.permute(0, 3, 4, 2, 1)  # [P, ky, kx, C_in, C_out]
    if plan.flat:
        wt = wt.reshape(plan.phases, plan.ks * plan.ks * c_in, c_out)
        wt = F.pad(wt, (0, plan.n_pad - c_out, 0, plan.k_rows - wt.shape[1]))
    else:
        wt = F.pad(wt, (0, plan.n_pad - c_out, 0, plan.cin_pad - c_in))
        wt = wt.reshape(plan.phases, plan.k_rows, plan.n_pad)
    return wt.to(torch.float16).contiguous()  # fp32 sums (the fold) rounded to f16 once




# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TCConfig:
    """Launch config. block_k = 0 picks it from C_in (tap mode: min(64, pow2(C_in)); flat mode ignores it).
    cache_a: load the input through L1 (cp.async.ca) instead of L2 only (.cg): the three kx taps of a row read
    almost the same bytes, so L1 hits could cut L2 traffic (measured on the H200: within 5%, run E).
    tile_w > 0: the TMA kernel (conv_tc_tma) on 2-D tiles of (block_m // tile_w) x tile_w pixels, where it applies
    (stride 1, C_in a multiple of block_k, no pre_clamp, Hopper, 16-byte aligned x); elsewhere the pointer kernel.
    persistent > 0 (TMA only): that many programs per SM, each looping over tiles.
    halo_w > 0: the row-streaming Gluon kernel (conv_halo) with strips of halo_w output columns (64 where W <= 64),
    where it applies (64->64 or 64->3, stride 1, no upsample or pre_clamp, W >= 64, sm_90); elsewhere the TMA or
    pointer kernel as above.
    small_tile: the latency kernels where they apply (64 input channels, no pre_clamp, sm_90, grids of one wave):
    conv_tile (rows of 64 output pixels, weights loaded before the PDL wait, the three shifted input boxes in one
    round) for stride-1 64->64 convs, conv_up for the upsample fold without a residual, conv_narrow for 64->7 or
    fewer (whole rows, the column taps in N); elsewhere as above."""

    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = 0
    cache_a: bool = False
    tile_w: int = 0
    persistent: int = 0
    halo_w: int = 0
    small_tile: bool = False

    def __str__(self) -> str:
        return (f"M{self.block_m}w{self.num_warps}s{self.num_stages}" + (f"k{self.block_k}" if self.block_k else "")
                + ("ca" if self.cache_a else "") + (f"t{self.tile_w}" if self.tile_w else "")
                + (f"p{self.persistent}" if self.persistent else "") + (f"h{self.halo_w}" if self.halo_w else "")
                + ("st" if self.small_tile else ""))


SMALL_TILE = True  # small problems take the latency kernels (conv_tile, conv_up, conv_narrow); benchmarks toggle it
# Measured best configs, (C_in, C_out, stride, upsample) -> TCConfig; filled from scripts/bench_conv_tc.py output.
TUNED: dict[tuple, TCConfig] = {}
_SMS = 132  # H200; only used to avoid launching fewer than ~2 waves of tiles on small problems


def default_config(c_in: int, c_out: int, stride: int, upsample: int, m_rows: int, tma: bool = True) -> TCConfig:
    """Deterministic pick from the shape (m_rows = output pixels, per phase for the upsample fold). tma=False keeps
    the pointer kernel: TMA and row-streaming launches cost more CPU time (host tensor-map encoding), which eager
    calls pay."""
    tuned = TUNED.get((c_in, c_out, stride, upsample))
    if tuned is not None:
        return tuned
    plan = _plan(c_in, c_out, upsample)
    tiles = lambda bm: -(-m_rows // bm) * plan.phases * (plan.n_pad // plan.block_n)
    num_warps = 8 if plan.block_n >= 128 else 4
    # The latency kernels (conv_tile, conv_up, conv_narrow) take small problems with 64 input channels; the
    # launcher falls back where they cannot run (other channel counts, more than one wave of programs).
    small_tile = SMALL_TILE and tma and c_in == 64 and stride == 1
    if tiles(128) < 2 * _SMS:  # small problems (B=1 previews): smaller tiles fill the SMs
        return TCConfig(64, num_warps, 2 if plan.flat else 3, small_tile=small_tile)
    if plan.flat:  # a single K step: nothing to pipeline
        return TCConfig(128, num_warps, 2)
    # 2-D TMA tiles where they apply (the launcher falls back to the pointer kernel elsewhere): 64->64 at 256^2,
    # B=64 0.87 vs 0.92-0.97 ms, the upsample fold 0.44 vs 0.54 ms (H200, run F). Before them, the row-streaming
    # kernel for 64->64 and 64->3 (falls back to TMA where it cannot run): 64->64 256^2 B=64 0.60 vs 0.87 ms,
    # 128^2 0.135 vs 0.20, 1024^2 B=1 0.156 vs 0.23 (run K).
    halo = tma and c_in == 64 and (c_out == 64 or c_out <= 16) and stride == 1 and upsample == 1
    return TCConfig(128, num_warps, 3, tile_w=16 if tma else 0, halo_w=128 if halo else 0,
                    # conv_up and conv_narrow (64->3) where one wave covers them (256^2 B=1)
                    small_tile=small_tile and (upsample == 2 or c_out < 64))


def _check_config(cfg: TCConfig, plan: _Plan) -> None:
    ok = lambda v: v >= 16 and v & (v - 1) == 0
    if not ok(cfg.block_m) or not ok(plan.block_k) or cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(f"conv3x3_tc: bad config {cfg!r} (block_m, block_k: powers of two >= 16; num_warps 1..16)")


# --------------------------------------------------------------------------- the kernel

if triton is not None:

    @triton.jit
    def _soft_clamp(a):
        # 3*tanh(a/3) in fp32 as sign(a) * 3 * (1 - e) / (1 + e), e = exp(-2|a|/3): no overflow for any |a|.
        af = a.to(tl.float32)
        e = tl.exp(tl.abs(af) * (-2.0 / 3.0))
        t = 3.0 * (1.0 - e) / (1.0 + e)
        return tl.where(af < 0, -t, t).to(tl.float16)

    @triton.jit
    def _pdl_start(PDL: tl.constexpr):
        # Programmatic dependent launch: this kernel may start while the previous one drains. Wait for its writes
        # before touching any activation, then let the next kernel begin launching (it waits the same way).
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _upsample_phase(pid, UPSAMPLE: tl.constexpr):
        # (phase, tile, py, px) of program pid. With the upsample fold, the 4 output phases of one tile are
        # neighbouring programs: they read the same low-res input, so L2 serves them.
        if UPSAMPLE:
            return pid % 4, pid // 4, (pid % 4) // 2, pid % 2
        return 0, pid, 0, 0

    @triton.jit
    def _epilogue(acc, b_ptr, r_ptr, y_ptr, out_px, m_ok, rn, C_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr):
        # In fp32: + bias, + residual, ReLU, one rounding to f16, stored at output pixels out_px (NHWC). Shared by
        # the pointer and the TMA kernel (conv_tc_tma).
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < C_OUT, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_px.to(tl.int64)[:, None] * C_OUT + rn[None, :]
        if C_OUT == BLOCK_N:
            o_mask = m_ok[:, None]
        else:
            o_mask = m_ok[:, None] & (rn < C_OUT)[None, :]
        if HAS_RES:
            acc += tl.load(r_ptr + o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        tl.store(y_ptr + o_ptrs, acc.to(tl.float16), mask=o_mask)

    @triton.jit
    def _load_input(ptrs, mask, CACHE_A: tl.constexpr):
        if CACHE_A:
            return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".ca")
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit(do_not_specialize=["M", "GH", "GW", "H", "W", "Ho", "Wo"])
    def _conv3x3_tc_kernel(
        x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
        M, GH, GW, H, W, Ho, Wo,  # M = GH*GW*B grid pixels (output pixels, or low-res pixels per upsample phase)
        C_IN: tl.constexpr, C_OUT: tl.constexpr, N_PAD: tl.constexpr, K_ROWS: tl.constexpr,
        CHUNKS: tl.constexpr, KS: tl.constexpr, STRIDE: tl.constexpr, UPSAMPLE: tl.constexpr, FLAT: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr, PRE_CLAMP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CACHE_A: tl.constexpr,
        PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        phase, tile, py, px = _upsample_phase(tl.program_id(0), UPSAMPLE)
        if C_OUT <= BLOCK_N:
            rn = tl.arange(0, BLOCK_N)
        else:
            rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        gx = rm % GW
        t = rm // GW
        gy = t % GH
        img = t // GH
        if UPSAMPLE:
            r0 = gy + py - 1  # top-left low-res pixel of this phase's 2x2 window
            q0 = gx + px - 1
            oy = 2 * gy + py
            ox = 2 * gx + px
        else:
            r0 = gy * STRIDE - 1
            q0 = gx * STRIDE - 1
            oy = gy
            ox = gx
        row0 = img * H  # image base row in the [B*H, W] pixel grid
        w_base = w_ptr + phase * (K_ROWS * N_PAD)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

        if FLAT:
            # One K block: k = tap * C_IN + c. Masked k (past the taps) and padding read as 0; the weight rows there are 0.
            tap = rk // C_IN
            c = rk % C_IN
            iy = r0[:, None] + (tap // KS)[None, :]
            ix = q0[:, None] + (tap % KS)[None, :]
            ok = (m_ok[:, None] & (rk < KS * KS * C_IN)[None, :]
                  & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W))
            offs = ((row0[:, None] + iy) * W + ix).to(tl.int64) * C_IN + c[None, :]
            a = _load_input(x_ptr + offs, ok, CACHE_A)
            if PRE_CLAMP:
                a = _soft_clamp(a)
            wt = tl.load(w_base + rk[:, None] * N_PAD + rn[None, :])
            acc = tl.dot(a, wt, acc)
        else:
            # K loop: taps x channel chunks. A plain range loop, so Triton software-pipelines the loads (num_stages).
            for kk in range(KS * KS * CHUNKS):
                tap = kk // CHUNKS
                c0 = (kk % CHUNKS) * BLOCK_K
                iy = r0 + tap // KS
                ix = q0 + tap % KS
                ok = m_ok & (iy >= 0) & (iy < H) & (ix >= 0) & (ix < W)
                offs = ((row0 + iy) * W + ix).to(tl.int64) * C_IN + c0
                ptrs = x_ptr + offs[:, None] + rk[None, :]
                if C_IN % BLOCK_K == 0:
                    a = _load_input(ptrs, ok[:, None], CACHE_A)  # whole 16-byte vectors: no channel mask
                else:
                    a = _load_input(ptrs, ok[:, None] & ((c0 + rk) < C_IN)[None, :], CACHE_A)
                if PRE_CLAMP:
                    a = _soft_clamp(a)
                wt = tl.load(w_base + (kk * BLOCK_K + rk)[:, None] * N_PAD + rn[None, :])
                acc = tl.dot(a, wt, acc)

        _epilogue(acc, b_ptr, r_ptr, y_ptr, (img * Ho + oy) * Wo + ox, m_ok, rn, C_OUT, BLOCK_N, HAS_BIAS, HAS_RES,
                  RELU)


# --------------------------------------------------------------------------- launch

_launched: set = set()  # (device, compile key) of every successful launch: what can run in a CUDA graph capture


def _compile_key(x_shape, w_shape, stride, upsample, pre_clamp, bias, residual, relu, cfg: TCConfig) -> tuple:
    return (tuple(w_shape[:2]), int(stride), int(upsample), bool(pre_clamp), bool(bias), bool(residual), bool(relu),
            cfg)


def is_ready(x_shape, w_shape, stride: int, upsample: int, pre_clamp: bool, bias: bool, residual: bool, relu: bool,
             device, tma: bool = True) -> bool:
    """True once the kernel for this call (with its default config) was launched in this process: no Triton compile
    or module load would happen inside a CUDA-graph capture. (A differently aligned base pointer can still compile.)"""
    B, _, H, W = x_shape
    _, _, Ho, Wo = output_shape(x_shape, w_shape, stride, upsample)
    m_rows = B * (H * W if upsample == 2 else Ho * Wo)
    cfg = default_config(w_shape[1], w_shape[0], stride, upsample, m_rows, tma)
    key = _compile_key(x_shape, w_shape, stride, upsample, pre_clamp, bias, residual, relu, cfg)
    return (str(torch.device(device)), key) in _launched


def _tma_reason(x: Tensor, c_in: int, stride: int, pre_clamp: bool, plan: _Plan, cfg: TCConfig) -> str | None:
    """Why this call cannot take the TMA kernel (then the pointer kernel runs), or None."""
    from . import conv_tc_tma

    if x.data_ptr() % 16:
        return "x is not 16-byte aligned (TMA)"
    return conv_tc_tma.unsupported_reason(c_in, stride, pre_clamp, plan.block_k, cfg.tile_w, cfg.block_m, x.device)


def _halo_reason(x: Tensor, c_out: int, stride: int, upsample: int, pre_clamp: bool, residual: bool) -> str | None:
    """Why this call cannot take the row-streaming kernel (then the TMA or pointer kernel runs), or None."""
    from . import conv_halo

    return conv_halo.unsupported_reason(x, c_out, stride, upsample, pre_clamp, residual)


def _small_tile_reason(x: Tensor, c_out: int, stride: int, upsample: int, pre_clamp: bool,
                       residual: bool) -> str | None:
    """Why this call cannot take a latency kernel (conv_tile; conv_up for the upsample fold, conv_narrow for
    narrow outputs; then the row-streaming, TMA or pointer kernel runs), or None."""
    if upsample == 2:
        from . import conv_up

        return conv_up.unsupported_reason(x, c_out, stride, upsample, pre_clamp, residual)
    if c_out < 64:
        from . import conv_narrow

        return conv_narrow.unsupported_reason(x, c_out, stride, upsample, pre_clamp, residual)
    from . import conv_tile

    return conv_tile.unsupported_reason(x, c_out, stride, upsample, pre_clamp)


PDL = True  # launch with programmatic dependent launch where the GPU has it (sm_90+); benchmarks toggle it


def pdl_args(x: Tensor, packed_now: list | None = None) -> dict:
    """Launch arguments for programmatic dependent launch: on sm_90+, each conv kernel may start while the one before
    it drains (every conv kernel waits for its predecessor's writes before it reads an activation). Saves part of
    each launch gap when many small kernels run back to back, as in a B=1 decode replayed from a CUDA graph.
    Off when the weight was packed in this call (packed_now non-empty): the Gluon kernels load their weights before
    the wait, and the packing kernel right before them writes those weights."""
    if PDL and not packed_now and x.is_cuda and not _interpreting() and _capability(x.device) >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def _as_nhwc(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last)  # no-op when it already is


def conv3x3_tc_launch(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                      upsample: int = 1, pre_clamp: bool = False, config: TCConfig | None = None,
                      out: Tensor | None = None, tma: bool = True) -> Tensor:
    """Run the Triton kernel (the op's CUDA body; benchmarks call it with explicit configs). Returns channels_last y.
    `out`: optional preallocated channels_last output (benchmarks; must not alias the inputs). `tma`: see
    default_config (used when config is None)."""
    if triton is None:
        raise RuntimeError(f"conv3x3_tc: {_TRITON_ERROR}")
    out_shape = check_conv3x3_tc(x, w, b, residual, stride, upsample)
    B, c_in, H, W = x.shape
    c_out = w.shape[0]
    _, _, Ho, Wo = out_shape
    GH, GW = (H, W) if upsample == 2 else (Ho, Wo)
    M = B * GH * GW
    cfg = config or default_config(c_in, c_out, stride, upsample, M, tma)
    plan = _plan(c_in, c_out, upsample, cfg.block_k)
    _check_config(cfg, plan)
    x = _as_nhwc(x)
    residual = None if residual is None else _as_nhwc(residual)
    # Set when a kernel in this call writes the weight or bias (packing, a copy): the launch then goes without PDL
    # (see pdl_args).
    packed_now = [] if b is None or b.is_contiguous() else ["bias copy"]
    b = None if b is None else b.contiguous()
    if out is None:
        out = _new_out(out_shape, x)
    elif tuple(out.shape) != out_shape or not out.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"conv3x3_tc: out must be a channels_last {out_shape} tensor, got {tuple(out.shape)}")
    if POISON_OUTPUT:
        out.fill_(float("nan"))
    grid = (-(-M // cfg.block_m) * plan.phases, plan.n_pad // plan.block_n)
    small = cfg.small_tile and _small_tile_reason(x, c_out, stride, upsample, pre_clamp, residual is not None) is None
    halo = (not small and cfg.halo_w
            and _halo_reason(x, c_out, stride, upsample, pre_clamp, residual is not None) is None)
    tma = not small and not halo and cfg.tile_w and _tma_reason(x, c_in, stride, pre_clamp, plan, cfg) is None
    narrow = small and c_out < 64
    if narrow:  # conv_narrow packs the weight its own way
        from . import conv_narrow

        tag, build = ("conv_narrow",), lambda: conv_narrow.pack(w.detach())
    else:
        tag, build = ("conv_tc", upsample, plan), lambda: pack_weight(w.detach(), upsample, plan)
    wp = derived.get(w, tag, lambda: packed_now.append(tag) or build())
    pdl = pdl_args(x, packed_now)
    # Launch on x's device (current stream); entering a device context costs CPU time, so only when it differs.
    other_device = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if other_device else contextlib.nullcontext():
        if small and upsample == 2:
            from . import conv_up

            conv_up.launch(x, wp, b, out, relu, pdl)
        elif narrow:
            conv_narrow.launch(x, wp, b, out, relu, pdl)
        elif small:
            from . import conv_tile

            conv_tile.launch(x, wp, b, residual, out, relu, pdl)
        elif halo:
            from . import conv_halo

            conv_halo.launch(x, wp, b, residual, out, relu, cfg.halo_w, pdl)
        elif tma:
            from . import conv_tc_tma

            conv_tc_tma.launch(x, wp, b, residual, out, relu, upsample, plan, cfg, pdl)
        else:
            _conv3x3_tc_kernel[grid](
                x, wp, b if b is not None else wp, residual if residual is not None else out, out,
                M, GH, GW, H, W, Ho, Wo,
                C_IN=c_in, C_OUT=c_out, N_PAD=plan.n_pad, K_ROWS=plan.k_rows, CHUNKS=plan.cin_pad // plan.block_k,
                KS=plan.ks, STRIDE=stride, UPSAMPLE=upsample == 2, FLAT=plan.flat,
                HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu), PRE_CLAMP=bool(pre_clamp),
                BLOCK_M=cfg.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, CACHE_A=cfg.cache_a,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
            )
    _launched.add((str(x.device), _compile_key(x.shape, w.shape, stride, upsample, pre_clamp, b is not None,
                                               residual is not None, relu, cfg)))
    return out


# --------------------------------------------------------------------------- the op


@torch.library.custom_op("taesd_fast::conv3x3_tc", mutates_args=())
def conv3x3_tc(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
               upsample: int, pre_clamp: bool) -> Tensor:
    """See the module docstring. CUDA: the Triton kernel (RuntimeError if Triton cannot run there); CPU: the twin,
    or the kernel itself under TRITON_INTERPRET=1 (tests)."""
    check_conv3x3_tc(x, w, b, residual, stride, upsample)
    if x.is_cuda or _interpreting():
        reason = triton_unavailable_reason(x.device)
        if reason is not None:
            raise RuntimeError(f"conv3x3_tc: {reason}")
        return conv3x3_tc_launch(x, w, b, residual, stride, relu, upsample, pre_clamp)
    return conv3x3_tc_ref(x, w, b, residual, stride, relu, upsample, pre_clamp)


@conv3x3_tc.register_fake
def _(x, w, b, residual, stride, relu, upsample, pre_clamp):
    return _new_out(check_conv3x3_tc(x, w, b, residual, stride, upsample), x)


# --------------------------------------------------------------------------- dispatch-table helpers
# Spec-level forms for a dispatch.Candidate. A spec without `upsample` / `pre_clamp` fields means 1 / False.


def spec_unsupported_reason(spec) -> str | None:
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    return triton_unavailable_reason(spec.device) or unsupported_reason(
        spec.x_shape, spec.w_shape, spec.dtype, spec.stride, getattr(spec, "upsample", 1))


def spec_ready(spec, tma: bool = True) -> bool:
    return is_ready(spec.x_shape, spec.w_shape, spec.stride, getattr(spec, "upsample", 1),
                    getattr(spec, "pre_clamp", False), spec.bias, spec.residual, spec.relu, spec.device, tma)


def run_conv2d(x: Tensor, w: Tensor, b: Tensor | None, stride: int, residual: Tensor | None, relu: bool,
               upsample: int = 1, pre_clamp: bool = False, tma: bool = True) -> Tensor:
    """dispatch's conv2d candidate signature (x, w, b, stride, residual, relu), plus the two fused prologues.
    Eager calls launch directly: the custom-op layer is what torch.compile needs, and at small sizes its CPU cost
    per call is more than the kernel's GPU time. tma=False: the pointer kernel (cheaper to launch; for eager calls)."""
    if torch.compiler.is_compiling() or not x.is_cuda:
        return torch.ops.taesd_fast.conv3x3_tc(x, w, b, residual, stride, relu, upsample, pre_clamp)
    return conv3x3_tc_launch(x, w, b, residual, stride, relu, upsample, pre_clamp, tma=tma)


def flops(x_shape, w_shape, stride: int = 1, upsample: int = 1) -> float:
    """MACs x 2 of the equivalent (unfolded) 3x3 conv on the output grid: the figure TFLOP/s are quoted in."""
    B, c_out, Ho, Wo = output_shape(x_shape, w_shape, stride, upsample)
    return 2.0 * B * Ho * Wo * c_out * 9 * w_shape[1]

