"""TMA descriptors (CUtensorMap) for the CUDA C++ kernels' __grid_constant__ parameters, encoded through the CUDA
driver and kept for reuse. The Triton and Gluon kernels build theirs through Triton (tma_pdl.nhwc_desc); the views
both kinds load (frames_layout, aligned_nhwc) are in tma_pdl.py.

Nothing here touches CUDA at import time."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import torch
from torch import Tensor

from .. import _backend

__all__ = ["nhwc_map", "tensor_map"]

_TMA_DTYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16
_TENSOR_MAPS_KEPT = 64
_tensor_maps: OrderedDict = OrderedDict()  # recently encoded descriptors, most recent last
_tensor_maps_lock = threading.Lock()


def tensor_map(t: Tensor, dims: list[int], strides: list[int], box: list[int],
               swizzle: bool = True) -> ctypes.Array:
    """A TMA descriptor (CUtensorMap, 128 bytes) over f16 or bf16 tensor t's memory: dims innermost first, strides
    in elements for dims 1.., box in elements; 128-byte swizzle (or none), zero fill out of bounds.

    A descriptor is a pure function of these arguments and the address, so the last few are kept and reused: the
    caching allocator hands a stream of same-shape calls the same few addresses, and encoding through ctypes costs
    tens of microseconds of an eager call's host time."""
    key = (t.data_ptr(), t.dtype, tuple(dims), tuple(strides), tuple(box), swizzle)
    with _tensor_maps_lock:
        desc = _tensor_maps.get(key)
        if desc is not None:
            _tensor_maps.move_to_end(key)
            return desc
    desc = _encode_tensor_map(t, dims, strides, box, swizzle)
    with _tensor_maps_lock:
        _tensor_maps[key] = desc
        if len(_tensor_maps) > _TENSOR_MAPS_KEPT:
            _tensor_maps.popitem(last=False)
    return desc


def nhwc_map(t: Tensor, box: list[int], swizzle: bool = True) -> ctypes.Array:
    """tensor_map over channels_last t [B, C, H, W] seen as NHWC: dims (C, W, H, B) with dense strides, `box` in
    that order (channels, columns, rows, images)."""
    B, C, H, W = t.shape
    return tensor_map(t, [C, W, H, B], [C, W * C, H * W * C], box, swizzle)


def _encode_tensor_map(t: Tensor, dims: list[int], strides: list[int], box: list[int],
                       swizzle: bool) -> ctypes.Array:
    lib = _backend.driver()
    rank = len(dims)
    raw = (ctypes.c_ubyte * 192)()  # CUtensorMap is 64-byte aligned: carve an aligned 128 bytes out of this
    desc = (ctypes.c_ubyte * 128).from_address(-(-ctypes.addressof(raw) // 64) * 64)
    desc._keep = raw
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rc = lib.cuTensorMapEncodeTiled(
        ctypes.byref(desc), _TMA_DTYPES[t.dtype], rank, ctypes.c_void_p(t.data_ptr()),
        (u64 * rank)(*dims), (u64 * max(1, rank - 1))(*[s * t.element_size() for s in strides]),
        (u32 * rank)(*box), (u32 * rank)(*([1] * rank)),
        0, 3 if swizzle else 0, 2, 0)  # no interleave, 128-byte swizzle or none, L2 promotion 128 B, zero fill
    _backend.check_driver(rc, f"cuTensorMapEncodeTiled(dims={dims}, box={box})")
    return desc
