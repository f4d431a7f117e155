"""taesd_fast::conv3x3_tc, the torch.library op through which torch.compile reaches the tensor-core conv kernels
(the conv_contract maths; `variant` names the kernel row that runs it).

Eager calls launch the kernels directly (each row's `run`): the op layer is what torch.compile needs, and at small
sizes its CPU cost per call is more than the kernel's GPU time. On CUDA the op launches exactly the named variant; on
CPU it runs the PyTorch twin (fp32 maths, one rounding), or under TRITON_INTERPRET=1 the named Triton kernel (tests).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .conv_contract import check_conv_args, conv3x3_math, new_out
from .triton_import import interpreting, triton_unavailable_reason

__all__ = ["DEFAULT_VARIANT", "conv3x3_tc", "conv3x3_tc_ref", "launcher", "register"]

DEFAULT_VARIANT = "triton_conv"  # the pointer kernel: every shape the contract allows, any CUDA GPU Triton runs on


def conv3x3_tc_ref(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                   upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """PyTorch twin: fp32 maths, one rounding to x.dtype, channels_last output."""
    out_shape = check_conv_args("conv3x3_tc", x, w, b, residual, stride, upsample)
    y = conv3x3_math(x, w, b, residual, stride, relu, upsample, pre_clamp, dtype=torch.float32)
    return new_out(out_shape, x).copy_(y)


_LAUNCHERS: dict[str, Callable[..., Tensor]] = {}  # row name -> its eager launch, filled as the modules load


def register(variant: str, launch: Callable[..., Tensor]) -> None:
    """Called by each tensor-core conv module at import: the op may then run that row's kernel. (The kernel modules
    import this one; this one imports none of them.)"""
    _LAUNCHERS[variant] = launch


def launcher(variant: str) -> Callable[..., Tensor]:
    """The eager launch function of the conv2d kernel row named `variant` (its module must be imported: a row's run
    imports it, and so does tracing through it)."""
    fn = _LAUNCHERS.get(variant)
    if fn is None:
        raise ValueError(f"conv3x3_tc: variant {variant!r} is not a loaded tensor-core conv row (loaded: "
                         f"{sorted(_LAUNCHERS)}; rows.KERNEL_ROWS names each row's module)")
    return fn


@torch.library.custom_op("taesd_fast::conv3x3_tc", mutates_args=())
def conv3x3_tc(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
               upsample: int, pre_clamp: bool, variant: str = DEFAULT_VARIANT) -> Tensor:
    """See the module docstring. CUDA: the named kernel (RuntimeError if Triton cannot run there); CPU: the twin,
    or the kernel itself under TRITON_INTERPRET=1."""
    check_conv_args("conv3x3_tc", x, w, b, residual, stride, upsample)
    if x.is_cuda or interpreting():
        reason = triton_unavailable_reason(x.device)
        if reason is not None:
            raise RuntimeError(f"conv3x3_tc: {reason}")
        return launcher(variant)(x, w, b, residual, stride, relu, upsample, pre_clamp)
    return conv3x3_tc_ref(x, w, b, residual, stride, relu, upsample, pre_clamp)


@conv3x3_tc.register_fake
def _(x, w, b, residual, stride, relu, upsample, pre_clamp, variant=DEFAULT_VARIANT):
    return new_out(check_conv_args("conv3x3_tc", x, w, b, residual, stride, upsample), x)
