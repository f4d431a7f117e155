"""What the fused-head rows share around their g kernels: rows "cuda_fused" (cuda_fused.py), "gluon_fused"
(gluon_fused.py) and "triton_fused" (triton_fused.py) each compute g and the new cache in one kernel straight from the
raw features; everything else is here, once:

    A_s = cache[:, :, s]                                   s < 2   (the activated causal frames)
        = bf16(silu(bf16(rmsnorm_fp32(features[:, :, s-2]))))   s >= 2
    g[b, t, h, w, n] = sum_{k<3} sum_cin A_{t+k}[b, cin, h, w] * Wk[k, cin, n]     (fp32 sum, stored bf16)
    out = head_stencil(g, bias)        [B, 12, T, H, W] bf16 channels_last_3d, clamped to [-1, 1]; with patch p
                                       the video [B, 12/p², T, H*p, W*p], which the stencil writes directly
    new_cache = A_T, A_{T+1}           [B, C, 2, H, W] bf16, what OutputHead returns as its cache

Here: the argument checks and the shared part of the rows' rules, the packed weights (Wk [3, C, 128] for the Triton
kernel, W^T [3, 112, C] for the Hopper ones), the PyTorch twin (fused_head_ref: any device, any float dtype), the
driver around a row's g kernel (fused_head_with: flat pixels, g and new-cache buffers, the stencil), and the op
`taesd_fast::fused_head`, which names its row: no kernel is chosen here (the dispatcher measures, dispatch/decide.py).
Each row module provides `launch_g(features, cache, gs, weight, g, new_cache, eps)` and its `run = row_run(NAME)`.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .derived import derived
from .head_g_layout import CAUSAL, GC, pack_weight
from .head_stencil import bias32, head_stencil_cuda, head_stencil_ref, new_out
from .split_bf16 import conv_n128_ref
from .tma_pdl import frames_tma_reason

N_PAD = 128  # Wk's columns: the Triton kernel's tl.dot needs a power of two
FUSED_ROWS = ("cuda_fused", "gluon_fused", "triton_fused")
POISON = False  # tests set this: NaN-fill g and the new cache before the kernel, so unwritten elements show
_INT32 = 2**31

__all__ = ["FUSED_ROWS", "activate_ref", "check_fused_head", "contract_spec_reason", "flat_pixels", "fused_head",
           "fused_head_ref", "fused_head_unsupported_reason", "fused_head_with", "hopper_operands", "kernel_reason",
           "offsets_reason", "pack_weight_taps", "pack_weight_taps_t", "packed_taps", "per_sample_offsets_fit",
           "row_run", "scaled_gamma"]


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


def per_sample_offsets_fit(*tensors: Tensor | None) -> bool:
    """The Triton head kernels compute offsets inside one batch element in int32 (the batch index is int64): every
    element of a sample must lie within 2**31 elements of the sample's first one. A whole long video at once
    (C * T * H * W >= 2**31, e.g. 256 x 38 frames x 352 x 640) does not."""
    return all(t is None or sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])) < _INT32 for t in tensors)


def offsets_reason(c: int, t: int, h: int, w: int) -> str | None:
    """Why one contiguous sample of this shape (with its 2 cached frames) does not fit int32 offsets, or None."""
    if c * (t + CAUSAL) * h * w >= _INT32:
        return f"one sample of C*(T+2)*H*W = {c * (t + CAUSAL) * h * w} elements does not fit int32 offsets"
    return None


def kernel_reason(c: int, dtype: torch.dtype, device_type: str) -> str | None:
    """What every g kernel needs of the call: CUDA, bf16, C a power of two in [16, 256]."""
    if device_type != "cuda":
        return f"needs CUDA tensors, got {device_type} (fused_head_ref runs anywhere)"
    if dtype != torch.bfloat16:
        return f"needs torch.bfloat16 features, got {dtype}"
    if c < 16 or c > 256 or c & (c - 1):
        return f"needs C a power of two in [16, 256] (a program holds all channels of its pixels), got C={c}"
    return None


def fused_head_unsupported_reason(features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor,
                                  bias: Tensor | None) -> str | None:
    """Why fused_head would refuse these arguments (shape errors included), or None: for a caller's fallback."""
    try:
        check_fused_head(features, cache, gamma, weight, bias)
    except ValueError as err:
        return str(err)
    if features.requires_grad or (cache is not None and cache.requires_grad):
        return "no backward: inputs require grad"
    return kernel_reason(features.shape[1], features.dtype, features.device.type)


