"""Fused Wan head: RMS norm + SiLU + causal temporal GEMM straight from the raw features (one "g kernel"), then the
9-tap stencil (taesd_fast::head_stencil) for bias + spatial taps + clamp. Three g kernels share this module's contract,
weights and stencil glue, each its own dispatch row:
  * "triton_fused": the Triton kernels below (any CUDA GPU Triton runs on; also under TRITON_INTERPRET=1);
  * "gluon_fused": head_wgmma.py (Gluon, sm_90);
  * "cuda_fused": head_cuda.py (CUDA C++ via NVRTC, sm_90).

    A_s = cache[:, :, s]                                   s < 2   (the activated causal frames)
        = bf16(silu(bf16(rmsnorm_fp32(features[:, :, s-2]))))   s >= 2
    g[b, t, h, w, n] = sum_{k<3} sum_cin A_{t+k}[b, cin, h, w] * Wk[k, cin, n]     (fp32 sum, stored bf16)
    out = head_stencil(g, bias)        [B, 12, T, H, W] bf16 channels_last_3d, clamped to [-1, 1]; with patch p
                                       the video [B, 12/p², T, H*p, W*p], which the stencil writes directly
    new_cache = A_T, A_{T+1}           [B, C, 2, H, W] bf16, what OutputHead returns as its cache

Wk [3, C, 128] bf16 is pack_weight's layout (n = (i*3+j)*12 + c, 112 used columns: head_g_layout) transposed per tap
and padded to 128 columns with zeros, because tl.dot needs a power-of-two N; only the 112 columns of g are stored.
Features are NCDHW, so a [BLOCK_M pixels, BK channels] tile of one frame is contiguous along the pixels. The norm
needs all C channels before any can be activated, so each frame is read twice in BK-channel chunks: once for the
sum of squares, once to activate and feed tl.dot (the second read mostly hits L2). Holding the whole
[BLOCK_M, 256] tile instead spilled registers heavily.

Two Triton variants of the g kernel (same maths, same results up to fp32 summation order inside tl.dot):
  * "roll": one program per (pixel block, batch) walks the window frames once. Each frame is loaded and
    activated once and feeds three accumulators (output frames s-2, s-1, s); the finished one is stored.
  * "per_t": one program per (output frame, pixel block, batch), three taps each; the T programs of a pixel block
    are adjacent in the grid so their shared frames come from L2. Each feature frame is activated up to 3 times.
Both write the new cache from the tiles they already hold (no extra pass over the features).

The op `taesd_fast::fused_head` (variant "auto": the CUDA, then the Gluon, then the Triton g kernel, the first that
runs the call; or a named one) runs on CUDA bf16 tensors only and raises ValueError for anything else;
`fused_head_ref` is its PyTorch twin (any device, any float dtype). `launch_head_g` is the raw Triton g-kernel launch
(CPU tensors work under TRITON_INTERPRET=1, which is how the CPU tests run it). Under the interpreter two helpers
(_bf16, _dot) take another route, because triton 3.9's interpreter truncates fp32->bf16 casts and multiplies bf16
operands as raw integer bits: rounding is done on the bits and dot operands are widened to fp32 (exact products,
same sums). The GPU path uses the native cvt.rn and bf16 tl.dot, so the CPU tests check indexing, masking, the
algorithm and where it rounds, not the GPU instruction selection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import head as _split
from .derived import derived  # the derived-tensor cache
from .head_g_layout import CAUSAL, GC
from .tma_pdl import frames_tma_reason
from .triton_import import TRITON_ERROR as _TRITON_REASON
from .triton_import import tl, triton

NAME = "triton_fused"
N_PAD = 128  # g channels computed (tl.dot needs a power of two)
VARIANTS = ("roll", "per_t")  # the Triton kernels (they also run under TRITON_INTERPRET=1)
HOPPER = "wgmma"  # the Gluon kernel (head_wgmma.py), sm_90 only
CUDA_SM90 = "cuda_sm90"  # the CUDA C++ kernel (head_cuda.py), sm_90 only
# "auto": the CUDA kernel where head_cuda supports the call, else the Gluon kernel where head_wgmma does, else
# "roll" with the Triton config below (the best of a sweep on the H200).
DEFAULT_CONFIG = {"variant": "auto", "block_m": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}
POISON = False  # tests set this: NaN-fill g and the new cache before the kernel, so unwritten elements show

__all__ = [
    "VARIANTS", "DEFAULT_CONFIG", "triton_available", "triton_unavailable_reason", "pack_weight_taps",
    "pack_weight_taps_t",
    "check_fused_head", "fused_head_unsupported_reason", "launch_head_g", "fused_head", "fused_head_ref",
    "fused_head_with", "activate_ref", "set_default_config", "head_full_triton", "head_full_variant", "run",
    "contract_spec_reason", "spec_unsupported_reason", "spec_ready", "stencil_ready",
]


def set_default_config(**config) -> None:
    """Set the kernel config fused_head uses (variant, block_m, block_k, num_warps, num_stages), e.g. the winner of
    a benchmark sweep. Unknown keys raise."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"set_default_config: unknown keys {sorted(unknown)}; expected {sorted(DEFAULT_CONFIG)}")
    if config.get("variant", "roll") not in ("auto", CUDA_SM90, HOPPER, *VARIANTS):
        raise ValueError(f"set_default_config: variant must be one of {('auto', CUDA_SM90, HOPPER, *VARIANTS)}, "
                         f"got {config['variant']!r}")
    DEFAULT_CONFIG.update(config)


