"""Which implementation runs each conv: one table of rows (table.py), chosen per shape by measurement.

    spec.py       what a decision depends on (Spec) and its timings-file key
    table.py      the rows: PyTorch (torch_ops.py) and each custom kernel, with its support rule
    measure.py    timing rows on the GPU; gpu_lock
    store.py      timings on disk, shared by processes
    decide.py     backend and tuning modes, decisions, the generation counter
    tuner.py      the background tuning thread
    calls.py      conv2d / head_conv / head_full, the calls the model layers make
    report.py     dispatch_table, tune

Importing this package touches no CUDA and imports no kernel module that needs Triton.
"""

from __future__ import annotations

from . import decide, store, tuner
from .calls import conv2d, head_conv, head_full
from .decide import (
    MARGIN, MODES, TUNING_MODES, Record, backend, get_backend, get_tuning, graph_timing, set_backend, set_tuning,
    tuning,
)
from .measure import GpuBusy, gpu_lock
from .report import dispatch_table, rows_of, tune
from .spec import Spec
from .store import store_timings
from .table import DEFAULT_ORDER, ROWS, Row
from .torch_ops import soft_clamp
from .tuner import TuningStatus

__all__ = [
    "conv2d", "head_conv", "head_full", "soft_clamp", "backend", "set_backend", "get_backend", "tuning",
    "set_tuning", "get_tuning", "graph_timing", "dispatch_table", "rows_of", "tune", "clear_cache", "generation",
    "wait_for_tuning", "tuning_status", "TuningStatus", "Spec", "Row", "ROWS", "DEFAULT_ORDER", "Record",
    "gpu_lock", "GpuBusy", "store_timings", "MODES", "TUNING_MODES", "MARGIN",
]


def clear_cache(disk: bool = False) -> None:
    """Forget in-process decisions, queued tuning and the timings read from disk (and the timings file if
    disk=True). Graphs captured before are captured again on their next call."""
    tuner.reset()
    decide.clear()
    store.clear(disk)


def generation() -> int:
    """Moves whenever tuned decisions replace earlier ones (and on clear_cache): graphs captured under an older
    generation run stale decisions and are captured again (graphs.GraphCache)."""
    return decide.state.generation


def wait_for_tuning(timeout: float | None = None) -> bool:
    """Block until the background tuner has finished everything queued and its decisions are in effect. Returns
    False if `timeout` seconds passed first. For tools and tests; calls never need it."""
    return tuner.wait(timeout)


def tuning_status() -> TuningStatus:
    """Jobs pending (queued or running), jobs done, the last failure and the generation."""
    return tuner.status()
