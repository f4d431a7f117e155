"""Split form of the Wan head's causal 3x3x3 conv: a temporal conv to 9 taps x C_out, then a 9-tap stencil.

    g[b, t, h, w, (i*3+j)*C_out + c] = sum_k sum_cin W[c, cin, k, i, j] * x[b, cin, t+k, h, w]   conv_n128
    out[b, c, t, h, w] = clamp(bias[c] + sum_ij g[b, t, h+i-1, w+j-1, (i*3+j)*C_out + c], -1, 1)  head_stencil

g has GC=112 channels (108 used) in bf16, channels innermost, so the stencil reads 224 bytes per pixel
instead of the 256-channel input nine times. conv_n128 has two CUDA forms, picked by x's layout:
  * NCDHW x: one cuBLAS GEMM per batch, g^T = x viewed as [C*(T+2), H*W] (no copy) times a block-Toeplitz
    weight [C*(T+2), T*GC]; g comes out pixel-major (B, H, W, T, GC). Half the Toeplitz is zeros at T=4,
    but it reads x once and needs no layout conversion (cuDNN's NCDHW 3x1x1 conv is ~3x slower).
  * channels_last_3d x: cuDNN's 3x1x1 conv to GC channels; g comes out dense (B, T, H, W, GC).
head_stencil is our NVRTC kernel (csrc/head_bf16.cu) and reads either g layout through strides.
Both ops are torch.library ops with PyTorch twins (`*_ref`, fp32 math) that run on CPU.

Row bands: head_stencil computes output rows [lo, lo+rows) of an image of height H_global from a g that
holds global rows [max(lo-g_off, 0), min(lo+rows+g_off, H_global)): g_off halo rows on each side,
clipped at the true image border, which is exactly what conv_n128 gives on the matching row slice of x.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .derived import derived as _derived
from .head_g_layout import GC  # g channels per pixel (9 taps x 12 outputs, padded)
from .head_math import activate, causal_window, rms_norm, unpatchify

_CL3D = torch.channels_last_3d

__all__ = [
    "GC", "rms_norm", "activate", "causal_window", "unpatchify", "conv_n128", "conv_n128_ref", "head_stencil",
    "head_stencil_ref", "launch_head_stencil", "pack_weight", "toeplitz_weight", "split_head_conv", "stencil_defines",
    "head_stencil_cuda",
    "spec_unsupported_reason", "spec_ready", "window_spec", "head_full_split", "head_full_spec_unsupported_reason",
    "head_full_spec_ready",
]


# --------------------------------------------------------------------------- weights


def pack_weight(weight: Tensor, gc: int = GC) -> Tensor:
    """[C_out, C_in, 3, 3, 3] -> [gc, C_in, 3, 1, 1] with row (i*3+j)*C_out + c = W[c, :, :, i, j]; pad rows 0."""
    c_out, c_in = weight.shape[:2]
    wp = weight.permute(3, 4, 0, 1, 2).reshape(9 * c_out, c_in, 3)
    wp = F.pad(wp, (0, 0, 0, 0, 0, gc - 9 * c_out))
    return wp.reshape(gc, c_in, 3, 1, 1)


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


# --------------------------------------------------------------------------- head_stencil


def _new_out(like: Tensor, b: int, nch: int, depth: int, rows: int, w: int, patch: int = 0) -> Tensor:
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
    out = _new_out(g, b, nch, depth, rows, w, patch)
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
    out = _new_out(g, b, bias.shape[0], depth, rows, w, patch)
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
    return _new_out(g, g.shape[0], bias.shape[0], depth, rows, g.shape[3], patch)


# --------------------------------------------------------------------------- the full head conv


def _unsupported(device_type: str, x_shape, w_shape, dtype: torch.dtype) -> str | None:
    if device_type != "cuda":
        return "needs a CUDA tensor"
    if dtype != torch.bfloat16:
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


def spec_unsupported_reason(spec) -> str | None:
    """Dispatch-table form (a dispatch.Spec; kernel availability is checked by dispatch itself)."""
    return _unsupported(spec.device.split(":")[0], spec.x_shape, spec.w_shape, spec.dtype)


def spec_ready(spec) -> bool:
    """True once the stencil kernel for this shape is loaded (no compile/module load mid CUDA-graph capture)."""
    from .. import _backend

    return _backend.is_loaded("head_bf16.cu", "head_stencil", stencil_defines(spec.w_shape[0], patch=spec.patch),
                              spec.device)


def _pack_for(weight: Tensor, cl: bool) -> Tensor:
    wp = pack_weight(weight)
    # cuDNN picks its layout from input and weight: matching x's layout avoids a copy of x or of g.
    return wp.contiguous(memory_format=_CL3D) if cl else wp.contiguous()


def _bias32(weight: Tensor, bias: Tensor | None) -> Tensor:
    return (weight.new_zeros(weight.shape[0]) if bias is None else bias).float().contiguous()


def split_head_conv(x: Tensor, weight: Tensor, bias: Tensor | None, band_rows: int | None = None,
                    patch: int = 0) -> Tensor:
    """clamp(conv3d(x, weight, bias, padding=(0, 1, 1)), -1, 1) via conv_n128 + head_stencil.

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
        wp, b32 = _pack_for(weight, cl), _bias32(weight, bias)
    else:
        wp = _derived.get(weight, ("packed", cl), lambda: _pack_for(weight, cl))
        b32 = _derived.get(weight if bias is None else bias, ("bias32", bias is None), lambda: _bias32(weight, bias))
    if band_rows is None or band_rows >= h:
        return head_stencil(conv_n128(x, wp), b32, t, 0, h, h, 0, patch)
    if band_rows < 1:
        raise ValueError(f"split_head_conv: band_rows must be >= 1, got {band_rows}")
    out = _new_out(x, bsz, c_out, t, h, w, patch)
    p = max(patch, 1)
    for lo in range(0, h, band_rows):
        rows = min(band_rows, h - lo)
        g = conv_n128(x[:, :, :, max(lo - 1, 0): min(lo + rows + 1, h)], wp)
        out[:, :, :, lo * p: (lo + rows) * p].copy_(head_stencil(g, b32, t, lo, rows, h, 1, patch))
    return out


# --------------------------------------------------------------------------- the whole head (kind "head_full")


def window_spec(spec):
    """The split conv's spec inside a head_full call: the causal window has 2 more frames than the features (the
    patch selects the stencil kernel that writes the video)."""
    b, c, t, h, w = spec.x_shape
    return dataclasses.replace(spec, kind="head", x_shape=(b, c, t + 2, h, w), stride=1, residual=False, relu=False)


def head_full_spec_unsupported_reason(spec) -> str | None:
    """Row "split_bf16" of kind head_full: PyTorch's norm + SiLU + window, then split_head_conv."""
    if len(spec.x_shape) != 5:
        return f"features {tuple(spec.x_shape)}: expected [B, C, T, H, W]"
    return spec_unsupported_reason(window_spec(spec))


def head_full_spec_ready(spec) -> bool:
    return spec_ready(window_spec(spec))


def head_full_split(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                    patch: int = 0) -> tuple[Tensor, Tensor]:
    """The head_full signature: (unpatchify(clamp(conv3d([cache | silu(rms_norm(x))]), -1, 1)), new cache), the
    norm, SiLU and window in PyTorch and the conv by split_head_conv."""
    window = causal_window(activate(x, gamma, eps), cache)
    return split_head_conv(window, weight, bias, patch=patch), window[:, :, -2:]
