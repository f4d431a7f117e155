"""What every tensor-core conv row does around its kernel: argument checks and NHWC operands before the launch,
the torch.compile route through the conv3x3_tc op (a row's run), and the record of what was launched (a row's
spec_ready)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from . import conv_op
from .conv_contract import check_conv_args, conv_shape_reason, new_out
from .device import is_sm90
from .tma_pdl import aligned_nhwc, pdl_args

__all__ = ["ConvCall", "contiguous_bias", "conv_row_run", "launch_checked", "launched", "mark_launched",
           "mem_operands", "on_device", "prepare", "route", "sm90_spec_reason", "spec_launched"]


@dataclass
class ConvCall:
    """A checked call's operands: x and residual dense NHWC, b contiguous, out the fresh channels_last output.
    copied is non-empty when a copy of the bias was made in this call (then no PDL: see tma_pdl.pdl_args)."""

    x: Tensor
    b: Tensor | None
    residual: Tensor | None
    out: Tensor
    copied: list


def prepare(op: str, x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int,
            upsample: int = 1, tma: bool = False) -> ConvCall:
    """Check the call (ValueError naming the problem) and lay the operands out for the kernel. Inputs in another
    layout are copied to channels_last (one extra pass; the rows say they read channels_last natively). tma: also
    give x and residual a 16-byte aligned base, copying where a view starts at an odd offset (TMA needs it)."""
    out_shape = check_conv_args(op, x, w, b, residual, stride, upsample)
    nhwc = aligned_nhwc if tma else (lambda t: None if t is None else t.contiguous(memory_format=torch.channels_last))
    x, residual = nhwc(x), nhwc(residual)
    b, copied = contiguous_bias(b)
    return ConvCall(x, b, residual, new_out(out_shape, x), copied)


def contiguous_bias(b: Tensor | None) -> tuple[Tensor | None, list]:
    """(b contiguous, copied): copied is ["bias copy"] when that took a copy in this call (then no PDL:
    tma_pdl.pdl_args), else empty."""
    if b is None or b.is_contiguous():
        return b, []
    return b.contiguous(), ["bias copy"]


def mem_operands(name: str, x: Tensor, memory: Tensor | None, b: Tensor | None, frames: int,
                 reason: str | None) -> tuple[Tensor, Tensor | None, Tensor | None, list]:
    """The memory-block conv rows' common start (triton_mem_conv, cuda_mem_conv): refuse the call (ValueError
    naming the row and `reason`, the kernel's own limit, or a memory that does not match x in samples of `frames`
    frames), then x and the memory dense NHWC with a 16-byte aligned base and b contiguous. Returns (x, memory, b,
    copied), copied as contiguous_bias gives it."""
    if reason is None and memory is not None and (memory.shape[0] * frames != x.shape[0]
                                                   or memory.shape[1:] != x.shape[1:]):
        reason = f"memory {tuple(memory.shape)} does not match x {tuple(x.shape)} in samples of {frames} frames"
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    x = aligned_nhwc(x)
    memory = None if memory is None else aligned_nhwc(memory.to(x.dtype))
    b, copied = contiguous_bias(b)
    return x, memory, b, copied


def launch_checked(variant: str, x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int,
                   relu: bool, upsample: int, pre_clamp: bool, refuse: str | None, packed, kernel,
                   extra=()) -> Tensor:
    """The eager launch of a Hopper conv row: check the call (the contract, then `refuse`: the row's own reason, or
    None; ValueError naming it), lay out the operands for TMA, pack the weight (packed() -> (weight, packed_now)),
    launch (kernel(call, weight, pdl_args)) on x's device, and record the launch. Returns the channels_last output."""
    call = prepare(variant, x, w, b, residual, stride, upsample, tma=True)
    if refuse is not None:
        raise ValueError(f"{variant}: {refuse}")
    wp, packed_now = packed()
    with on_device(call.x):
        kernel(call, wp, pdl_args(call.x, packed_now + call.copied))
    mark_launched(variant, call.x, w, stride, upsample, pre_clamp, b is not None, residual is not None, relu, extra)
    return call.out


