"""The dispatched calls: conv2d, mem_conv, head_conv, head_full. Each builds a plain key from its arguments and looks
up the decision for it (one dict lookup per call, which torch.compile traces into a guard); on a miss it decides
(decide.py) or, in subprocess tuning, runs PyTorch and sends the call's metadata to the tuning process (tuner.py).
Each eager call first picks up what the tuning process has answered (`tuner.poll`, a list check)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..kernels import rows as kernel_rows
from . import decide, store, table, torch_ops, tuner
from .spec import args_meta, call_key, spec_of

state = decide.state


def _choose(key: tuple, args: tuple, layer) -> Callable[..., Tensor]:
    """The run function for this call. The fast path is one lookup on plain tuples, so torch.compile traces it
    (guarding on the dict) and bakes in the decision made eagerly for this shape."""
    mode, graph = state.mode, state.graph
    rec = state.decided.get((mode, graph, key))
    if torch.compiler.is_compiling():
        # Never time or compile while tracing; nothing decided eagerly for this shape means PyTorch.
        return table.reference(key[0]).run if rec is None else rec.run
    if tuner.results:
        tuner.poll()
        rec = state.decided.get((mode, graph, key))
    if rec is None:
        rec = _miss(key, mode, graph, args)
    if layer is not None:  # every layer gets its row, also when another layer with this shape decided first
        recs = decide.records.get(layer)
        if recs is None or recs.get(key) is not rec:
            decide.records.setdefault(layer, {})[key] = rec
    return rec.run


def _miss(key: tuple, mode: str, graph: bool, args: tuple) -> decide.Record:
    spec = spec_of(key)
    tuning_mode = decide.get_tuning()
    in_capture = decide.capturing(spec)
    sub = mode == "auto" and tuning_mode == "subprocess" and decide.tunable(spec)
    rec = state.final.get((graph, key)) if sub else None
    if rec is None and sub and store.get(spec.key(decide.device_name(spec.device), graph)) is None:
        rec = _send(spec, graph, key, args)  # nothing stored: no kernel module is imported for this call
    if sub and (rec is None or table.row(spec.kind, rec.choice).kernel) and kernel_rows.importing():
        return decide.defer(spec)  # stored or tuned timings may choose a kernel: not while the imports run
    if rec is None:
        rec = decide.decide_now(spec, mode, graph, lambda: args_meta(args), tuning_mode)
    if rec is None:  # stored timings miss some candidate
        rec = _send(spec, graph, key, args)
    row = table.row(spec.kind, rec.choice)
    if in_capture and row.kernel and (mode == "auto" or not row.ready(spec)):
        # Loading a module mid-capture is unsafe, and so is packing a weight there (the upsample fold copies from
        # the host). graphs.capture's warm-up decides and runs every call first, so in "auto" mode a kernel decided
        # here never ran: the warm-up was deferred (the background imports ended between it and the capture) or
        # its decisions were replaced. PyTorch runs in this graph, and the deferral mark makes it stale at the next
        # dispatch.poll, so the call after captures again with the kernel warmed up.
        if mode == "auto":
            decide.capture_again()
        return decide.Record(spec, table.reference(spec.kind).name, f"{rec.why}; kernel not run before capture",
                             rec.ms, rec.skipped, table.reference(spec.kind).run)
    if sub or not in_capture:
        # A decision made without timing because a capture is under way must not stick: the next eager call decides.
        with decide.lock:
            state.decided[(mode, graph, key)] = rec
            state.kernel_chosen = state.kernel_chosen or row.kernel
    return rec


def _send(spec, graph: bool, key: tuple, args: tuple) -> decide.Record:
    """PyTorch for now; the call's metadata goes to the tuning process."""
    tuner.submit(spec, graph, key, args_meta(args))
    return decide.provisional(spec)


