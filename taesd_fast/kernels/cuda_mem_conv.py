"""The TAEHV memory block's first conv at 64 channels as two launches of the CUDA C++ row-streaming conv (row
"cuda_mem_conv", kind "mem_conv"; csrc/conv_row_sm90.cu).

conv(cat([x, past]), W) + b is conv(past, W_past) + b + conv(x, W_x). The first launch runs the kernel's past mode:
each output frame reads its input rows from x's previous frame, or for a sample's first frame from the memory
(zeros without one), so the past frames are never gathered. The second launch is the plain 64->64 conv of x with the
first's output as its residual, then ReLU. Each launch keeps its 64 x 64 weight taps resident in shared memory; one
kernel over both halves would need twice that (144 KB) and does not leave room for its row buffers. The past half is
rounded to f16 once between the launches (the tests bound the error by 2x PyTorch's own f16 conv on the
concatenation).
"""

from __future__ import annotations

from torch import Tensor

from . import cuda_conv_rows
from .conv_contract import conv_shape_reason, new_out
from .conv_launch import mem_operands, on_device, sm90_device_reason
from .conv_pack import pack_weight, packed_weight, plan
from .tma_pdl import pdl_args

NAME = "cuda_mem_conv"
C = cuda_conv_rows.C


def unsupported_reason(x_shape, w_shape, dtype, frames: int) -> str | None:
    """Why the kernel cannot take the call (None: it can), from shapes only."""
    c_in, c_out = w_shape[1], w_shape[0]
    if c_in != 2 * x_shape[1]:
        return f"weight takes {c_in} channels, expected 2 x the input's {x_shape[1]} (x and its past)"
    reason = conv_shape_reason((x_shape[0], c_in, *x_shape[2:]), w_shape, dtype, 1)
    if reason is not None:
        return reason
    if x_shape[1] != C or c_out != C:
        return f"{x_shape[1]} channels per half -> {c_out} (the CUDA row kernel does {C} -> {C})"
    if x_shape[3] <= 64:
        return f"W={x_shape[3]} (<= 64: strips of {cuda_conv_rows.STRIP} columns would be mostly padding)"
    if frames < 1 or x_shape[0] % frames:
        return f"{x_shape[0]} frames do not split into samples of {frames}"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90, the CUDA row kernel not failed in this process (NVRTC itself is checked
    by the dispatcher for rows marked nvrtc), channels_last, then the shapes."""
    why = sm90_device_reason(spec, cuda_conv_rows._failure[0] if cuda_conv_rows._failure else None)
    if why is not None:
        return why
    if spec.layout != "channels_last":
        return f"{spec.layout} input (reads channels_last)"
    return unsupported_reason(spec.x_shape, spec.w_shape, spec.dtype, spec.frames)


def spec_ready(spec) -> bool:
    """True once the CUDA row kernel's module is loaded on this device."""
    return cuda_conv_rows.spec_ready(spec)


def _halves(w: Tensor) -> tuple[Tensor, Tensor, list]:
    """(x half packed, past half packed, packed_now) of the weight [64, 128, 3, 3], cached per weight."""
    p = plan(C, C, 1)
    halves = []
    packed_now: list = []
    for tag, part in (("cuda_mem_conv_x", slice(0, C)), ("cuda_mem_conv_past", slice(C, 2 * C))):
        wp, now = packed_weight(w, 1, p, tag=tag, build=lambda part=part: pack_weight(w.detach()[:, part], 1, p))
        halves.append(wp)
        packed_now += now
    return halves[0], halves[1], packed_now


def mem_conv_launch(x: Tensor, memory: Tensor | None, w: Tensor, b: Tensor | None, frames: int,
                    relu: bool) -> Tensor:
    """conv2d(cat([x, past]), w, b, padding=1) (ReLU'd if relu) for x [B*frames, 64, H, W], where past is each
    frame's predecessor within its sample and memory[s] ([B, 64, H, W]; zeros when None) for sample s's first frame.
    Returns the channels_last output. ValueError where the kernel cannot take the call."""
    reason = unsupported_reason(tuple(x.shape), tuple(w.shape), x.dtype, frames)
    x, memory, b, copied = mem_operands(NAME, x, memory, b, frames, reason)
    w_x, w_past, packed_now = _halves(w)
    rows = cuda_conv_rows.program_rows(x)
    pdl = pdl_args(x, packed_now + copied)["PDL"]
    past, out = new_out(x.shape, x), new_out(x.shape, x)
    with on_device(x):
        try:
            cuda_conv_rows.launch(x, w_past, b, None, past, False, rows, pdl, frames=frames, memory=memory)
            cuda_conv_rows.launch(x, w_x, None, past, out, relu, rows, pdl)
        except RuntimeError as e:  # NVRTC or the driver refused it
            cuda_conv_rows.give_up(e)
            raise
    return out


def run(x: Tensor, memory: Tensor | None, w: Tensor, b: Tensor | None, frames: int, relu: bool) -> Tensor:
    """The dispatcher's mem_conv entry."""
    return mem_conv_launch(x, memory, w, b, frames, relu)
