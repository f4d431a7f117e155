"""Row "split_bf16" (kinds head and head_full): the Wan head's causal 3x3x3 conv in two steps, a temporal conv to
9 taps x C_out (conv_n128, here), then the 9-tap stencil (head_stencil.py).

    g[b, t, h, w, (i*3+j)*C_out + c] = sum_k sum_cin W[c, cin, k, i, j] * x[b, cin, t+k, h, w]   conv_n128
    out[b, c, t, h, w] = clamp(bias[c] + sum_ij g[b, t, h+i-1, w+j-1, (i*3+j)*C_out + c], -1, 1)  head_stencil

g has GC=112 channels (108 used) in bf16, channels innermost, so the stencil reads 224 bytes per pixel
instead of the 256-channel input nine times. conv_n128 has two CUDA forms, picked by x's layout:
  * NCDHW x: one cuBLAS GEMM per batch, g^T = x viewed as [C*(T+2), H*W] (no copy) times a block-Toeplitz
    weight [C*(T+2), T*GC]; g comes out pixel-major (B, H, W, T, GC). Half the Toeplitz is zeros at T=4,
    but it reads x once and needs no layout conversion (cuDNN's NCDHW 3x1x1 conv is ~3x slower).
  * channels_last_3d x: cuDNN's 3x1x1 conv to GC channels; g comes out dense (B, T, H, W, GC).
conv_n128 is a torch.library op with a PyTorch twin (conv_n128_ref, fp32 math) that runs on CPU.

Kind head runs split_head_conv on the activated window; kind head_full (`run`) computes the window in PyTorch
(head_math: norm, SiLU, cache) and then the same conv.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .derived import derived as _derived
from .head_g_layout import GC, pack_weight  # g channels per pixel (9 taps x 12 outputs, padded)
from .head_math import activate, causal_window
from .head_stencil import bias32, head_stencil, new_out, stencil_ready

_CL3D = torch.channels_last_3d
NAME = "split_bf16"

__all__ = ["conv_n128", "conv_n128_ref", "toeplitz_weight", "split_head_conv", "window_spec", "run",
           "spec_unsupported_reason", "spec_ready"]


# --------------------------------------------------------------------------- weights


def toeplitz_weight(w_packed: Tensor, T: int) -> Tensor:
    """[N, C, 3, 1, 1] -> [C*(T+2), T*N]: row c*(T+2)+s, column t*N+n holds w_packed[n, c, s-t]
    (0 where s-t is not in 0..2)."""
    n, c = w_packed.shape[:2]
    wk = w_packed.reshape(n, c, 3).permute(1, 2, 0)  # [C, 3, N]
    wt = w_packed.new_zeros((c, T + 2, T, n))
    for t in range(T):
        wt[:, t: t + 3, t] = wk
    return wt.reshape(c * (T + 2), T * n)


# --------------------------------------------------------------------------- layouts


def _is_cl(x: Tensor) -> bool:
    # Channels innermost (also true of a row slice of a channels_last_3d x): cuDNN then runs NDHWC.
    return x.shape[1] > 1 and x.stride(1) == 1


def _gemm_ok(x: Tensor) -> bool:
    """x (or a row slice of it) is NCDHW-ordered: viewable as a [C*(T+2), rows*W] matrix with unit column stride."""
    _, _, s, h, w = x.shape
    return (not _is_cl(x) and x.stride(4) == 1 and x.stride(3) == w and x.stride(1) == s * x.stride(2)
            and x.stride(2) >= h * w)


def _empty_g(x: Tensor, n: int) -> Tensor:
    """g [B, T, H, W, n] in the memory order conv_n128 produces for this x (fake, twin and kernel agree)."""
    b, _, s, h, w = x.shape
    if _gemm_ok(x):
        return x.new_empty((b, h, w, s - 2, n)).permute(0, 3, 1, 2, 4)  # pixel-major, the GEMM's output
    return x.new_empty((b, s - 2, h, w, n))


# --------------------------------------------------------------------------- checks


def _check_conv_n128(x: Tensor, w_packed: Tensor) -> None:
    if x.dim() != 5:
        raise ValueError(f"conv_n128: x must be [B, C_in, T+2, H, W], got shape {tuple(x.shape)}")
    if w_packed.dim() != 5 or tuple(w_packed.shape[2:]) != (3, 1, 1) or w_packed.shape[1] != x.shape[1]:
        raise ValueError(
            f"conv_n128: w_packed must be [N, {x.shape[1]}, 3, 1, 1] (see pack_weight), got {tuple(w_packed.shape)}"
        )
    if x.shape[2] < 3:
        raise ValueError(f"conv_n128: x needs T+2 >= 3 frames (2 causal frames in front), got {x.shape[2]}")


# --------------------------------------------------------------------------- conv_n128


def conv_n128_ref(x: Tensor, w_packed: Tensor) -> Tensor:
    """PyTorch twin (fp32 math): x [B, C_in, T+2, H, W], w_packed [N, C_in, 3, 1, 1] -> g [B, T, H, W, N], x.dtype."""
    _check_conv_n128(x, w_packed)
    y = F.conv3d(x.float(), w_packed.float())  # [B, N, T, H, W]
    return _empty_g(x, w_packed.shape[0]).copy_(y.permute(0, 2, 3, 4, 1))


def _conv_n128_cudnn(x: Tensor, w_packed: Tensor) -> Tensor:
    """cuDNN 3x1x1 conv; weight layout matched to x's so cuDNN copies neither."""
    w = w_packed.to(x.dtype).contiguous(memory_format=_CL3D if _is_cl(x) else torch.contiguous_format)
    y = F.conv3d(x, w).permute(0, 2, 3, 4, 1)  # dense already when x is channels-last
    g = _empty_g(x, w_packed.shape[0])
    return y if y.stride() == g.stride() else g.copy_(y)


