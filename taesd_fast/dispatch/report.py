"""What the dispatcher chose: the per-layer table, and `tune` to fill it ahead of time."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import decide
from .spec import dtype_name, fmt_shape


def tune(fn: Callable, *args, **kwargs):
    """Run fn(*args) once in auto mode, without grad and with blocking tuning, so every call it reaches is timed
    and its decision stored (do this before torch.compile). For a CUDA graph you capture yourself, call tune and
    capture both inside `graph_timing()` (or use graphs.CUDAGraphed, which does). Returns fn's output."""
    with decide.backend("auto"), decide.tuning("blocking"), torch.no_grad():
        return fn(*args, **kwargs)


def rows_of(model: nn.Module) -> list[tuple[str, decide.Record]]:
    """(layer name, decision) for every (layer, shape) of `model` that went through dispatch in this process."""
    out = []
    for name, mod in model.named_modules():
        for rec in decide.records.get(mod, {}).values():
            out.append((getattr(mod, "layer_name", name) or name, rec))
    return out


def dispatch_table(model: nn.Module) -> str:
    """One row per (layer, shape) that went through dispatch: choice, why, and the timings it was chosen by."""
    rows = []
    for name, r in rows_of(model):
        spec = r.spec
        res = {"head_full": "cache", "mem_conv": "memory"}.get(spec.kind, "res")
        flags = "+".join(f for f, on in (("clamp", spec.pre_clamp), ("up2", spec.upsample == 2), ("bias", spec.bias),
                                         (res, spec.residual), ("relu", spec.relu),
                                         (f"unpatchify{spec.patch}", spec.patch),
                                         (f"past-of-{spec.frames}-frames", spec.frames)) if on)
        times = " ".join(f"{n}={t:.4f}" for n, t in sorted(r.ms.items(), key=lambda kv: kv[1]))
        rows.append([name, fmt_shape(spec.x_shape), fmt_shape(spec.w_shape), dtype_name(spec.dtype),
                     str(spec.stride), flags or "-", spec.layout, r.choice, r.why, times or "-"])
    head = ["layer", "input", "weight", "dtype", "s", "epilogue", "layout", "choice", "why", "median ms"]
    mode = decide.get_backend()
    lines = [f"dispatch mode={mode}"]
    if not rows and mode == "torch":
        lines.append("(mode torch: every conv runs PyTorch and no choices are recorded; use auto or kernels for rows)")
        return "\n".join(lines)
    if not rows:
        lines.append("(no convs dispatched yet: run the model once on the device, e.g. model.decode(latents), or "
                     "model.warmup(shapes) to tune ahead)")
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
