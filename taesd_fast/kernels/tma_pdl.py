"""TMA descriptor helpers (channels_last conv activations, the head's feature frames) and programmatic dependent
launch (PDL), shared by the Hopper kernels. The CUDA C++ kernels' descriptors (CUtensorMap, encoded through the
driver) are in tma.py.

PDL: on sm_90+, a kernel launched with PDL may start while the one before it drains. Every conv kernel waits for
its predecessor's writes (griddepcontrol.wait) before it reads an activation, and may load its weights before that
wait (the previous kernel does not write them). That saves part of each launch gap when many small kernels run back
to back, as in a B=1 decode replayed from a CUDA graph."""

from __future__ import annotations

import torch
from torch import Tensor

from .device import capability
from .gluon_import import TensorDescriptor, gl, gluon
from .triton_import import gdc_launch_dependents, gdc_wait, interpreting, tl, triton

__all__ = ["PDL", "aligned_nhwc", "frames_layout", "frames_tma_reason", "nhwc_desc", "pdl_args", "pdl_start",
           "pdl_wait"]

PDL = True  # launch with PDL where the GPU has it (sm_90+); benchmarks toggle it


def pdl_args(x: Tensor, packed_now: list | None = None) -> dict:
    """Launch arguments for PDL: {"PDL": True, "launch_pdl": True} on sm_90+, else {"PDL": False}. Off when a weight
    was packed or copied in this call (packed_now non-empty): the kernels load their weights before the wait, and
    the packing kernel right before them writes those weights."""
    if PDL and not packed_now and x.is_cuda and not interpreting() and capability(x.device)[0] >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def nhwc_desc(t: Tensor, block: list, layout) -> "TensorDescriptor":
    """A Gluon TMA descriptor over channels_last t [B, C, H, W] seen as NHWC, with dense strides spelled out (torch
    may give size-1 dimensions any stride, which TMA's 16-byte stride rule would reject)."""
    B, c, H, W = t.shape
    return TensorDescriptor(t, [B, H, W, c], [H * W * c, W * c, c, 1], block, layout)


def aligned_nhwc(t: Tensor | None) -> Tensor | None:
    """t as dense channels_last with a 16-byte aligned base, which TMA needs: t itself when it already is, else a
    copy (one extra pass; a view into a larger buffer at an odd offset is the usual cause). A size-1 dimension
    may carry any stride in torch (a [B, C, 1, 1] NCHW tensor counts as channels_last with W stride 1); TMA wants
    every outer stride a 16-byte multiple, so such a dimension gets the dense stride, over the same memory."""
    if t is None:
        return None
    t = t.contiguous(memory_format=torch.channels_last)
    if t.data_ptr() % 16:
        t = t.clone(memory_format=torch.channels_last)
    b, c, h, w = t.shape
    dense = (h * w * c, 1, w * c, c)
    return t if t.stride() == dense else t.as_strided(t.shape, dense)


def frames_layout(t: Tensor, frames: int) -> tuple[list[int], list[int]]:
    """(shape, strides) of flat-pixel t [B, C, F, H, W] seen as [B, C, F, H*W], the TMA view both Hopper head kernels
    load (gluon_fused, cuda_fused). A size-1 dimension may carry any stride in torch; TMA wants 16-byte multiples, so
    those get a dense one."""
    b, c, _, h, w = t.shape
    shape = [b, c, frames, h * w]
    strides = [t.stride(0), t.stride(1), t.stride(2), 1]
    for d in (2, 1, 0):
        if shape[d] == 1:
            strides[d] = strides[d + 1] * shape[d + 1]
    return shape, strides


def frames_tma_reason(features: Tensor, cache: Tensor | None) -> str | None:
    """Why the frames of these bf16 tensors cannot be TMA boxes (a base or a stride of size > 1 not 16-byte
    aligned), or None."""
    for name, x in (("features", features), ("cache", cache)):
        if x is not None and (x.data_ptr() % 16 or any(s % 8 for s, n in zip(x.stride()[:3], x.shape[:3]) if n > 1)):
            return f"{name} is not 16-byte aligned in every stride (TMA)"
    return None


if gluon is not None:

    @gluon.jit
    def pdl_wait():
        """Gluon kernels: wait until the previous kernel's writes are visible, then let the next kernel launch.
        Everything before this call must not read what the previous kernel writes."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
else:
    pdl_wait = None

if triton is not None:

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """Triton kernels: with PDL, wait for the previous kernel's writes before touching any activation, then let
        the next kernel begin launching (it waits the same way)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    pdl_start = None
