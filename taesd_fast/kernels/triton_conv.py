"""The tensor-core conv's pointer kernel (row "triton_conv"): a Triton implicit-GEMM 3x3 conv on channels_last
(NHWC) f16 with the conv_contract epilogue (bias, residual, ReLU), the upsample fold (conv_pack) and the soft clamp
fused in. Runs every shape the contract allows (1..256 channels each way, stride 1 or 2) on any GPU Triton supports
(sm_80+), and on CPU under TRITON_INTERPRET=1.

Implicit GEMM: M = output pixels, N = C_out, K = taps * C_in. One program computes a [BLOCK_M, BLOCK_N] tile of
output pixels x output channels; it loops over the taps (ky, kx) and chunks of BLOCK_K input channels and loads the
shifted input rows with masks (the masks are the zero padding). conv_pack.Plan says how K is walked (tap mode for
C_in >= 16, flat mode below). The weight is packed once per weight version (conv_pack), so weight loads need no
masks. pre_clamp: the decoder's Clamp (3*tanh(x/3)) is applied to x as it is loaded, in fp32, rounded to f16 for the
MMA.

Layout: x and residual are read as dense NHWC; other layouts are copied to channels_last first (one extra pass).

Launch configs come from a small deterministic heuristic per shape (`default_config`, overridable through TUNED or an
explicit `config=` to `conv3x3_tc_launch`): no autotuning at call time, since calls may be captured in CUDA graphs.
Sizes (H, W, M, ...) are not specialised, so one compiled kernel serves every image size of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .conv_contract import conv_shape_reason, output_shape
from .conv_epilogue import epilogue, upsample_phase
from .conv_launch import conv_row_run, mark_launched, on_device, prepare, spec_launched
from .conv_pack import Plan, packed_weight, plan
from .tma_pdl import pdl_args, pdl_start
from .triton_import import TRITON_ERROR, tl, triton, triton_available, triton_unavailable_reason

__all__ = [
    "NAME", "TCConfig", "TUNED", "MAX_CHANNELS", "conv3x3_tc_launch", "unsupported_reason", "default_config",
    "output_shape", "spec_unsupported_reason", "spec_ready", "run", "launch_conv", "flops", "triton_available",
    "triton_unavailable_reason",
]

NAME = "triton_conv"
MAX_CHANNELS = 256


def unsupported_reason(x_shape, w_shape, dtype, stride: int, upsample: int = 1) -> str | None:
    """Why (x, w, stride, upsample) is outside what the kernel handles, or None. Shapes only: no tensors."""
    return conv_shape_reason(x_shape, w_shape, dtype, stride, upsample, MAX_CHANNELS)


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class TCConfig:
    """Launch config. block_k = 0 picks it from C_in (conv_pack.plan). cache_a: load the input through L1
    (cp.async.ca) instead of L2 only (.cg): the three kx taps of a row read almost the same bytes."""

    block_m: int = 128
    num_warps: int = 4
    num_stages: int = 3
    block_k: int = 0
    cache_a: bool = False

    def __str__(self) -> str:
        return (f"M{self.block_m}w{self.num_warps}s{self.num_stages}" + (f"k{self.block_k}" if self.block_k else "")
                + ("ca" if self.cache_a else ""))


# Measured best configs, (C_in, C_out, stride, upsample) -> TCConfig (a benchmark sweep fills it).
TUNED: dict[tuple, TCConfig] = {}
_SMS = 132  # H200; only used to avoid launching fewer than ~2 waves of tiles on small problems


def default_config(c_in: int, c_out: int, stride: int, upsample: int, m_rows: int) -> TCConfig:
    """Deterministic pick from the shape (m_rows = output pixels, per phase for the upsample fold)."""
    tuned = TUNED.get((c_in, c_out, stride, upsample))
    if tuned is not None:
        return tuned
    p = plan(c_in, c_out, upsample)
    tiles = -(-m_rows // 128) * p.phases * (p.n_pad // p.block_n)
    num_warps = 8 if p.block_n >= 128 else 4
    if tiles < 2 * _SMS:  # small problems (B=1 previews): smaller tiles fill the SMs
        return TCConfig(64, num_warps, 2 if p.flat else 3)
    if p.flat:  # a single K step: nothing to pipeline
        return TCConfig(128, num_warps, 2)
    return TCConfig(128, num_warps, 3)


def _check_config(cfg: TCConfig, p: Plan) -> None:
    ok = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    if not ok(cfg.block_m) or not ok(p.block_k) or cfg.num_warps not in (1, 2, 4, 8, 16) or cfg.num_stages < 1:
        raise ValueError(f"conv3x3_tc: bad config {cfg!r} (block_m, block_k: powers of two >= 16; num_warps 1..16)")


def _m_rows(x_shape, w_shape, stride: int, upsample: int) -> int:
    B, _, H, W = x_shape
    _, _, Ho, Wo = output_shape(x_shape, w_shape, stride, upsample)
    return B * (H * W if upsample == 2 else Ho * Wo)


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
        pdl_start(PDL)
        phase, tile, py, px = upsample_phase(tl.program_id(0), UPSAMPLE)
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

        epilogue(acc, b_ptr, r_ptr, y_ptr, (img * Ho + oy) * Wo + ox, m_ok, rn, C_OUT, BLOCK_N, HAS_BIAS, HAS_RES,
                  RELU)


# --------------------------------------------------------------------------- launch


def conv3x3_tc_launch(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                      upsample: int = 1, pre_clamp: bool = False, config: TCConfig | None = None) -> Tensor:
    """Run the pointer kernel (benchmarks call it with explicit configs). Returns channels_last y."""
    if triton is None:
        raise RuntimeError(f"conv3x3_tc: {TRITON_ERROR}")
    call = prepare("conv3x3_tc", x, w, b, residual, stride, upsample)
    x, out = call.x, call.out
    B, c_in, H, W = x.shape
    c_out = w.shape[0]
    _, _, Ho, Wo = out.shape
    GH, GW = (H, W) if upsample == 2 else (Ho, Wo)
    M = B * GH * GW
    cfg = config or default_config(c_in, c_out, stride, upsample, M)
    p = plan(c_in, c_out, upsample, cfg.block_k)
    _check_config(cfg, p)
    wp, packed_now = packed_weight(w, upsample, p)
    grid = (-(-M // cfg.block_m) * p.phases, p.n_pad // p.block_n)
    b, residual = call.b, call.residual
    with on_device(x):
        _conv3x3_tc_kernel[grid](
            x, wp, b if b is not None else wp, residual if residual is not None else out, out,
            M, GH, GW, H, W, Ho, Wo,
            C_IN=c_in, C_OUT=c_out, N_PAD=p.n_pad, K_ROWS=p.k_rows, CHUNKS=p.cin_pad // p.block_k,
            KS=p.ks, STRIDE=stride, UPSAMPLE=upsample == 2, FLAT=p.flat,
            HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu), PRE_CLAMP=bool(pre_clamp),
            BLOCK_M=cfg.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, CACHE_A=cfg.cache_a,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x, packed_now + call.copied),
        )
    mark_launched(NAME, x, w, stride, upsample, pre_clamp, b is not None, residual is not None, relu, cfg)
    return out


# --------------------------------------------------------------------------- the row


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA, Triton on sm_80+, and the shape rule above."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    return triton_unavailable_reason(spec.device) or unsupported_reason(
        spec.x_shape, spec.w_shape, spec.dtype, spec.stride, spec.upsample)


def spec_ready(spec) -> bool:
    """True once this call's kernel (default config) was launched in this process: no Triton compile would happen
    inside a CUDA-graph capture. Image sizes are not specialised, so any size of the layer counts."""
    upsample = spec.upsample
    cfg = default_config(spec.w_shape[1], spec.w_shape[0], spec.stride, upsample,
                         _m_rows(spec.x_shape, spec.w_shape, spec.stride, upsample))
    return spec_launched(NAME, spec, cfg)


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """The eager launch with the default config (what the conv3x3_tc op runs for this variant)."""
    return conv3x3_tc_launch(x, w, b, residual, stride, relu, upsample, pre_clamp)


def flops(x_shape, w_shape, stride: int = 1, upsample: int = 1) -> float:
    """MACs x 2 of the equivalent (unfolded) 3x3 conv on the output grid: the figure TFLOP/s are quoted in."""
    B, c_out, Ho, Wo = output_shape(x_shape, w_shape, stride, upsample)
    return 2.0 * B * Ho * Wo * c_out * 9 * w_shape[1]


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
