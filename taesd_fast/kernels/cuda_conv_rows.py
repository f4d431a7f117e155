"""The row-streaming 64->64 conv in CUDA C++ (row "cuda_conv_rows"; csrc/conv_row_sm90.cu, compiled with NVRTC for
sm_90a): gluon_conv_rows's schedule with one copy of each input row in shared memory, its three dx taps read as wgmma
operands starting 0, 1 and 2 pixels into it (which Gluon's shared-memory views cannot express; the Gluon kernel
loads three shifted boxes). Fewer shared-memory bytes per row make it faster than the Gluon kernel on short row runs
in one wave of programs (B=1 at 128^2-256^2); on long runs the Gluon kernel's deeper overlap wins.

A producer warp issues the row loads, and the two consumer warpgroups take turns at the tensor cores, each storing
its own 64 columns while the other's MMAs run (csrc/conv_row_sm90.cu says why).

Covers 64->64, stride 1, no upsample or pre_clamp, W > 64 (strips of 128 columns), with or without bias and
residual, sm_90 with NVRTC. x and the residual must start 16-byte aligned (TMA): views that do not are copied first.
A compile or launch failure is remembered: a warning once, the call raises, and from then on the row's rule names
the failure (so the dispatcher skips it).
"""

from __future__ import annotations

from torch import Tensor

from .. import _backend
from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason
from .conv_pack import packed_weight, plan
from .conv_schedule import rows_per_program
from .derived import derived
from .device import sm_count
from .tma import nhwc_map, tensor_map

NAME = "cuda_conv_rows"
SOURCE, KERNEL = "conv_row_sm90.cu", "conv_row_sm90"
C = 64  # channels in and out
STRIP = 128  # output columns per program (two warpgroups of 64)
THREADS = 288  # two consumer warpgroups and the producer warp
Y_BOX = STRIP // 2  # output pixels per TMA store: one warpgroup's half of the strip
SMEM = 73728 + 3 * (17408 + 16384) + 16384 + 64 + 1024  # the kernel's SMEM_BYTES plus 1024-byte alignment slack

_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: one warning; the row's rule names the failure from then on."""
    _backend.give_up(_failure, "CUDA row conv kernel", error)


def shape_reason(c_in: int, c_out: int, W: int, stride: int, upsample: int, pre_clamp: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if c_in != C or c_out != C:
        return f"{c_in}->{c_out} channels (the CUDA row kernel does {C}->{C})"
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the CUDA row kernel does plain stride-1 convs)"
    if W <= 64:
        return f"W={W} (<= 64: strips of {STRIP} columns would be mostly padding)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90, the conv contract, shape_reason, and no earlier compile failure (NVRTC
    itself is checked by the dispatcher for rows marked nvrtc)."""
    return (sm90_spec_reason(spec, _failure[0] if _failure else None)
            or shape_reason(spec.w_shape[1], spec.w_shape[0], spec.x_shape[3], spec.stride,
                            spec.upsample, spec.pre_clamp))


def spec_ready(spec) -> bool:
    """True once the module is loaded on this device (sizes are kernel arguments: one binary serves every shape)."""
    return _backend.is_loaded(SOURCE, KERNEL, device=spec.device)


def _nhwc_map(t: Tensor, box_w: int, box_c: int = 64):
    """TMA descriptor over channels_last t [B, 64, H, W] as NHWC: boxes of box_w pixels x box_c channels (64:
    128-byte swizzled rows; 8: one unswizzled 16-byte chunk per pixel)."""
    return nhwc_map(t, [box_c, box_w, 1, 1], swizzle=box_c == 64)


def program_rows(x: Tensor) -> int:
    """Output rows per program for a launch on x [B, 64, H, W]: strips of STRIP columns, about one wave."""
    B, _, H, W = x.shape
    return rows_per_program(B, H, -(-W // STRIP), sm_count(x.device))


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           rows: int, pdl: bool, frames: int = 0, memory: Tensor | None = None) -> None:
    """x, residual, out: channels_last f16 [B, 64, H, W], 16-byte aligned; wp: conv_pack's weight [1, 576, 64]
    (rows tap * 64 + c_in); rows: output rows per program. frames > 0: past mode (cuda_mem_conv), output image i
    convolves x's image i - 1, or for each sample's first frame memory[i // frames] ([B / frames, 64, H, W], the
    same layout; None: zeros)."""
    B, _, H, W = x.shape
    # The kernel reads each tap's weight K-major ([c_out][c_in]); a repack in this call means no PDL (see
    # tma_pdl: the weights load before the wait).
    built = []
    wk = derived.get(wp, ("cuda_conv_rows",), lambda: built.append(1) or wp.reshape(9, 64, 64).transpose(1, 2).contiguous())
    w_map = tensor_map(wk, [64, 9 * 64], [64], [64, 64])
    x_map = _nhwc_map(x, STRIP + 2, 8)
    y_map = _nhwc_map(out, Y_BOX)
    r_map = _nhwc_map(residual, STRIP) if residual is not None else y_map
    m_map = _nhwc_map(memory, STRIP + 2, 8) if memory is not None else x_map
    strips, chunks = -(-W // STRIP), -(-H // rows)
    kernel = _backend.get_kernel(SOURCE, KERNEL, device=x.device)
    kernel((B * chunks * strips,), (THREADS,), [x_map, w_map, r_map, y_map, m_map, b, H, rows, chunks, strips,
                                            int(residual is not None), int(relu), int(pdl and not built),
                                            frames, int(memory is not None)],
           smem=SMEM, pdl=pdl and not built)


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], x.shape[3], stride, upsample, pre_clamp)

    def kernel(call, wp, pdl):
        try:
            launch(call.x, wp, call.b, call.residual, call.out, relu, program_rows(call.x), pdl["PDL"])
        except RuntimeError as e:  # NVRTC or the driver refused it; nothing was launched
            give_up(e)
            raise

    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, upsample, plan(C, C, upsample)), kernel)


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
