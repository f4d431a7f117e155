"""KernelRow: one kernel the dispatcher can choose, as rows.KERNEL_ROWS lists them. A leaf module (no imports from
the package) so that the dispatcher's table and the kernel modules can both name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["KernelRow"]


@dataclass(frozen=True)
class KernelRow:
    """name: what the dispatcher, the timings file and the report call it. kind: "conv2d", "head" or "head_full"
    (the call signatures: conv2d (x, w, b, stride, residual, relu, upsample, pre_clamp) -> y; head (x, w, b) -> y;
    head_full (x, cache, gamma, w, b, eps, patch) -> (out, new cache)). supports(spec): None, or why the kernel
    cannot run the call (from the spec's fields alone). run: launches exactly this kernel. ready(spec): True when it
    can launch without compiling or loading anything (checked during CUDA-graph capture). layouts: input layouts
    it reads natively (others are converted first). nvrtc: needs our NVRTC-built CUDA C++ kernels (the dispatcher
    checks that they can build here). module: the kernel module under taesd_fast/kernels."""

    name: str
    kind: str
    supports: Callable[..., str | None]
    run: Callable
    ready: Callable[..., bool]
    layouts: tuple
    nvrtc: bool
    module: str
