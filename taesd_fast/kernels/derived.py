"""One cache for tensors derived from weights (packed layouts, fp32 bias copies), shared by every kernel module."""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import Tensor


class DerivedCache:
    """Derived tensors kept per source tensor (weak key, so entries die with the source) and per tag, rebuilt when
    the source changes: its version counter (an in-place update) or its storage, dtype, device or strides
    (`param.data = ...`, which is what module.half() / .to() do, keeps the Parameter object and its version, so
    identity and version alone would hand back a stale copy); the same for the tensors given as `also`. Inference
    tensors have no version counter: rebuilt on every call. During CUDA-graph capture a hit is used and pinned for
    the process lifetime (the graph reads it on every replay), and a miss is built inside the capture (correct, but
    rebuilt on every replay: run once before capturing)."""

    def __init__(self):
        from torch.utils.weak import WeakTensorKeyDictionary  # tensors compare elementwise: a plain weak dict breaks

        self._d = WeakTensorKeyDictionary()
        self._pinned: dict[int, Tensor] = {}
        self._lock = threading.Lock()

    def _hit(self, src: Tensor, tag, also: tuple):
        """(stamp of src and `also` now, the cached (stamp, tensor) for (src, tag) or None)."""
        stamp = tuple((t._version, t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride()) for t in (src, *also))
        with self._lock:
            entry = self._d.get(src)
            return stamp, None if entry is None else entry.get(tag)

    def has(self, src: Tensor, tag, also: tuple = ()) -> bool:
        """Whether get(src, tag, ..., also) would return a cached tensor without building it."""
        if src.is_inference() or any(t.is_inference() for t in also):
            return False
        stamp, hit = self._hit(src, tag, also)
        return hit is not None and hit[0] == stamp

    def get(self, src: Tensor, tag, build: Callable[[], Tensor], also: tuple = ()) -> Tensor:
        """build()'s tensor for (src, tag), cached. `also`: other tensors it is derived from (TGrow's weight for a
        composed one); a change to any of them rebuilds it, in the same entry."""
        if src.is_inference() or any(t.is_inference() for t in also):
            return build()
        capturing = src.is_cuda and torch.cuda.is_current_stream_capturing()
        stamp, hit = self._hit(src, tag, also)
        if hit is not None and hit[0] == stamp:
            if capturing:
                with self._lock:
                    self._pinned[id(hit[1])] = hit[1]
            return hit[1]
        val = build()
        if not capturing:
            with self._lock:
                self._d.setdefault(src, {})[tag] = (stamp, val)
        return val


derived = DerivedCache()
