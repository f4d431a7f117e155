"""Row: one implementation of a call kind the dispatcher can choose, a PyTorch op or a custom kernel. A leaf module
(no imports from the package) so that the dispatcher's table (dispatch/table.py) and the kernel rows
(kernels/rows.py) both hold these objects, with nothing converted between the layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Row"]


def _no_reason(spec) -> None:
    return None


def _loaded(spec) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """name: what the dispatcher, the timings file and the report call it. kind: "conv2d", "mem_conv", "head" or
    "head_full", which fixes the arguments of `run`: conv2d (x, w, b, stride, residual, relu, upsample, pre_clamp)
    -> y; mem_conv (x, memory, w, b, frames, relu) -> y; head (x, w, b) -> y; head_full (x, cache, gamma, w, b, eps,
    patch) -> (video, new cache).

    supports(spec): None, or why the row cannot run the call (from the spec's fields alone). kernel: a custom
    kernel, which auto mode runs only where it was measured faster than PyTorch (False for the PyTorch rows).
    ready(spec): True when `run` can launch without compiling or loading anything (checked before a CUDA-graph
    capture uses it). layouts: input layouts it reads natively (others are converted first). devices: device types
    it can run on, checked before `supports`, so a CPU call imports no kernel module. nvrtc: needs our NVRTC-built
    CUDA C++ kernels (the dispatcher checks that they can build here). module: the kernel module under
    taesd_fast/kernels that `run` lives in, or None. variants: called with `run`'s arguments, launches the other
    forms of the row's kernel that callers outside the dispatcher run for such a call (TAEHV's TGrow fold), so
    that the tuning process compiles them with the row (dispatch/compile_pool.record); or None.

    Which supported row runs is decided by measurement (dispatch/decide.py), never by rules hidden in a row."""

    name: str
    kind: str
    run: Callable
    supports: Callable[..., str | None] = _no_reason
    kernel: bool = True
    ready: Callable[..., bool] = _loaded
    layouts: tuple = ("nchw",)
    devices: tuple = ("cuda",)
    nvrtc: bool = True
    module: str | None = None
    variants: Callable | None = None