def on_device(x: Tensor):
    """Launch on x's device (current stream); entering a device context costs CPU time, so only when it differs."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def route(variant: str, launch, x: Tensor, w: Tensor, b: Tensor | None, stride: int, residual: Tensor | None,
          relu: bool, upsample: int, pre_clamp: bool) -> Tensor:
    """A row's `run`: the eager launch on CUDA; through the conv3x3_tc op while torch.compile traces (and on CPU,
    where the op runs its twin or, under the interpreter, this same kernel)."""
    if torch.compiler.is_compiling() or not x.is_cuda:
        return conv_op.conv3x3_tc(x, w, b, residual, stride, relu, upsample, pre_clamp, variant)
    return launch(x, w, b, residual, stride, relu, upsample, pre_clamp)


def conv_row_run(variant: str, launch):
    """A tensor-core conv row's `run` (the dispatcher's conv2d signature), routed as above; also registers `launch`
    with the conv3x3_tc op, so that the op can run this row's kernel once its module is imported."""
    conv_op.register(variant, launch)

    def run(x: Tensor, w: Tensor, b: Tensor | None, stride: int, residual: Tensor | None, relu: bool,
            upsample: int = 1, pre_clamp: bool = False) -> Tensor:
        return route(variant, launch, x, w, b, stride, residual, relu, upsample, pre_clamp)

    return run


_launched: set = set()  # (variant, device, compile key) of every launch in this process


def _key(variant: str, device, x_shape, w_shape, stride, upsample, pre_clamp, bias, residual, relu, extra) -> tuple:
    return (variant, str(torch.device(device)), tuple(w_shape[:2]), int(stride), int(upsample), bool(pre_clamp),
            bool(bias), bool(residual), bool(relu), extra)


def mark_launched(variant: str, x: Tensor, w: Tensor, stride: int, upsample: int, pre_clamp: bool, bias: bool,
                  residual: bool, relu: bool, extra=()) -> None:
    """Record a successful launch. extra: what else selects the compiled binary (a config, the input shape)."""
    _launched.add(_key(variant, x.device, x.shape, w.shape, stride, upsample, pre_clamp, bias, residual, relu, extra))


def launched(variant: str, x: Tensor, w: Tensor, stride: int, upsample: int, pre_clamp: bool, bias: bool,
             residual: bool, relu: bool, extra=()) -> bool:
    """Whether a launch with these arguments (as mark_launched records them) ran in this process."""
    key = _key(variant, x.device, x.shape, w.shape, stride, upsample, pre_clamp, bias, residual, relu, extra)
    return key in _launched


def spec_launched(variant: str, spec, extra=()) -> bool:
    """True once a launch with this spec's compile key ran in this process: launching again compiles and loads
    nothing, so a CUDA-graph capture may launch it."""
    return _key(variant, spec.device, spec.x_shape, spec.w_shape, spec.stride, spec.upsample,
                spec.pre_clamp, spec.bias, spec.residual, spec.relu, extra) in _launched


def sm90_device_reason(spec, library_error: str | None) -> str | None:
    """Why a Hopper kernel cannot run this call here, or None: a CPU tensor, the kernel's library not importable
    (library_error: why not, or None), not an sm_90 GPU."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    if library_error is not None:
        return library_error
    if not is_sm90(spec.device):
        return "needs an sm_90 GPU (wgmma, TMA)"
    return None


def sm90_spec_reason(spec, library_error: str | None) -> str | None:
    """The common start of a Hopper conv2d row's rule: sm90_device_reason, then the conv contract."""
    return (sm90_device_reason(spec, library_error)
            or conv_shape_reason(spec.x_shape, spec.w_shape, spec.dtype, spec.stride, spec.upsample))