def _needs_grad(*tensors) -> bool:
    """Our ops define no backward: a call that autograd must differentiate runs PyTorch."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, stride: int = 1,
           residual: Tensor | None = None, relu: bool = False, upsample: int = 1, pre_clamp: bool = False,
           layer: nn.Module | None = None) -> Tensor:
    """y = conv2d(up(c(x)), weight, bias, stride, padding=k//2) (+ residual); relu(y) if relu, where up is a
    nearest upsample by `upsample` (1: none) and c is `soft_clamp` if pre_clamp; kernels may fold both into the conv.
    x: [B, C_in, H, W]; weight: [C_out, C_in, k, k]; residual: [B, C_out, Ho, Wo]."""
    args = (x, weight, bias, stride, residual, relu, upsample, pre_clamp)
    if state.mode == "torch" or _needs_grad(x, weight, bias, residual):
        return torch_ops.conv2d(*args)
    return _choose(call_key("conv2d", *args), args, layer)(*args)


def conv2d_choice(x: Tensor, weight: Tensor, bias: Tensor | None, *, batch: int, relu: bool = False,
                  upsample: int = 1) -> str | None:
    """The row decided for a conv2d call like conv2d(x', weight, bias, relu=relu, upsample=upsample) where x' has x's
    device, dtype, layout, channels and size but `batch` images, or None when no decision exists yet. A lookup only:
    nothing is timed, tuned or sent. For callers that run such a call in another form where a row is known to win
    (models/taehv/layers.py folds TGrow into the conv after it)."""
    key = call_key("conv2d", x, weight, bias, 1, None, relu, upsample, x_shape=(batch, *x.shape[1:]))
    rec = state.decided.get((state.mode, state.graph, key))
    return None if rec is None else rec.choice


def mem_conv(x: Tensor, memory: Tensor | None, weight: Tensor, bias: Tensor | None, *, frames: int,
             relu: bool = False, layer: nn.Module | None = None) -> Tensor:
    """A TAEHV memory block's first conv: conv2d(cat([x, past], 1), weight, bias, padding=1) (ReLU'd if relu), where
    x is [B*frames, C, H, W] (`frames` consecutive frames per sample, time-major), past is each frame's predecessor
    within its sample, and memory [B, C, H, W] (zeros when None) stands before each sample's first frame. weight:
    [C_out, 2C, 3, 3]. Kernels read the two halves where they are; PyTorch builds the concatenation. torch.compile
    traces the PyTorch row (the kernel has no custom op to trace through)."""
    args = (x, memory, weight, bias, frames, relu)
    if state.mode == "torch" or _needs_grad(x, memory, weight, bias) or torch.compiler.is_compiling():
        return torch_ops.mem_conv(*args)
    return _choose(call_key("mem_conv", x, weight, bias, 1, memory, relu, frames=frames), args, layer)(*args)


def head_conv(x: Tensor, weight: Tensor, bias: Tensor | None, *, layer: nn.Module | None = None) -> Tensor:
    """clamp(conv3d(x, weight, bias, padding=(0, 1, 1)), -1, 1).
    x: [B, C_in, T+2, H, W] (causal frames in front); weight: [C_out, C_in, 3, 3, 3] -> [B, C_out, T, H, W]."""
    args = (x, weight, bias)
    if state.mode == "torch" or _needs_grad(x, weight, bias):
        return torch_ops.head(*args)
    return _choose(call_key("head", x, weight, bias, 1, None, False), args, layer)(*args)


def head_full(x: Tensor, cache: Tensor | None, gamma: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
              patch: int = 0, *, layer: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """The whole output head: window = [cache | silu(rms_norm(x))] (zero frames when cache is None), then
    (unpatchify(clamp(conv3d(window, weight, bias, padding=(0, 1, 1)), -1, 1), patch), window[:, :, -2:]).
    x: [B, C_in, T, H, W]; cache: [B, C_in, 2, H, W] post-SiLU frames or None; patch 0: no unpatchify."""
    args = (x, cache, gamma, weight, bias, eps, patch)
    if state.mode == "torch" or _needs_grad(x, cache, gamma, weight, bias):
        return torch_ops.head_full(*args)
    # Spec.residual records whether a cache was given (the first chunk has none).
    return _choose(call_key("head_full", x, weight, bias, 1, cache, False, patch=patch), args, layer)(*args)
