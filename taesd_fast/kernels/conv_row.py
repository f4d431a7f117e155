"""The row-streaming 64->64 conv in CUDA C++ (csrc/conv_row_sm90.cu, compiled with NVRTC for sm_90a): conv_halo's
schedule with one copy of each input row in shared memory, its three dx taps read as wgmma operands starting 0, 1
and 2 pixels into it (which Gluon's shared-memory views cannot express; the Gluon kernel loads three shifted boxes).

Where it runs: conv_halo.launch hands it 64->64 calls in the latency regime, short row runs in one wave of
programs (B=1 at 256^2 and 128^2), where it wins; with long runs the Gluon kernel's deeper overlap wins. Measured
(run BB3, us per conv in a chain of 20 graph-captured launches, the same bits as the Gluon kernel): 256^2 B=1 with
a residual 14.76 -> 13.65, without 12.52 -> 12.33, 128^2 B=1 8.12 -> 6.33; slower at 512^2 B=1 (16-row runs)
35.3 -> 42.0, 256^2 B=64 0.51 -> 0.64 ms. Decode 256^2 B=1 0.1523 -> 0.1496 ms."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .. import _backend
from .derived import derived

SOURCE, KERNEL = "conv_row_sm90.cu", "conv_row_sm90"
STRIP = 128  # output columns per program (two warpgroups of 64)
SMEM = 73728 + 3 * (17408 + 16384) + 16384 + 64 + 1024  # the kernel's SMEM_BYTES plus 1024-byte alignment slack


MAX_ROWS = 4  # rows per program up to which it beats the Gluon kernel (4 at 256^2 B=1; 16 at 512^2 loses)
_failure: list[str] = []  # why it could not compile or launch in this process, once it could not


def give_up(error: Exception) -> None:
    """Called when compiling or launching failed: every later call takes the Gluon kernel, with one warning."""
    _failure.append(f"{type(error).__name__}: {error}")
    warnings.warn(f"taesd_fast: the CUDA row conv kernel is unavailable ({_failure[0]}); using the Gluon kernel",
                  RuntimeWarning, stacklevel=3)


def reason(x: Tensor, rows: int, programs: int, sms: int) -> str | None:
    """Why conv_halo should not hand this call (rows per program, grid size) to the CUDA kernel, or None."""
    if rows > MAX_ROWS or programs > sms:
        return f"{rows} rows per program, {programs} programs (the CUDA kernel wins only on short runs in one wave)"
    if _failure:
        return _failure[0]
    why = _backend.kernels_unavailable_reason(x.device)
    if why is None and torch.cuda.is_current_stream_capturing() and not _backend.is_loaded(SOURCE, KERNEL,
                                                                                          device=x.device):
        why = "not compiled before this CUDA-graph capture"
    return why


def _nhwc_map(t: Tensor, box_w: int, box_c: int = 64):
    """TMA descriptor over channels_last t [B, 64, H, W] as NHWC: boxes of box_w pixels x box_c channels (64:
    128-byte swizzled rows; 8: one unswizzled 16-byte chunk per pixel)."""
    B, C, H, W = t.shape
    return _backend.tensor_map(t, [C, W, H, B], [C, W * C, H * W * C], [box_c, box_w, 1, 1], swizzle=box_c == 64)


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           rows: int, pdl: bool) -> None:
    """x, residual, out: channels_last f16 [B, 64, H, W]; wp: conv_tc's packed weight [1, 576, 64] (rows tap * 64 +
    c_in); rows: output rows per program (conv_halo's choice)."""
    B, _, H, W = x.shape
    # The kernel reads each tap's weight K-major ([c_out][c_in]); a repack in this call means no PDL (see
    # conv_tc.pdl_args: the weights load before the wait).
    built = []
    wk = derived.get(wp, ("conv_row",), lambda: built.append(1) or wp.reshape(9, 64, 64).transpose(1, 2).contiguous())
    w_map = _backend.tensor_map(wk, [64, 9 * 64], [64], [64, 64])
    x_map = _nhwc_map(x, STRIP + 2, 8)
    y_map = _nhwc_map(out, STRIP)
    r_map = _nhwc_map(residual, STRIP) if residual is not None else y_map
    strips, chunks = -(-W // STRIP), -(-H // rows)
    kernel = _backend.get_kernel(SOURCE, KERNEL, device=x.device)
    kernel((B * chunks * strips,), (256,), [x_map, w_map, r_map, y_map, b, H, rows, chunks, strips,
                                            int(residual is not None), int(relu), int(pdl and not built)],
           smem=SMEM, pdl=pdl and not built)
