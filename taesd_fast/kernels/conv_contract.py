"""The contract every f16 3x3 conv kernel shares: which arguments are valid, the output's shape and layout, and the
reference maths the kernels approximate.

    y = conv2d(up(c(x)), w, b, stride, padding=1) (+ residual); relu(y) if relu
    up = nearest 2x upsample if upsample == 2 else identity;  c = 3*tanh(x/3) if pre_clamp else identity
    x: [B, C_in, H, W] f16   w: [C_out, C_in, 3, 3] f16   b: [C_out] f16 | None
    residual: [B, C_out, Ho, Wo] f16 | None;  Ho = 2H (upsample) or (H - 1) // stride + 1

The epilogue (+ bias, + residual, ReLU) is computed in fp32 on the accumulator and rounded to f16 once. Each kernel
module adds its own limits (channels, stride, upsample, GPU) on top of `conv_shape_reason`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MAX_PIXELS", "POISON_OUTPUT", "check_conv_args", "check_f16_operands", "conv3x3_math",
           "conv_shape_reason", "f16_3x3_reason", "grow_weight_reason", "new_out", "output_shape"]

MAX_PIXELS = 2**31 - 2**20  # pixel indices are int32 in the tensor-core kernels (element offsets are int64)
POISON_OUTPUT = False  # tests set this: NaN-fill every kernel's output before launch, so unwritten elements show


def output_shape(x_shape, w_shape, stride: int, upsample: int = 1) -> tuple:
    B, _, H, W = x_shape
    if upsample == 2:
        return (B, w_shape[0], 2 * H, 2 * W)
    return (B, w_shape[0], (H - 1) // stride + 1, (W - 1) // stride + 1)


def f16_3x3_reason(x_shape, w_shape, dtype, stride: int, max_channels: int) -> str | None:
    """The checks every f16 3x3 conv kernel shares: dtype, a 3x3 weight, 1..max_channels channels each way, x
    matching the weight, stride 1 or 2. Shapes only: no tensors."""
    if dtype != torch.float16:
        return f"dtype {dtype} (expected torch.float16)"
    if len(w_shape) != 4 or tuple(w_shape[2:]) != (3, 3):
        return f"weight shape {tuple(w_shape)} is not a 3x3 conv [C_out, C_in, 3, 3]"
    c_out, c_in = w_shape[0], w_shape[1]
    if not (1 <= c_in <= max_channels and 1 <= c_out <= max_channels):
        return f"C_in={c_in}, C_out={c_out} (expected 1..{max_channels} each)"
    if len(x_shape) != 4 or x_shape[1] != c_in:
        return f"input shape {tuple(x_shape)} does not match weight C_in={c_in} (expected [B, {c_in}, H, W]; no groups)"
    if stride not in (1, 2):
        return f"stride {stride} (expected 1 or 2)"
    return None


def conv_shape_reason(x_shape, w_shape, dtype, stride: int, upsample: int = 1, max_channels: int = 256) -> str | None:
    """f16_3x3_reason, then the upsample fold's rule (2x, stride 1 only), a non-empty input and int32 pixel indices."""
    reason = f16_3x3_reason(x_shape, w_shape, dtype, stride, max_channels)
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
    if max(B * H * W, B * Ho * Wo) >= MAX_PIXELS:
        return f"B*H*W={B * H * W}, B*Ho*Wo={B * Ho * Wo} pixels (expected < {MAX_PIXELS})"
    return None


def check_f16_operands(op: str, x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None,
                       dtype_error: type[Exception] = TypeError) -> None:
    """f16 operands on x's device, x 4-D. Raises naming op and operand."""
    for name, t in (("x", x), ("w", w), ("b", b), ("residual", residual)):
        if t is not None and t.dtype != torch.float16:
            raise dtype_error(f"{op}: {name} must be torch.float16, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [B, C_in, H, W], got shape {tuple(x.shape)}")


def check_conv_args(op: str, x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int,
                    upsample: int = 1) -> tuple:
    """Validate a tensor-core conv call; raise ValueError naming what is wrong and what was expected. Returns the
    output shape."""
    check_f16_operands(op, x, w, b, residual, dtype_error=ValueError)
    reason = conv_shape_reason(x.shape, w.shape, x.dtype, stride, upsample)
    if reason is not None:
        raise ValueError(f"{op}: {reason}")
    c_out = w.shape[0]
    if b is not None and tuple(b.shape) != (c_out,):
        raise ValueError(f"{op}: b must have shape ({c_out},), got {tuple(b.shape)}")
    out_shape = output_shape(x.shape, w.shape, stride, upsample)
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"{op}: residual must have the output shape {out_shape}, got {tuple(residual.shape)}")
    return out_shape


def grow_weight_reason(x: Tensor, grow_w: Tensor, grow: int) -> str | None:
    """Why grow_w is not the TGrow weight a grow launch on x takes ([grow * C, C, 1, 1], x's dtype and device), or
    None."""
    c = x.shape[1]
    if tuple(grow_w.shape) == (grow * c, c, 1, 1) and grow_w.dtype == x.dtype and grow_w.device == x.device:
        return None
    return (f"grow_w must be a ({grow * c}, {c}, 1, 1) {x.dtype} tensor on {x.device} for grow={grow} and C={c}, got "
            f"{tuple(grow_w.shape)} {grow_w.dtype} on {grow_w.device}")


def new_out(shape, like: Tensor) -> Tensor:
    """The kernels' channels_last f16 output (NaN-filled when POISON_OUTPUT is set)."""
    out = torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=torch.channels_last)
    return out.fill_(float("nan")) if POISON_OUTPUT else out


def conv3x3_math(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                 upsample: int = 1, pre_clamp: bool = False, dtype: torch.dtype | None = None) -> Tensor:
    """The contract's maths op by op in PyTorch (clamp, upsample, conv, + bias + residual, ReLU), computed in `dtype`
    (default: x's). float64 gives the reference the tests measure errors against; x's own f16 gives what the model
    runs without kernels. Uses the unfolded 3x3 weight: the function the kernels approximate."""
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