@contextlib.contextmanager
def _fp32_reduction():
    """PyTorch lets cuBLAS split K and add the partial sums in bf16 by default. Measured on H200: a 16-row band
    (small M) then differed from the full frame by 3e-3 relative. Forbid it for our GEMM (a global flag, restored)."""
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction
    try:
        old = (old, m.allow_bf16_reduced_precision_reduction_split_k)  # torch >= 2.12 has a split-K flag too
    except AttributeError:
        pass
    m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction = old


def _conv_n128_gemm(x: Tensor, w_packed: Tensor, wt: Tensor | None = None) -> Tensor:
    """g^T = x as [C*(T+2), rows*W] (a strided view) times the block-Toeplitz weight; needs _gemm_ok(x)."""
    b, c, s, h, w = x.shape
    n = w_packed.shape[0]
    if wt is None:
        wt = toeplitz_weight(w_packed.to(x.dtype), s - 2)
    xm = x.as_strided((b, c * s, h * w), (x.stride(0), x.stride(2), 1))
    g = _empty_g(x, n)
    gm = g.permute(0, 2, 3, 1, 4).view(b, h * w, (s - 2) * n)  # the dense (B, H, W, T, N) storage
    with _fp32_reduction():
        for i in range(b):
            torch.mm(xm[i].t(), wt, out=gm[i])  # xm[i].t() has unit row stride: cuBLAS reads it transposed, no copy
    return g


@torch.library.custom_op("taesd_fast::conv_n128", mutates_args=())
def conv_n128(x: Tensor, w_packed: Tensor) -> Tensor:
    """Temporal 3x1x1 conv to N = w_packed.shape[0] channels, channels innermost: g [B, T, H, W, N], x.dtype."""
    return conv_n128_ref(x, w_packed)


@conv_n128.register_kernel("cuda")
def _conv_n128_cuda(x: Tensor, w_packed: Tensor) -> Tensor:
    _check_conv_n128(x, w_packed)
    if _gemm_ok(x):
        t = x.shape[2] - 2
        wt = _derived.get(w_packed, ("toeplitz", t, x.dtype), lambda: toeplitz_weight(w_packed.to(x.dtype), t))
        return _conv_n128_gemm(x, w_packed, wt)
    return _conv_n128_cudnn(x, w_packed)


@conv_n128.register_fake
def _conv_n128_fake(x: Tensor, w_packed: Tensor) -> Tensor:
    _check_conv_n128(x, w_packed)
    return _empty_g(x, w_packed.shape[0])


# --------------------------------------------------------------------------- the head conv (kind "head")


def _pack_for(weight: Tensor, cl: bool) -> Tensor:
    wp = pack_weight(weight)
    # cuDNN picks its layout from input and weight: matching x's layout avoids a copy of x or of g.
    return wp.contiguous(memory_format=_CL3D) if cl else wp.contiguous()


