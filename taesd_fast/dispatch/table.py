"""The dispatch table: every implementation the dispatcher can run, one row each.

A row names its call kind, its support rule (None, or why a call is outside it), the function that runs it and
whether that function can launch without compiling or loading anything (checked before a CUDA-graph capture uses
it). Which supported row runs is decided by measurement (decide.py), never by rules hidden in a row.

Kernel modules are imported on first use (importing Triton takes about a second): a row's rule and function reach
their module through a small loader, and rows for CUDA only are never asked about CPU calls.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from . import torch_ops
from .spec import Spec


def _always(spec: Spec) -> None:
    return None


def _ready(spec: Spec, graph: bool) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    """One implementation of a call kind. Arguments of `run` by kind:
    conv2d (x, w, b, stride, residual, relu, upsample, pre_clamp) -> y; head (x, w, b) -> y;
    head_full (x, cache, gamma, w, b, eps, patch) -> (video, new cache)."""

    name: str
    kind: str
    run: Callable[..., Tensor]  # eager calls
    supports: Callable[[Spec], str | None] = _always
    kernel: bool = True  # a custom kernel: auto mode runs it only where it was measured faster than PyTorch
    graph_run: Callable[..., Tensor] | None = None  # calls a CUDA graph will replay, if they differ from `run`
    ready: Callable[[Spec, bool], bool] = _ready  # (spec, graph): launches without compiling or loading a module
    layouts: tuple = ("nchw",)  # input layouts the kernel reads natively (others are converted first)
    devices: tuple = ("cuda",)  # device types the row can run on, checked before `supports` (no import on CPU)
    nvrtc: bool = True  # needs our NVRTC-built kernels (the Triton rows check Triton in `supports`)
    # (spec, graph): compile the kernel without touching the GPU (no module load, launch or synchronize), so the
    # tuner can compile outside gpu_lock and a capture waits for launches and timing only. None: the first launch
    # compiles, inside the lock.
    precompile: Callable[[Spec, bool], None] | None = None

    def runner(self, graph: bool) -> Callable[..., Tensor]:
        return self.graph_run if graph and self.graph_run is not None else self.run


def _module(name: str):
    """A kernel module, imported on first use."""
    return importlib.import_module(f"taesd_fast.kernels.{name}")


# ----------------------------------------------------------------------------- conv2d


def _f16_row(variant: str) -> Row:
    """The seed's SIMT f16 direct convs (kernels/conv3x3.py, NVRTC); NCHW input, no folded prologues."""

    def supports(s: Spec) -> str | None:
        if s.upsample != 1 or s.pre_clamp:
            return "no upsample or clamp fold in the SIMT kernels"
        return _module("conv3x3").unsupported_reason(s.x_shape, s.w_shape, s.dtype, s.stride, variant)

    def run(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False):
        import torch

        return torch.ops.taesd_fast.conv3x3_f16(x, w, b, residual, stride, relu, variant)

    def ready(s: Spec, graph: bool) -> bool:
        from .. import _backend

        k = _module("conv3x3")
        defines = k.kernel_defines(s.w_shape[1], s.w_shape[0], s.stride, variant)
        return _backend.is_loaded(k._SOURCE, f"conv3x3_{variant}", defines, s.device)

    return Row(f"f16_{variant}", "conv2d", run, supports, ready=ready)


def _tc_row() -> Row:
    """The Triton tensor-core conv (kernels/conv_tc.py). Calls that a CUDA graph will replay take its TMA and
    row-streaming kernels (faster on the GPU; each launch builds TMA descriptors on the host); eager calls take the
    pointer kernel, whose launch costs less CPU time."""
    tc = lambda: _module("conv_tc")  # noqa: E731
    return Row("tc", "conv2d", lambda *a: tc().run_conv2d(*a, tma=False), lambda s: tc().spec_unsupported_reason(s),
               graph_run=lambda *a: tc().run_conv2d(*a, tma=True), ready=lambda s, graph: tc().spec_ready(s, tma=graph),
               layouts=("channels_last",), nvrtc=False)


# ----------------------------------------------------------------------------- head


def _window_spec(s: Spec) -> Spec:
    """The split conv's spec inside a head_full call: the window has 2 more frames than the features (the patch
    selects the stencil kernel that writes the video)."""
    b, c, t, h, w = s.x_shape
    return Spec("head", s.device, (b, c, t + 2, h, w), s.w_shape, s.dtype, 1, s.bias, False, False, s.layout,
                patch=s.patch)


def _split_head_full(x, cache, gamma, w, b, eps, patch=0):
    ops = torch_ops.head_ops
    window = ops.causal_window(ops.activate(x, gamma, eps), cache)
    return ops.split_head_conv(window, w, b, patch=patch), window[:, :, -2:]


def _split_rows() -> list[Row]:
    """conv_n128 (cuBLAS/cuDNN) + our NVRTC head_stencil (kernels/head.py), for the conv alone and the whole head."""
    ops = torch_ops.head_ops
    return [
        Row("split_bf16", "head", ops.split_head_conv, ops.spec_unsupported_reason,
            ready=lambda s, graph: ops.spec_ready(s), layouts=("nchw", "channels_last")),
        Row("split_bf16", "head_full", _split_head_full, lambda s: ops.spec_unsupported_reason(_window_spec(s)),
            ready=lambda s, graph: ops.spec_ready(_window_spec(s)), layouts=("nchw", "channels_last")),
    ]


def _fused_head_row() -> Row:
    """Norm + SiLU + temporal GEMM in one kernel, then our stencil (kernels/head_fused.py). Reads NCDHW features
    and chunk slices of them in place."""
    fh = lambda: _module("head_fused")  # noqa: E731
    return Row("triton_fused", "head_full", lambda *a: fh().head_full_triton(*a), lambda s: fh().spec_unsupported_reason(s),
               ready=lambda s, graph: fh().spec_ready(s), layouts=("nchw", "strided"))


def _norm_split_row() -> Row:
    """Triton norm + SiLU into the causal window (kernels/head_act.py), then the split conv."""
    ha = lambda: _module("head_act")  # noqa: E731
    ops = torch_ops.head_ops

    def supports(s: Spec) -> str | None:
        return (ha().unsupported_reason(s.x_shape, s.dtype, s.device.split(":")[0])
                or ops.spec_unsupported_reason(_window_spec(s)))

    return Row("triton_norm_split", "head_full", lambda *a: ha().head_full_norm_split(*a), supports,
               ready=lambda s, graph: ops.spec_ready(_window_spec(s)), layouts=("nchw", "strided"))


_ANY = ("cpu", "cuda", "meta", "mps", "xpu")
ROWS: list[Row] = [
    Row("torch", "conv2d", torch_ops.conv2d, kernel=False, devices=_ANY),
    _tc_row(),
    _f16_row("rb"),
    _f16_row("ocb4"),
    _f16_row("tile"),
    Row("torch", "head", torch_ops.head, kernel=False, devices=_ANY),
    Row("torch", "head_full", torch_ops.head_full, kernel=False, devices=_ANY),
    _fused_head_row(),
    _norm_split_row(),
    *_split_rows(),
]
# backend("kernels") with no timings: the order measured best on the H200 (tensor-core conv, then the SIMT convs),
# then the head kernels.
DEFAULT_ORDER = ("tc", "f16_rb", "f16_ocb4", "f16_tile", "triton_fused", "triton_norm_split", "split_bf16")


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
