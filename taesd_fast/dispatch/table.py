"""The dispatch table: every implementation the dispatcher can run, one row each.

A row names its call kind, its support rule (None, or why a call is outside it), the function that runs it and
whether that function can launch without compiling or loading anything (checked before a CUDA-graph capture uses
it). Which supported row runs is decided by measurement (decide.py), never by rules hidden in a row.

Kernel modules are imported on first use (importing Triton takes about a second): a row's rule and function reach
their module through a small loader, and rows for CUDA only are never asked about CPU calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from ..kernels import rows as kernel_rows
from ..kernels.row import KernelRow
from . import torch_ops
from .spec import Spec


def _always(spec: Spec) -> None:
    return None


def _ready(spec: Spec) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """One implementation of a call kind. Arguments of `run` by kind:
    conv2d (x, w, b, stride, residual, relu, upsample, pre_clamp) -> y; head (x, w, b) -> y;
    head_full (x, cache, gamma, w, b, eps, patch) -> (video, new cache)."""

    name: str
    kind: str
    run: Callable[..., Tensor]
    supports: Callable[[Spec], str | None] = _always
    kernel: bool = True  # a custom kernel: auto mode runs it only where it was measured faster than PyTorch
    ready: Callable[[Spec], bool] = _ready  # launches without compiling or loading a module
    layouts: tuple = ("nchw",)  # input layouts the kernel reads natively (others are converted first)
    devices: tuple = ("cuda",)  # device types the row can run on, checked before `supports` (no import on CPU)
    nvrtc: bool = True  # needs our NVRTC-built kernels (the Triton rows check Triton in `supports`)


def _from_kernel_row(k: KernelRow) -> Row:
    """A kernel module's row (kernels/rows.py) as a dispatch row. Kernel rows run the same function whether or not
    a CUDA graph will replay the call: which kernel suits a replay is measured, not ruled."""
    return Row(k.name, k.kind, k.run, k.supports, ready=k.ready, layouts=k.layouts,
               nvrtc=k.nvrtc)


_ANY = ("cpu", "cuda", "meta", "mps", "xpu")
ROWS: list[Row] = [
    Row("torch", "conv2d", torch_ops.conv2d, kernel=False, devices=_ANY),
    Row("torch", "head", torch_ops.head, kernel=False, devices=_ANY),
    Row("torch", "head_full", torch_ops.head_full, kernel=False, devices=_ANY),
    *(_from_kernel_row(k) for k in kernel_rows.KERNEL_ROWS),
]
# backend("kernels") with no timings: kernel_rows.forced_order(layout), the preference for rows that read the
# input's layout natively.
DEFAULT_ORDER = kernel_rows.DEFAULT_ORDER


def rows(kind: str) -> list[Row]:
    return [r for r in ROWS if r.kind == kind]


def row(kind: str, name: str) -> Row:
    for r in ROWS:
        if r.kind == kind and r.name == name:
            return r
    raise KeyError(f"no {kind} row named {name!r} in the dispatch table")


def reference(kind: str) -> Row:
    """The PyTorch row of a kind: the fallback and the yardstick kernels are measured against."""
    return next(r for r in ROWS if r.kind == kind and not r.kernel)