def split_head_conv(x: Tensor, weight: Tensor, bias: Tensor | None, band_rows: int | None = None,
                    patch: int = 0) -> Tensor:
    """clamp(conv3d(x, weight, bias, padding=(0, 1, 1)), -1, 1) via conv_n128 + head_stencil: the run of kind head.

    x: [B, C_in, T+2, H, W] post-SiLU features with the 2 causal frames in front; weight [C_out, C_in, 3, 3, 3].
    Returns [B, C_out, T, H, W], channels_last_3d, or with patch p >= 1 unpatchify(that, p), contiguous.
    band_rows bounds g to band_rows+2 rows at a time.
    """
    if x.dim() != 5 or weight.dim() != 5 or tuple(weight.shape[2:]) != (3, 3, 3) or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"split_head_conv: need x [B, C_in, T+2, H, W] and weight [C_out, C_in, 3, 3, 3] with matching C_in, "
            f"got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if 9 * weight.shape[0] > GC:
        raise ValueError(f"split_head_conv: C_out={weight.shape[0]} needs 9*C_out <= {GC}")
    bsz, _, t2, h, w = x.shape
    c_out, t = weight.shape[0], t2 - 2
    cl = _is_cl(x)
    if torch.compiler.is_compiling():  # data_ptr-keyed caches do not trace; the packing fuses anyway
        wp = _pack_for(weight, cl)
    else:
        wp = _derived.get(weight, ("packed", cl), lambda: _pack_for(weight, cl))
    b32 = bias32(weight, bias)
    if band_rows is None or band_rows >= h:
        return head_stencil(conv_n128(x, wp), b32, t, 0, h, h, 0, patch)
    if band_rows < 1:
        raise ValueError(f"split_head_conv: band_rows must be >= 1, got {band_rows}")
    out = new_out(x, bsz, c_out, t, h, w, patch)
    p = max(patch, 1)
    for lo in range(0, h, band_rows):
        rows = min(band_rows, h - lo)
        g = conv_n128(x[:, :, :, max(lo - 1, 0): min(lo + rows + 1, h)], wp)
        out[:, :, :, lo * p: (lo + rows) * p].copy_(head_stencil(g, b32, t, lo, rows, h, 1, patch))
    return out


# --------------------------------------------------------------------------- the row (kinds head and head_full)


def window_spec(spec):
    """The conv's spec inside a head_full call: the causal window has 2 more frames than the features (the patch
    selects the stencil kernel that writes the video)."""
    b, c, t, h, w = spec.x_shape
    return dataclasses.replace(spec, kind="head", x_shape=(b, c, t + 2, h, w), stride=1, residual=False, relu=False)


def spec_unsupported_reason(spec) -> str | None:
    """The row's rule for a dispatch.Spec of kind head (x_shape = the window) or head_full (x_shape = the features,
    checked as the window they make); kernel availability is checked by dispatch itself."""
    if spec.kind == "head_full":
        if len(spec.x_shape) != 5:
            return f"features {tuple(spec.x_shape)}: expected [B, C, T, H, W]"
        spec = window_spec(spec)
    x_shape, w_shape = spec.x_shape, spec.w_shape
    if not spec.device.startswith("cuda"):
        return "needs a CUDA tensor"
    if spec.dtype != torch.bfloat16:
        return "bf16 only"
    if len(x_shape) != 5 or len(w_shape) != 5 or tuple(w_shape[2:]) != (3, 3, 3) or w_shape[1] != x_shape[1]:
        return "needs x [B, C_in, T+2, H, W] and weight [C_out, C_in, 3, 3, 3]"
    if 9 * w_shape[0] > GC:
        return f"C_out={w_shape[0]}: 9*C_out must be <= {GC}"
    if x_shape[2] < 3:
        return "needs T+2 >= 3 frames"
    if max(x_shape[0], x_shape[2] - 2) > 65535:
        return "B or T > 65535"
    return None


def spec_ready(spec) -> bool:
    """True once the stencil for this spec is loaded (no compile or module load mid CUDA-graph capture); the conv
    is cuBLAS or cuDNN. The same for both kinds."""
    return stencil_ready(spec)


def run(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
        patch: int = 0) -> tuple[Tensor, Tensor]:
    """Kind head_full: (unpatchify(clamp(conv3d([cache | silu(rms_norm(x))]), -1, 1)), new cache), the norm, SiLU
    and window in PyTorch and the conv by split_head_conv."""
    window = causal_window(activate(x, gamma, eps), cache)
    return split_head_conv(window, weight, bias, patch=patch), window[:, :, -2:]
