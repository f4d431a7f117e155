"""Which implementation runs each conv: one table of rows (table.py), chosen per shape by measurement.

    spec.py       what a decision depends on (Spec) and its timings-file key
    table.py      the rows (kernels/row.py Row): PyTorch (torch_ops.py), then every kernel row (kernels/rows.py)
    measure.py    timing rows on the GPU (in the tuning process, or the caller in blocking tuning)
    store.py      timings on disk, shared by processes
    decide.py     backend and tuning modes, decisions, the generation counter
    tuner.py      subprocess tuning, the user's side: sends calls' metadata, picks up the answers
    tune_worker.py  the tuning process itself (never imported by the user's process)
    calls.py      conv2d / mem_conv / head_conv / head_full, the calls the model layers make
    report.py     dispatch_table, tune

Importing this package touches no CUDA and imports no kernel module that needs Triton.
"""

from __future__ import annotations

import torch

from .. import kernel_env
from ..kernels import rows as kernel_rows
from . import decide, store, tuner
from .calls import conv2d, conv2d_choice, head_conv, head_full, mem_conv
from .decide import (
    MARGIN, MODES, TUNING_MODES, Record, backend, capture_again, get_backend, get_tuning, graph_timing, set_backend,
    set_tuning, tuning,
)
from .report import dispatch_table, rows_of, tune
from .spec import Spec
from .store import store_timings
from .table import DEFAULT_ORDER, ROWS, Row
from .torch_ops import soft_clamp
from .tuner import TuningStatus

__all__ = [
    "conv2d", "conv2d_choice", "mem_conv", "head_conv", "head_full", "soft_clamp", "backend", "set_backend",
    "get_backend", "tuning", "set_tuning", "get_tuning", "graph_timing", "dispatch_table", "rows_of", "tune",
    "clear_cache", "generation", "capture_again",
    "wait_for_tuning", "tuning_status", "TuningStatus", "Spec", "Row", "ROWS", "DEFAULT_ORDER", "Record",
    "poll", "prepare", "store_timings", "MODES", "TUNING_MODES", "MARGIN", "kernel_chosen",
]


def clear_cache(disk: bool = False) -> None:
    """Forget in-process decisions, jobs sent to the tuning process and the timings read from disk (and the
    timings file if disk=True). Graphs captured before are captured again on their next call."""
    tuner.reset()
    decide.clear()
    store.clear(disk)


def generation() -> int:
    """Moves whenever tuned decisions replace earlier ones (and on clear_cache): graphs captured under an older
    generation run stale decisions and are captured again (graphs.GraphCache)."""
    return decide.state.generation


def prepare(target) -> None:
    """Called with the device a model is being loaded to, and with the model when its parameters move (its
    `_apply`): on CUDA, with kernels in play, the kernel modules are imported in the background (no CUDA work),
    so the first call does not wait for them."""
    if get_backend() == "torch" or kernel_env.kernels_disabled():
        return
    if isinstance(target, torch.nn.Module):
        on_cuda = any(p.is_cuda for p in target.parameters())
    else:
        on_cuda = target is not None and torch.device(target).type == "cuda"
    if on_cuda:
        kernel_rows.import_in_background()


def kernel_chosen() -> bool:
    """Whether a call of this process was decided to a kernel row (forced or measured; until clear_cache). Passes
    that are no rows (TAEHV's output frames) follow it: before tuning has answered, a process runs PyTorch only,
    so its first calls load and compile nothing."""
    return decide.state.kernel_chosen


def poll() -> None:
    """Put in effect what the tuning process has answered, on this thread (unless it captures a CUDA graph).
    Every dispatched call and every graph replay of ours does this; call it where you replay graphs of your own."""
    tuner.poll()
    if decide.state.deferred and not kernel_rows.importing():
        decide.end_deferral()


def wait_for_tuning(timeout: float | None = None) -> bool:
    """Block until the tuning process has answered every job sent and put the decisions in effect. Returns
    False if `timeout` seconds passed first. For tools and tests; calls never need it."""
    return tuner.wait(timeout)


def tuning_status() -> TuningStatus:
    """Jobs pending (sent, not yet in effect), jobs done, the last failure, the generation and the tuning
    processes alive."""
    return tuner.status()