def triton_unavailable_reason() -> str | None:
    return _TRITON_REASON


def triton_available() -> bool:
    return _TRITON_REASON is None


# --------------------------------------------------------------------------- weights


def pack_weight_taps(weight: Tensor, n_pad: int = N_PAD) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> Wk [3, C_in, n_pad] bf16: Wk[k, cin, n] = pack_weight(weight)[n, cin, k]
    (zero columns for n >= 9*C_out)."""
    wp = _split.pack_weight(weight, n_pad)  # [n_pad, C_in, 3, 1, 1]
    return wp.reshape(n_pad, weight.shape[1], 3).permute(2, 1, 0).to(torch.bfloat16).contiguous()


def pack_weight_taps_t(weight: Tensor) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> W^T [3, GC, C_in] bf16, the Gluon g kernel's layout: pack_weight_taps per tap
    transposed, its GC used columns as rows (K contiguous, as wgmma's B operand in shared memory wants)."""
    return pack_weight_taps(weight)[:, :, :GC].transpose(1, 2).contiguous()


def _derived_weights(weight: Tensor, bias: Tensor | None, gamma: Tensor, scale: float, variant: str):
    """(the variant's packed weight, bias fp32, scale*gamma fp32), cached on the source tensors like
    split_head_conv's packed weights. The Triton kernels take Wk [3, C, 128]; the Hopper ones W^T [3, 112, C]."""
    get = derived.get
    with torch.no_grad():  # parameters require grad; the cached copies must not hold autograd graphs
        if variant in (HOPPER, CUDA_SM90):
            wk = get(weight, ("fused_taps_t",), lambda: pack_weight_taps_t(weight))
        else:
            wk = get(weight, ("fused_taps",), lambda: pack_weight_taps(weight))
        b32 = get(weight if bias is None else bias, ("bias32", bias is None), lambda: _split._bias32(weight, bias))
    return wk, b32, scaled_gamma(gamma, scale)


def scaled_gamma(gamma: Tensor, scale: float) -> Tensor:
    """scale * gamma as a flat fp32 vector (what the norm multiplies by), cached on gamma."""
    with torch.no_grad():
        build = lambda: (gamma.float().reshape(-1) * scale).contiguous()  # noqa: E731
        return derived.get(gamma, ("scaled_gamma", float(scale)), build)


# --------------------------------------------------------------------------- checks


def check_fused_head(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor,
                     bias: Tensor | None) -> None:
    """Shapes and dtypes that any implementation needs; raise ValueError naming expected and actual."""
    if features.dim() != 5:
        raise ValueError(f"fused_head: features must be [B, C, T, H, W], got shape {tuple(features.shape)}")
    b, c, t, h, w = features.shape
    if min(b, c, t, h, w) < 1:
        raise ValueError(f"fused_head: features must be non-empty, got shape {tuple(features.shape)}")
    if not features.dtype.is_floating_point:
        raise ValueError(f"fused_head: features must be floating point, got {features.dtype}")
    if weight.dim() != 5 or tuple(weight.shape[2:]) != (3, 3, 3) or weight.shape[1] != c:
        raise ValueError(f"fused_head: weight must be [C_out, {c}, 3, 3, 3], got {tuple(weight.shape)}")
    if 9 * weight.shape[0] > GC:
        raise ValueError(f"fused_head: C_out={weight.shape[0]} needs 9*C_out <= {GC}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_head: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if gamma.numel() != c:
        raise ValueError(f"fused_head: gamma must hold C={c} values ([C] or [C, 1, 1, 1]), got {tuple(gamma.shape)}")
    if cache is not None:
        want = (b, c, CAUSAL, h, w)
        if tuple(cache.shape) != want or cache.dtype != features.dtype:
            raise ValueError(
                f"fused_head: cache must be the [B, C, {CAUSAL}, H, W] tensor returned by the previous call "
                f"({want}, {features.dtype}), got {tuple(cache.shape)}, {cache.dtype}"
            )
    for name, x in (("cache", cache), ("gamma", gamma), ("weight", weight), ("bias", bias)):
        if x is not None and x.device != features.device:
            raise ValueError(f"fused_head: {name} is on {x.device} but features are on {features.device}")


_INT32 = 2**31


def per_sample_offsets_fit(*tensors: Tensor | None) -> bool:
    """The Triton head kernels compute offsets inside one batch element in int32 (the batch index is int64): every
    element of a sample must lie within 2**31 elements of the sample's first one. A whole long video at once
    (C * T * H * W >= 2**31, e.g. 256 x 38 frames x 352 x 640) does not."""
    return all(t is None or sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) < _INT32 for t in tensors)