def contract_spec_reason(spec) -> str | None:
    """The start of every fused row's rule, for a dispatch.Spec of kind "head_full" (x_shape = features
    [B, C, T, H, W]; spec.residual = cache given); each row adds its kernel's own limits."""
    if len(spec.x_shape) != 5 or len(spec.w_shape) != 5 or tuple(spec.w_shape[2:]) != (3, 3, 3):
        return "needs features [B, C, T, H, W] and weight [C_out, C, 3, 3, 3]"
    b, c, t = spec.x_shape[:3]
    if spec.w_shape[1] != c or 9 * spec.w_shape[0] > GC:
        return f"needs weight [C_out, {c}, 3, 3, 3] with 9*C_out <= {GC}"
    if max(b, t) > 65535:
        return "B or T > 65535"
    return offsets_reason(c, t, *spec.x_shape[3:]) or kernel_reason(c, spec.dtype, spec.device.split(":")[0])


# --------------------------------------------------------------------------- operands


def pack_weight_taps(weight: Tensor, n_pad: int = N_PAD) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> Wk [3, C_in, n_pad] bf16: Wk[k, cin, n] = pack_weight(weight)[n, cin, k]
    (zero columns for n >= 9*C_out)."""
    wp = pack_weight(weight, n_pad)  # [n_pad, C_in, 3, 1, 1]
    return wp.reshape(n_pad, weight.shape[1], 3).permute(2, 1, 0).to(torch.bfloat16).contiguous()


def pack_weight_taps_t(weight: Tensor) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> W^T [3, GC, C_in] bf16, the Hopper g kernels' layout: pack_weight_taps per tap
    transposed, its GC used columns as rows (K contiguous, as wgmma's B operand in shared memory wants)."""
    return pack_weight_taps(weight)[:, :, :GC].transpose(1, 2).contiguous()


def packed_taps(weight: Tensor, transposed: bool) -> Tensor:
    """pack_weight_taps (transposed=False) or pack_weight_taps_t, cached on the weight like split_head_conv's."""
    pack = pack_weight_taps_t if transposed else pack_weight_taps
    with torch.no_grad():  # parameters require grad; the cached copies must not hold autograd graphs
        return derived.get(weight, ("fused_taps_t" if transposed else "fused_taps",), lambda: pack(weight))


def scaled_gamma(gamma: Tensor, scale: float) -> Tensor:
    """scale * gamma as a flat fp32 vector (what the norm multiplies by), cached on gamma."""
    with torch.no_grad():
        build = lambda: (gamma.float().reshape(-1) * scale).contiguous()  # noqa: E731
        return derived.get(gamma, ("scaled_gamma", float(scale)), build)


def flat_pixels(x: Tensor) -> Tensor:
    """x with H*W flattened at unit stride (the kernels index pixels as one run per frame and channel)."""
    _, _, _, h, w = x.shape
    if x.stride(4) == 1 and (h == 1 or x.stride(3) == w):
        return x
    return x.contiguous()  # e.g. channels_last_3d input: one copy (a channels-last kernel would avoid it)


