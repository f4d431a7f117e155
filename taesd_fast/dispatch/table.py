"""The dispatch table: every implementation the dispatcher can run, one Row each (kernels/row.py): the PyTorch rows
below, then the custom kernels' rows (kernels/rows.py KERNEL_ROWS), held as they are.

Kernel modules are imported on first use (importing Triton takes about a second): a kernel row's rule and function
reach their module through a small loader, and rows for CUDA only are never asked about CPU calls. Importing this
module imports no kernel module.
"""

from __future__ import annotations

from ..kernels.row import Row
from ..kernels.rows import DEFAULT_ORDER, KERNEL_ROWS, forced_order
from . import torch_ops

__all__ = ["DEFAULT_ORDER", "ROWS", "Row", "forced_order", "reference", "row", "rows"]

_ANY = ("cpu", "cuda", "meta", "mps", "xpu")
ROWS: list[Row] = [
    Row("torch", "conv2d", torch_ops.conv2d, kernel=False, devices=_ANY),
    Row("torch", "mem_conv", torch_ops.mem_conv, kernel=False, devices=_ANY),
    Row("torch", "head", torch_ops.head, kernel=False, devices=_ANY),
    Row("torch", "head_full", torch_ops.head_full, kernel=False, devices=_ANY),
    *KERNEL_ROWS,
]
# backend("kernels") with no timings tries the kernels in forced_order(layout): DEFAULT_ORDER with the rows that read
# the input's layout natively first (kernels/rows.py).


def rows(kind: str) -> list[Row]:
    return [r for r in ROWS if r.kind == kind]


def row(kind: str, name: str) -> Row:
    """The row of this kind and name (KeyError naming the rows of that kind)."""
    for r in ROWS:
        if r.kind == kind and r.name == name:
            return r
    raise KeyError(f"no {kind} row named {name!r} (have: {[r.name for r in ROWS if r.kind == kind]})")


def reference(kind: str) -> Row:
    """The PyTorch row of a kind: the fallback and the yardstick kernels are measured against."""
    return next(r for r in ROWS if r.kind == kind and not r.kernel)