def _shape_reason(c: int, t: int, h: int, w: int) -> str | None:
    if c * (t + CAUSAL) * h * w >= _INT32:
        return f"one sample of C*(T+2)*H*W = {c * (t + CAUSAL) * h * w} elements does not fit int32 offsets"
    return None


def _kernel_reason(c: int, dtype: torch.dtype, device_type: str, needs_triton: bool = True) -> str | None:
    if device_type != "cuda":
        return f"needs CUDA tensors, got {device_type} (fused_head_ref runs anywhere)"
    if dtype != torch.bfloat16:
        return f"needs torch.bfloat16 features, got {dtype}"
    if c < 16 or c > 256 or c & (c - 1):
        return f"needs C a power of two in [16, 256] (a program holds all channels of its pixels), got C={c}"
    return _TRITON_REASON if needs_triton else None


def fused_head_unsupported_reason(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor,
                                  bias: Tensor | None) -> str | None:
    """Why fused_head would refuse these arguments (shape errors included), or None: for a caller's fallback."""
    try:
        check_fused_head(features, cache, gamma, weight, bias)
    except ValueError as err:
        return str(err)
    if features.requires_grad or (cache is not None and cache.requires_grad):
        return "no backward: inputs require grad"
    return _kernel_reason(features.shape[1], features.dtype, features.device.type)


# --------------------------------------------------------------------------- PyTorch twin


def activate_ref(features: Tensor, gamma: Tensor, eps: float, scale: float) -> Tensor:
    """kernels.head.activate with an explicit scale: F.normalize in (at least) fp32 * scale * gamma, rounded to
    features.dtype, then SiLU. Bit-equal to it for scale = sqrt(C) (same expression, same order)."""
    compute = torch.promote_types(features.dtype, torch.float32)
    c = features.shape[1]
    y = F.normalize(features.to(compute), dim=1, eps=eps) * scale * gamma.to(compute).reshape(1, c, 1, 1, 1)
    return F.silu(y.to(features.dtype))


def fused_head_ref(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
                   eps: float, scale: float, patch: int = 0) -> tuple[Tensor, Tensor]:
    """The same maths in PyTorch: activation as OutputHead, g by conv_n128_ref (fp32 sum, rounded to the
    features' dtype), head_stencil_ref. Any device, any float dtype. Returns (out, new_cache) like fused_head."""
    check_fused_head(features, cache, gamma, weight, bias)
    b, c, t, h, w = features.shape
    act = activate_ref(features, gamma, eps, scale)
    if cache is None:
        cache = act.new_zeros(b, c, CAUSAL, h, w)
    window = torch.cat([cache, act], dim=2)
    g = _split.conv_n128_ref(window, _split.pack_weight(weight).to(window.dtype)).contiguous()
    out = _split.head_stencil_ref(g, _split._bias32(weight, bias), t, 0, h, h, 0, patch)
    return out, window[:, :, -CAUSAL:].contiguous()