def hopper_operands(row: str, why: str | None, features: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """features and cache for a Hopper g kernel (TMA loads): ValueError where the row's shape rule refuses the call
    (`why`); contiguous copies with 16-byte aligned bases where only the frames' alignment is wrong."""
    if why is not None:
        raise ValueError(f"fused_head: row {row!r} cannot run this call: {why}")
    if frames_tma_reason(features, cache) is not None:
        features, cache = _dense_aligned(features), None if cache is None else _dense_aligned(cache)
    return features, cache


def _dense_aligned(t: Tensor) -> Tensor:
    """t as a contiguous tensor with a 16-byte aligned base (a fresh copy where t is not one already)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


# --------------------------------------------------------------------------- PyTorch twin


def activate_ref(features: Tensor, gamma: Tensor, eps: float, scale: float) -> Tensor:
    """head_math.activate with an explicit scale: F.normalize in (at least) fp32 * scale * gamma, rounded to
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
    g = conv_n128_ref(window, pack_weight(weight).to(window.dtype)).contiguous()
    out = head_stencil_ref(g, bias32(weight, bias), t, 0, h, h, 0, patch)
    return out, window[:, :, -CAUSAL:].contiguous()


# --------------------------------------------------------------------------- the driver, the op, the rows' run

_launchers: dict = {}


def _launch_g(row: str):
    """The named row's g-kernel launch (its module's launch_g), imported at its first use."""
    launch = _launchers.get(row)
    if launch is None:
        if row not in FUSED_ROWS:
            raise ValueError(f"fused_head: row must be one of {FUSED_ROWS}, got {row!r}")
        launch = _launchers[row] = importlib.import_module(f"{__package__}.{row}").launch_g
    return launch


def fused_head_with(row: str, features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor,
                    bias: Tensor | None, eps: float, scale: float, patch: int = 0, **config) -> tuple[Tensor, Tensor]:
    """fused_head run eagerly with the g kernel of `row` (one of FUSED_ROWS); `config`: that kernel's settings
    (the Triton kernel's variant and tiles; the bench sweeps them). The row runs the call or raises ValueError
    naming why it cannot; a sample too large for int32 offsets runs the twin."""
    launch_g = _launch_g(row)
    check_fused_head(features, cache, gamma, weight, bias)
    b, c, t, h, w = features.shape
    reason = kernel_reason(c, features.dtype, features.device.type)
    if reason is not None:
        raise ValueError(f"fused_head: {reason}")
    if not per_sample_offsets_fit(features, cache) or offsets_reason(c, t, h, w):
        return fused_head_ref(features, cache, gamma, weight, bias, eps, scale, patch)  # too large for the kernels
    features = flat_pixels(features)
    cache = None if cache is None else flat_pixels(cache)
    g = features.new_empty((b, t, h, w, GC))
    new_cache = features.new_empty((b, c, CAUSAL, h, w))
    if POISON:
        g.fill_(float("nan"))
        new_cache.fill_(float("nan"))
    with torch.cuda.device(features.device):  # Triton launches on the current stream of the current device
        launch_g(features, cache, scaled_gamma(gamma, scale), weight, g, new_cache, eps, **config)
    # The stencil op's CUDA implementation, called directly: this is already inside an op.
    return head_stencil_cuda(g, bias32(weight, bias), t, 0, h, h, 0, patch), new_cache


@torch.library.custom_op("taesd_fast::fused_head", mutates_args=())
def fused_head(row: str, features: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None,
               eps: float, scale: float, patch: int = 0) -> tuple[Tensor, Tensor]:
    """OutputHead in two kernels, the g kernel of `row` (one of FUSED_ROWS): features [B, C, T, H, W] (raw, before
    the RMS norm), cache [B, C, 2, H, W] (activated; None = first chunk, zero frames) -> (out [B, C_out, T, H, W]
    bf16 channels_last_3d clamped to [-1, 1], or with patch p >= 1 the video head_math.unpatchify(out, p)
    contiguous; new_cache [B, C, 2, H, W] contiguous). CUDA bf16 only."""
    return fused_head_with(row, features, cache, gamma, weight, bias, eps, scale, patch)


@fused_head.register_fake
def _fused_head_fake(row, features, cache, gamma, weight, bias, eps, scale, patch=0):
    check_fused_head(features, cache, gamma, weight, bias)
    b, c, t, h, w = features.shape
    out = new_out(features, b, weight.shape[0], t, h, w, patch)
    return out, features.new_empty((b, c, CAUSAL, h, w))


def row_run(row: str):
    """A fused row's `run`, dispatch.head_full's signature: (unpatchify(clamp(conv3d([cache |
    silu(rms_norm(x))]), -1, 1)), new cache), with rms_norm's scale sqrt(C) (head_math.rms_norm). Traced as the
    op; an eager call skips the op layer (its Python is a noticeable part of an eager call's host time) and runs
    what the op would."""

    def run(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
            patch: int = 0) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            return fused_head(row, x, cache, gamma, weight, bias, eps, x.shape[1] ** 0.5, patch)
        return fused_head_with(row, x, cache, gamma, weight, bias, eps, x.shape[1] ** 0.5, patch)

    return run
