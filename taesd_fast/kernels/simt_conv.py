"""taesd_fast::conv3x3_f16: the direct (SIMT, no tensor cores) 3x3 convs (pad 1, stride 1|2) on f16 NCHW, f32
accumulation, fused bias + residual + ReLU: rows "simt_f16_tile", "simt_f16_ocb4" and "simt_f16_rb". Kernels in
csrc/conv3x3_f16.cu (NVRTC, one compile per variant, channel counts and stride); `conv3x3_f16_ref` is the PyTorch
twin (same signature, same maths) that runs on CPU and that tests compare against.

The variants: "tile" (one output pixel per thread on 16x16 tiles), "ocb4" (4 output channels per thread, output
channel groups over blockIdx.z), "rb" (register-blocked: 4 or 8 output channels per thread, stride 1 only). They
read NCHW natively (channels_last inputs are copied to NCHW first), so the dispatcher offers them where the input
is NCHW: an NCHW model on CUDA, or backend="kernels".

    y = conv2d(x, w, b, stride, padding=1) (+ residual); relu(y) if relu
    x: [B, C_in, H, W] f16   w: [C_out, C_in, 3, 3] f16   b: [C_out] f16 | None
    residual: [B, C_out, Ho, Wo] f16 | None,  Ho = (H - 1) // stride + 1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .conv_contract import check_f16_operands, f16_3x3_reason

__all__ = ["VARIANTS", "MAX_CHANNELS", "conv3x3_f16", "kernel_defines", "conv3x3_f16_ref",
           "check_conv3x3_f16", "unsupported_reason", "spec_unsupported_reason", "spec_ready", "run"]

VARIANTS = ("tile", "ocb4", "rb")
MAX_CHANNELS = 64
_SOURCE = "conv3x3_f16.cu"
_GRID_Z_MAX = 65535  # kernels loop over grid.z, so a large B*groups is clamped, not refused
POISON_OUTPUT = False  # tests set this: NaN-fill the output before launch, so unwritten elements show


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_defines(c_in: int, c_out: int, stride: int, variant: str) -> dict[str, int]:
    """NVRTC -D defines for one kernel: one compile per (variant, C_in, C_out, stride)."""
    return {"CIN": c_in, "COUT": c_out, "STRIDE": stride, "VARIANT": VARIANTS.index(variant) + 1}


def _launch_shape(variant: str, B: int, c_out: int, Ho: int, Wo: int):
    """(grid, block); must mirror the tile constants in conv3x3_f16.cu (namespaces tile/ocb4/rb)."""
    if variant == "tile":
        return (_cdiv(Wo, 16), _cdiv(Ho, 16), min(B, _GRID_Z_MAX)), (16, 16, 1)
    if variant == "ocb4":
        ogb = min(2, _cdiv(c_out, 4))
        groups = _cdiv(c_out, 4 * ogb)
        return (_cdiv(Wo, 16), _cdiv(Ho, 8), min(B * groups, _GRID_Z_MAX)), (16, 8, ogb)
    oct_ = 4 if c_out <= 4 else 8  # rb: output channels per thread
    ogb = min(4, _cdiv(c_out, oct_))
    groups = _cdiv(c_out, oct_ * ogb)
    return (_cdiv(Wo, 16), _cdiv(Ho, 16), min(B * groups, _GRID_Z_MAX)), (8, 8, ogb)


def unsupported_reason(x_shape, w_shape, dtype, stride: int, variant: str) -> str | None:
    """Why (x, w, stride, variant) is outside what the kernels handle, or None. Shapes only: no tensors."""
    if variant not in VARIANTS:
        return f"unknown variant {variant!r} (expected one of {VARIANTS})"
    reason = f16_3x3_reason(x_shape, w_shape, dtype, stride, MAX_CHANNELS)
    if reason is not None:
        return reason
    if variant == "rb" and stride != 1:
        return "the register-blocked variant is stride 1 only"
    return None


def check_conv3x3_f16(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, variant: str):
    """Validate arguments; raise TypeError/ValueError naming what is wrong and what was expected."""
    check_f16_operands("conv3x3_f16", x, w, b, residual)
    reason = unsupported_reason(x.shape, w.shape, x.dtype, stride, variant)
    if reason is not None:
        raise ValueError(f"conv3x3_f16: {reason}")
    B, _, H, W = x.shape
    if B < 1 or H < 1 or W < 1:
        raise ValueError(f"conv3x3_f16: x must be non-empty, got shape {tuple(x.shape)}")
    if H * W >= 2**31:
        raise ValueError(f"conv3x3_f16: H*W={H * W} must be < 2**31 (32-bit plane indexing)")
    c_out = w.shape[0]
    if b is not None and tuple(b.shape) != (c_out,):
        raise ValueError(f"conv3x3_f16: b must have shape ({c_out},), got {tuple(b.shape)}")
    out_shape = (B, c_out, (H - 1) // stride + 1, (W - 1) // stride + 1)
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"conv3x3_f16: residual must have the output shape {out_shape}, got {tuple(residual.shape)}")
    return out_shape


def conv3x3_f16_ref(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                    variant: str = "tile") -> Tensor:
    """PyTorch twin: fp32 conv of the f16 values, + bias + residual, ReLU, one rounding to the input dtype."""
    y = F.conv2d(x.float(), w.float(), None if b is None else b.float(), stride=stride, padding=1)
    if residual is not None:
        y = y + residual.float()
    if relu:
        y = torch.relu(y)
    return y.to(x.dtype)


@torch.library.custom_op("taesd_fast::conv3x3_f16", mutates_args=())
def conv3x3_f16(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                variant: str) -> Tensor:
    out_shape = check_conv3x3_f16(x, w, b, residual, stride, variant)
    if x.device.type != "cuda":
        return conv3x3_f16_ref(x, w, b, residual, stride, relu, variant)
    from .._backend import get_kernel

    x, w = x.contiguous(), w.contiguous()
    b = None if b is None else b.contiguous()
    residual = None if residual is None else residual.contiguous()
    c_out, c_in = w.shape[0], w.shape[1]
    y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    if POISON_OUTPUT:
        y.fill_(float("nan"))
    kernel = get_kernel(_SOURCE, f"conv3x3_{variant}", kernel_defines(c_in, c_out, stride, variant), x.device)
    grid, block = _launch_shape(variant, out_shape[0], c_out, out_shape[2], out_shape[3])
    flags = (b is not None) * 1 | (residual is not None) * 2 | bool(relu) * 4
    B, _, H, W = x.shape
    with torch.cuda.device(x.device):  # launches go to this device's current stream
        kernel(grid, block, [x, w, b, residual, y, B, H, W, out_shape[2], out_shape[3], flags])
    return y


@conv3x3_f16.register_fake
def _(x, w, b, residual, stride, relu, variant):
    if x.dim() != 4 or w.dim() != 4:
        raise ValueError(f"conv3x3_f16: x and w must be 4-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    B, _, H, W = x.shape
    return x.new_empty((B, w.shape[0], (H - 1) // stride + 1, (W - 1) // stride + 1))


# --------------------------------------------------------------------------- the rows (one per variant)


def spec_unsupported_reason(spec, variant: str) -> str | None:
    """Row "simt_f16_<variant>"'s support rule: a CUDA tensor, no upsample or clamp fold, unsupported_reason."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    if spec.upsample != 1 or spec.pre_clamp:
        return "no upsample or clamp fold in the SIMT kernels"
    return unsupported_reason(spec.x_shape, spec.w_shape, spec.dtype, spec.stride, variant)


def spec_ready(spec, variant: str) -> bool:
    """True once this variant's module for the spec's channels and stride is loaded (no NVRTC compile mid-capture)."""
    from .._backend import is_loaded

    return is_loaded(_SOURCE, f"conv3x3_{variant}", kernel_defines(spec.w_shape[1], spec.w_shape[0], spec.stride,
                                                                 variant), spec.device)


def run(x: Tensor, w: Tensor, b: Tensor | None, stride: int, residual: Tensor | None, relu: bool,
        upsample: int = 1, pre_clamp: bool = False, variant: str = "tile") -> Tensor:
    """The dispatcher's conv2d signature for one variant (upsample and pre_clamp must be off: the rows refuse them)."""
    if upsample != 1 or pre_clamp:
        raise ValueError(f"conv3x3_f16: upsample={upsample}, pre_clamp={pre_clamp} (the SIMT kernels fold neither; "
                         "expected 1 and False)")
    return conv3x3_f16(x, w, b, residual, stride, relu, variant)