# --------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _bf16(x, INTERP: tl.constexpr):
        """fp32 -> bf16, round to nearest even. The interpreter (triton 3.9) truncates in .to(tl.bfloat16),
        so there the rounding is done on the bits; on the GPU it is the native cvt.rn."""
        if INTERP:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def _dot(a, w, acc, INTERP: tl.constexpr):
        """bf16 x bf16 -> fp32 accumulate. The interpreter (triton 3.9) multiplies bf16 as raw uint16 bits, so
        there the operands are widened to fp32 first: exact products, the same maths."""
        if INTERP:
            return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, w, acc)

    @triton.jit
    def _inv_norm(x_fr, pm, sxc, eps, C: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr):
        """1 / max(||x||_2, eps) per pixel over all C channels (F.normalize's denominator), in BK-channel chunks.
        The activation pass reads the chunks again (from L1/L2): holding [BLOCK_M, C] in registers spilled."""
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kc in range(0, C, BK):
            x = tl.load(x_fr + kc * sxc, mask=pm[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        return tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(ss), eps))  # once per pixel; elementwise it is a multiply

    @triton.jit
    def _act(x, inv, gs, INTERP: tl.constexpr):
        """Raw bf16 chunk -> bf16(silu(bf16(x * inv * scale * gamma))): RMSNorm's rounding, then F.silu's."""
        y = _bf16(x.to(tl.float32) * inv[:, None] * gs[None, :], INTERP).to(tl.float32)
        return _bf16(y / (1.0 + tl.exp(-y)), INTERP)  # F.silu on bf16: fp32 math, one rounding

    @triton.jit
    def _roll_frame(x_fr, nc_fr, nc_cs, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps, pa, pb, pc,
                    C: tl.constexpr, N: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                    NDOT: tl.constexpr, STORE: tl.constexpr, INTERP: tl.constexpr):
        """One feature frame, activated chunk by chunk: tap 2 into pa (which it completes), tap 1 into pb, tap 0
        into pc (NDOT says how many of those output frames exist). STORE: it is a frame of the new cache."""
        inv = _inv_norm(x_fr, pm, sxc, eps, C, BK, BLOCK_M)
        for kc in range(0, C, BK):
            a = _act(tl.load(x_fr + kc * sxc, mask=pm[:, None], other=0.0), inv, tl.load(gs_ptr + kc + ck), INTERP)
            if STORE:
                tl.store(nc_fr + kc * nc_cs, a, mask=pm[:, None])
            wk = w_ptr + kc * N + w_tile
            pa = _dot(a, tl.load(wk + 2 * C * N), pa, INTERP)
            if NDOT >= 2:
                pb = _dot(a, tl.load(wk + C * N), pb, INTERP)
            if NDOT >= 3:
                pc = _dot(a, tl.load(wk), pc, INTERP)
        return pa, pb, pc

    @triton.jit
    def _head_g_roll(x_ptr, c_ptr, gs_ptr, w_ptr, g_ptr, nc_ptr,
                     T, HW, sxb, sxc, sxt, scb, scc, sct, eps,
                     C: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                     HAS_CACHE: tl.constexpr, INTERP: tl.constexpr):
        """One program: BLOCK_M pixels of one image, all T output frames, each window frame read once.
        Carried: pa = output frame j (taps 0, 1 summed in), pb = output frame j+1 (tap 0)."""
        b = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pm = p < HW
        ck = tl.arange(0, BK)
        n = tl.arange(0, N)
        w_tile = ck[:, None] * N + n[None, :]  # Wk [3, C, N]: chunk rows kc.. of tap k at w_ptr + (k*C + kc)*N
        x_fr = x_ptr + b * sxb + ck[None, :] * sxc + p[:, None]  # frame 0, channels 0..BK
        nc_fr = nc_ptr + b * (C * 2 * HW) + ck[None, :] * (2 * HW) + p[:, None]  # new cache: contiguous
        g_tile = g_ptr + (b * T * HW + p[:, None]) * G + n[None, :]  # g: dense [B, T, H*W, G]
        g_mask = pm[:, None] & (n[None, :] < G)
        zero = tl.zeros([BLOCK_M, N], dtype=tl.float32)

        pa = zero
        pb = zero
        if HAS_CACHE:
            c_fr = c_ptr + b * scb + ck[None, :] * scc + p[:, None]
            for kc in range(0, C, BK):
                a0 = tl.load(c_fr + kc * scc, mask=pm[:, None], other=0.0)
                a1 = tl.load(c_fr + kc * scc + sct, mask=pm[:, None], other=0.0)
                w0 = tl.load(w_ptr + kc * N + w_tile)
                pa = _dot(a0, w0, pa, INTERP)
                pa = _dot(a1, tl.load(w_ptr + (C + kc) * N + w_tile), pa, INTERP)
                pb = _dot(a1, w0, pb, INTERP)
                if T == 1:  # window frame 1 is the first frame of the new cache
                    tl.store(nc_fr + kc * (2 * HW), a1, mask=pm[:, None])
        else:
            if T == 1:  # ... and it is a causal zero frame
                for kc in range(0, C, BK):
                    tl.store(nc_fr + kc * (2 * HW), tl.zeros([BLOCK_M, BK], dtype=tl.bfloat16), mask=pm[:, None])

        # Feature frame j = window frame j+2. The last two frames do fewer dots (their later output frames do
        # not exist) and are the new cache, so they are peeled off the loop: no branches inside it.
        for j in range(T - 2):
            pa, pb, pc = _roll_frame(x_fr + j * sxt, nc_fr, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                     pa, pb, zero, C, N, BK, BLOCK_M, 3, False, INTERP)
            tl.store(g_tile + j * (HW * G), _bf16(pa, INTERP), mask=g_mask)
            pa = pb
            pb = pc
        if T >= 2:
            pa, pb, pc = _roll_frame(x_fr + (T - 2) * sxt, nc_fr, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                     pa, pb, zero, C, N, BK, BLOCK_M, 2, True, INTERP)
            tl.store(g_tile + (T - 2) * (HW * G), _bf16(pa, INTERP), mask=g_mask)
            pa = pb
        pa, pb, pc = _roll_frame(x_fr + (T - 1) * sxt, nc_fr + HW, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                 pa, zero, zero, C, N, BK, BLOCK_M, 1, True, INTERP)
        tl.store(g_tile + (T - 1) * (HW * G), _bf16(pa, INTERP), mask=g_mask)

    @triton.jit
    def _head_g_per_t(x_ptr, c_ptr, gs_ptr, w_ptr, g_ptr, nc_ptr,
                      T, HW, sxb, sxc, sxt, scb, scc, sct, eps,
                      C: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                      HAS_CACHE: tl.constexpr, INTERP: tl.constexpr):
        """One program: BLOCK_M pixels of output frame t. t varies fastest in the grid, so the T programs of a
        pixel block run together and the frames they share are read from L2."""
        pid = tl.program_id(0)
        t = pid % T
        b = tl.program_id(1).to(tl.int64)
        p = (pid // T) * BLOCK_M + tl.arange(0, BLOCK_M)
        pm = p < HW
        ck = tl.arange(0, BK)
        n = tl.arange(0, N)
        w_tile = w_ptr + ck[:, None] * N + n[None, :]
        x_fr = x_ptr + b * sxb + ck[None, :] * sxc + p[:, None]
        nc_fr = nc_ptr + b * (C * 2 * HW) + ck[None, :] * (2 * HW) + p[:, None]
        last = t == T - 1  # this program holds window frames T and T+1: the new cache
        # Below, `if k >= 1` is resolved at compile time (k is a static_range constant), `if last` at run time.
        acc = tl.zeros([BLOCK_M, N], dtype=tl.float32)
        for k in tl.static_range(3):
            s = t + k  # window frame
            w_k = w_tile + k * C * N
            if s < 2:
                if HAS_CACHE:
                    c_fr = c_ptr + b * scb + ck[None, :] * scc + p[:, None] + s * sct
                    for kc in range(0, C, BK):
                        a = tl.load(c_fr + kc * scc, mask=pm[:, None], other=0.0)
                        acc = _dot(a, tl.load(w_k + kc * N), acc, INTERP)
                        if k >= 1:
                            if last:
                                tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW), a, mask=pm[:, None])
                else:  # causal zero frame: no dot
                    if k >= 1:
                        if last:
                            for kc in range(0, C, BK):
                                tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW),
                                         tl.zeros([BLOCK_M, BK], dtype=tl.bfloat16), mask=pm[:, None])
            else:
                xs = x_fr + (s - 2) * sxt
                inv = _inv_norm(xs, pm, sxc, eps, C, BK, BLOCK_M)
                for kc in range(0, C, BK):
                    a = _act(tl.load(xs + kc * sxc, mask=pm[:, None], other=0.0), inv, tl.load(gs_ptr + kc + ck),
                             INTERP)
                    acc = _dot(a, tl.load(w_k + kc * N), acc, INTERP)
                    if k >= 1:
                        if last:
                            tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW), a, mask=pm[:, None])
        g_ptrs = g_ptr + ((b * T + t) * HW + p[:, None]) * G + n[None, :]
        tl.store(g_ptrs, _bf16(acc, INTERP), mask=pm[:, None] & (n[None, :] < G))

    _KERNELS = {"roll": _head_g_roll, "per_t": _head_g_per_t}
    _INTERPRETED = type(_head_g_roll).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import


def _flat_pixels(x: Tensor) -> Tensor:
    """x with H*W flattened at unit stride (the kernels index pixels as one run per frame and channel)."""
    _, _, _, h, w = x.shape
    if x.stride(4) == 1 and (h == 1 or x.stride(3) == w):
        return x
    return x.contiguous()  # e.g. channels_last_3d input: one copy (a channels-last kernel would avoid it)


def launch_head_g(features: Tensor, cache: Tensor | None, gs: Tensor, wk: Tensor, g: Tensor, new_cache: Tensor,
                  eps: float, *, variant: str = "roll", block_m: int = 64, block_k: int = 64,
                  num_warps: int = 8, num_stages: int = 2) -> None:
    """Raw launch of the g kernel into caller-made g [B, T, H, W, GC] (dense) and new_cache [B, C, 2, H, W]
    (contiguous). gs = scale*gamma fp32 [C], wk = pack_weight_taps(weight). No device check: CPU tensors run
    under TRITON_INTERPRET=1. Arguments as fused_head checks them."""
    if triton is None:
        raise RuntimeError(f"launch_head_g: {_TRITON_REASON}")
    if variant not in VARIANTS:
        raise ValueError(f"launch_head_g: variant must be one of {VARIANTS}, got {variant!r}")
    for name, v in (("block_m", block_m), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"launch_head_g: {name} must be a power of two >= 16 (tl.dot tiles), got {v}")
    b, c, t, h, w = features.shape
    hw = h * w
    if tuple(g.shape) != (b, t, h, w, GC) or not g.is_contiguous():
        raise ValueError(f"launch_head_g: g must be contiguous {(b, t, h, w, GC)}, got {tuple(g.shape)}")
    if tuple(new_cache.shape) != (b, c, CAUSAL, h, w) or not new_cache.is_contiguous():
        raise ValueError(f"launch_head_g: new_cache must be contiguous {(b, c, CAUSAL, h, w)}")
    if tuple(wk.shape) != (3, c, N_PAD) or not wk.is_contiguous() or gs.shape != (c,) or not gs.is_contiguous():
        raise ValueError(f"launch_head_g: wk must be [3, {c}, {N_PAD}] and gs [{c}], contiguous")
    features = _flat_pixels(features)
    cache = None if cache is None else _flat_pixels(cache)
    # Inside one image, offsets are int32 (the kernels widen only the batch offset).
    for name, x in (("features", features), ("cache", cache)):
        if x is not None and x.stride(1) * (c - 1) + x.stride(2) * (x.shape[2] - 1) + hw >= 2**31:
            raise ValueError(f"launch_head_g: one image of {name} spans >= 2**31 elements; split it")
    if t * hw * GC >= 2**31 or c * 2 * hw >= 2**31:
        raise ValueError("launch_head_g: g or new_cache of one image would span >= 2**31 elements; split T or H")
    if b > 65535:
        raise ValueError(f"launch_head_g: B={b} > 65535 (grid y)")
    cache_arg = features if cache is None else cache  # any valid pointer; unused when HAS_CACHE is False
    ints = (t, hw, features.stride(0), features.stride(1), features.stride(2),
            cache_arg.stride(0), cache_arg.stride(1), cache_arg.stride(2))
    npb = triton.cdiv(hw, block_m)
    grid = (npb if variant == "roll" else npb * t, b)
    cfg = (variant, block_m, min(block_k, c), num_warps, num_stages)
    _KERNELS[variant][grid](
        features, cache_arg, gs, wk, g, new_cache, *ints, float(eps),
        C=c, N=N_PAD, G=GC, BLOCK_M=block_m, BK=cfg[2], HAS_CACHE=cache is not None, INTERP=_INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    if features.is_cuda:
        _compiled.add(_specialisation(features.device, cfg, c, cache is not None, ints))


# Triton compiles one binary per specialisation: int arguments equal to 1 become constants, multiples of 16 get a
# divisibility hint (pointers too; fresh allocations are 16-byte aligned). Recorded after each launch, so
# spec_ready can tell whether a call would compile (not allowed in the middle of a CUDA-graph capture).
_compiled: set = set()


def _specialisation(device, cfg: tuple, c: int, has_cache: bool, ints: tuple) -> tuple:
    return (str(torch.device(device)), cfg, c, has_cache, tuple((v == 1, v % 16 == 0) for v in ints))


def _contiguous_ints(c: int, t: int, h: int, w: int, has_cache: bool) -> tuple:
    """launch_head_g's int arguments for contiguous features and cache (without a cache, features stand in)."""
    hw = h * w
    x = (c * t * hw, t * hw, hw)
    return (t, hw, *x, *((c * 2 * hw, 2 * hw, hw) if has_cache else x))


def _hopper_module(variant: str):
    """head_cuda or head_wgmma (plain kernel modules: launch and shape rules; the glue around them is here),
    imported when first named, since they need Triton's Gluon or NVRTC."""
    from . import head_cuda, head_wgmma

    return {CUDA_SM90: head_cuda, HOPPER: head_wgmma}[variant]


def _variant(variant: str, features: Tensor, cache: Tensor | None) -> str:
    """The g kernel for a config's variant: "auto" takes the first of the CUDA, Gluon and Triton kernels that runs
    the call as it is; a named variant is returned as it is (fused_head_with checks it)."""
    if variant != "auto":
        return variant
    for name in (CUDA_SM90, HOPPER):
        if _hopper_module(name).unsupported_reason(features, cache) is None:
            return name
    return "roll"


def _hopper_operands(variant: str, features: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """features and cache for a named Hopper g kernel: ValueError where its shape rule refuses the call; contiguous
    copies where only the frames' alignment is wrong (TMA needs 16-byte aligned bases and strides)."""
    mod = _hopper_module(variant)
    b, c, t, h, w = features.shape
    why = mod.shape_reason(c, t, h, w, features.device) if variant == HOPPER else mod.shape_reason(c, h, w,
                                                                                                 features.device)
    if why is None and variant == CUDA_SM90 and mod._failure:
        why = mod._failure[0]
    if why is not None:
        raise ValueError(f"fused_head: variant {variant!r} cannot run this call: {why}")
    if frames_tma_reason(features, cache) is not None:
        features, cache = _dense_aligned(features), None if cache is None else _dense_aligned(cache)
    return features, cache


def _dense_aligned(t: Tensor) -> Tensor:
    """t as a contiguous tensor with a 16-byte aligned base (a fresh copy where t is not one already)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def fused_head_with(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
                    eps: float, scale: float, config: dict | None = None, patch: int = 0) -> tuple[Tensor, Tensor]:
    """fused_head with an explicit kernel config (variant, block_m, num_warps, num_stages; the sm_90 variants
    "cuda_sm90" and "wgmma", which "auto" prefers, have no other settings); the bench sweeps it. A named variant
    runs or raises ValueError naming why it cannot; "auto" takes the first that runs."""
    check_fused_head(features, cache, gamma, weight, bias)
    b, c, t, h, w = features.shape
    reason = _kernel_reason(c, features.dtype, features.device.type)
    if reason is not None:
        raise ValueError(f"fused_head: {reason}")
    if not per_sample_offsets_fit(features, cache) or _shape_reason(c, t, h, w):
        return fused_head_ref(features, cache, gamma, weight, bias, eps, scale, patch)  # too large for the kernel
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    features = _flat_pixels(features)
    cache = None if cache is None else _flat_pixels(cache)
    auto = cfg["variant"] == "auto"
    cfg["variant"] = _variant(cfg["variant"], features, cache)
    if cfg["variant"] in (CUDA_SM90, HOPPER):
        features, cache = _hopper_operands(cfg["variant"], features, cache)
    elif cfg["variant"] not in VARIANTS:
        raise ValueError(f"fused_head: variant must be one of {('auto', CUDA_SM90, HOPPER, *VARIANTS)}, "
                         f"got {cfg['variant']!r}")
    wk, b32, gs = _derived_weights(weight, bias, gamma, scale, cfg["variant"])
    g = features.new_empty((b, t, h, w, GC))
    new_cache = features.new_empty((b, c, CAUSAL, h, w))
    if POISON:
        g.fill_(float("nan"))
        new_cache.fill_(float("nan"))
    with torch.cuda.device(features.device):  # Triton launches on the current stream of the current device
        if cfg["variant"] == CUDA_SM90:
            head_cuda = _hopper_module(CUDA_SM90)
            try:
                head_cuda.launch(features, cache, gs, wk, g, new_cache, eps)
            except RuntimeError as err:  # NVRTC or the driver refused it: remembered (the row's rule says so)
                head_cuda.give_up(err)
                if not auto:
                    raise
                return fused_head_with(features, cache, gamma, weight, bias, eps, scale, config, patch)
        elif cfg["variant"] == HOPPER:
            _hopper_module(HOPPER).launch(features, cache, gs, wk, g, new_cache, eps)
        else:
            launch_head_g(features, cache, gs, wk, g, new_cache, eps, **cfg)
    # The stencil op's CUDA implementation, called directly: this is already inside an op.
    return _split.head_stencil_cuda(g, b32, t, 0, h, h, 0, patch), new_cache


@torch.library.custom_op("taesd_fast::fused_head", mutates_args=())
def fused_head(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
               eps: float, scale: float, patch: int = 0, variant: str = "auto") -> tuple[Tensor, Tensor]:
    """OutputHead in two kernels: features [B, C, T, H, W] (raw, before the RMS norm), cache [B, C, 2, H, W]
    (activated; None = first chunk, zero frames) -> (out [B, C_out, T, H, W] bf16 channels_last_3d clamped to
    [-1, 1], or with patch p >= 1 the video kernels.head.unpatchify(out, p) contiguous; new_cache [B, C, 2, H, W]
    contiguous). CUDA bf16 only. variant: the g kernel ("auto", "cuda_sm90", "wgmma", "roll", "per_t")."""
    return fused_head_with(features, cache, gamma, weight, bias, eps, scale, {"variant": variant}, patch)


def head_full_variant(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
                      eps: float, patch: int, variant: str) -> tuple[Tensor, Tensor]:
    """dispatch.head_full's signature with one g kernel: (unpatchify(clamp(conv3d([cache | silu(rms_norm(x))]),
    -1, 1)), new cache), with rms_norm's scale sqrt(C) (kernels.head.rms_norm). Traced as the op; an eager call
    skips the op layer (its Python is a noticeable part of an eager call's host time) and runs what the op would."""
    if torch.compiler.is_compiling():
        return fused_head(x, cache, gamma, weight, bias, eps, x.shape[1] ** 0.5, patch, variant)
    return fused_head_with(x, cache, gamma, weight, bias, eps, x.shape[1] ** 0.5, {"variant": variant}, patch)


def _triton_variant() -> str:
    return DEFAULT_CONFIG["variant"] if DEFAULT_CONFIG["variant"] in VARIANTS else "roll"


def head_full_triton(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
                     eps: float, patch: int = 0) -> tuple[Tensor, Tensor]:
    """Row "triton_fused"'s run: head_full_variant with the Triton g kernel (DEFAULT_CONFIG's, "roll" unless set)."""
    return head_full_variant(x, cache, gamma, weight, bias, eps, patch, _triton_variant())


run = head_full_triton


def contract_spec_reason(spec, needs_triton: bool = True) -> str | None:
    """The fused head's rule for a dispatch.Spec of kind "head_full" (x_shape = features [B, C, T, H, W];
    spec.residual = cache given), shared by the three g-kernel rows. needs_triton=False for the CUDA g kernel."""
    if len(spec.x_shape) != 5 or len(spec.w_shape) != 5 or tuple(spec.w_shape[2:]) != (3, 3, 3):
        return "needs features [B, C, T, H, W] and weight [C_out, C, 3, 3, 3]"
    b, c, t = spec.x_shape[:3]
    if spec.w_shape[1] != c or 9 * spec.w_shape[0] > GC:
        return f"needs weight [C_out, {c}, 3, 3, 3] with 9*C_out <= {GC}"
    if max(b, t) > 65535:
        return "B or T > 65535"
    return _shape_reason(c, t, *spec.x_shape[3:]) or _kernel_reason(c, spec.dtype, spec.device.split(":")[0],
                                                                   needs_triton)


def spec_unsupported_reason(spec) -> str | None:
    """Row "triton_fused": the contract, with Triton."""
    return contract_spec_reason(spec)


def cuda_spec_unsupported_reason(spec) -> str | None:
    """Row "cuda_fused" (the CUDA C++ g kernel, head_cuda): the contract, its shape rule, no earlier compile failure
    (NVRTC itself is checked by the dispatcher for rows marked nvrtc)."""
    reason = contract_spec_reason(spec, needs_triton=False)
    if reason is None:
        head_cuda = _hopper_module(CUDA_SM90)
        b, c, t, h, w = spec.x_shape
        reason = head_cuda.shape_reason(c, h, w, spec.device) or (head_cuda._failure[0] if head_cuda._failure else None)
    return reason


def cuda_row_ready(spec) -> bool:
    """Row "cuda_fused": the kernel for C and the stencil are loaded (safe inside a CUDA-graph capture)."""
    return stencil_ready(spec) and _hopper_module(CUDA_SM90).spec_ready(spec.device, spec.x_shape[1])


def run_cuda(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
             patch: int = 0) -> tuple[Tensor, Tensor]:
    """Row "cuda_fused"'s run: head_full_variant with the CUDA C++ g kernel."""
    return head_full_variant(x, cache, gamma, weight, bias, eps, patch, CUDA_SM90)


def gluon_spec_unsupported_reason(spec) -> str | None:
    """Row "gluon_fused" (the Gluon g kernel, head_wgmma): the contract, then its shape rule."""
    reason = contract_spec_reason(spec)
    if reason is None:
        b, c, t, h, w = spec.x_shape
        reason = _hopper_module(HOPPER).shape_reason(c, t, h, w, spec.device)
    return reason


def gluon_row_ready(spec) -> bool:
    """Row "gluon_fused": this shape's kernel and the stencil are loaded (safe inside a CUDA-graph capture)."""
    b, c, t, h, w = spec.x_shape
    return stencil_ready(spec) and _hopper_module(HOPPER).spec_ready(spec.device, b, c, t, h, w, bool(spec.residual))


def run_gluon(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
              patch: int = 0) -> tuple[Tensor, Tensor]:
    """Row "gluon_fused"'s run: head_full_variant with the Gluon g kernel."""
    return head_full_variant(x, cache, gamma, weight, bias, eps, patch, HOPPER)


def stencil_ready(spec) -> bool:
    """True once the stencil for this spec (C_out, patch) is loaded on its device."""
    from .. import _backend

    defines = _split.stencil_defines(spec.w_shape[0], patch=spec.patch)
    return _backend.is_loaded("head_bf16.cu", "head_stencil", defines, spec.device)


def spec_ready(spec) -> bool:
    """True once this shape's Triton g kernel (contiguous inputs, the default config: what head_full_triton
    launches) and the stencil are loaded: launching then compiles nothing, so it is safe inside a CUDA-graph capture."""
    b, c, t, h, w = spec.x_shape
    cfg = DEFAULT_CONFIG
    key = _specialisation(spec.device, (_triton_variant(), cfg["block_m"], min(cfg["block_k"], c), cfg["num_warps"],
                                        cfg["num_stages"]), c, bool(spec.residual),
                          _contiguous_ints(c, t, h, w, bool(spec.residual)))
    return key in _compiled and stencil_ready(spec)


@fused_head.register_fake
def _fused_head_fake(features, cache, gamma, weight, bias, eps, scale, patch=0, variant="auto"):
    check_fused_head(features, cache, gamma, weight, bias)
    b, c, t, h, w = features.shape
    out = _split._new_out(features, b, weight.shape[0], t, h, w, patch)
    return out, features.new_empty((b, c, CAUSAL, h, w))
