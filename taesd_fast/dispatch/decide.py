"""Decisions: which row of the table runs a call, from measured timings.

Backend modes (`backend(mode)` / `set_backend(mode)`):
  "auto"    (default) a custom kernel runs only where it was measured faster than PyTorch/cuDNN on this GPU for this
            exact (shape, dtype, stride, epilogue, layout). Inside `graph_timing()` (entered by `graphs.capture`)
            calls are decided from timings taken as CUDA-graph replays, kept apart from the eager ones.
  "kernels" the fastest measured custom kernel wherever one supports the call (DEFAULT_ORDER when none was
            measured), else PyTorch. Never times. Used by tests.
  "torch"   always PyTorch.

Tuning modes (`tuning(mode)` / `set_tuning(mode)` / TAESD_FAST_TUNING), for a call auto mode has no timings for:
  "subprocess" (default) the call runs PyTorch at once and its metadata goes to a tuning process (tuner.py,
            tune_worker.py) that compiles and times the candidates; a later call picks the results up, the decisions
            change and `generation` moves, so graphs captured before are captured again. No tuning work runs in the
            caller's process.
  "blocking" the call times the candidates itself, then runs the winner (deterministic: benchmarks, warmup).
  "off"     never time: stored timings if any, else PyTorch.

The decision lock guards the decision caches only; nothing holds it while measuring.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .. import _backend, kernel_env
from . import known, measure, store, table
from .spec import Spec

MODES = ("auto", "torch", "kernels")
TUNING_MODES = ("subprocess", "blocking", "off")
MARGIN = 0.98  # a kernel must beat PyTorch by 2% to be picked: timing noise must not flip choices
# (preferred row, the row it is preferred over, slack): a graph decision takes the preferred row where it times within
# the slack of the other. Each row is timed as a replay of its own launches, but a model's graph chains different
# kernels, and there the CUDA tile kernel costs less against triton_conv_tma than those timings say: taking it where
# it was within 0.5-5% took taew2_1's streaming step from 0.580 to 0.557-0.560 ms on an H200, and the reverse swap
# made it slower (BENCHMARKS.md, twenty-third session).
CHAIN_PREFERRED = (("cuda_conv_tiles", "triton_conv_tma", 1.06),)


@dataclass
class Record:
    spec: Spec
    choice: str  # the row's name
    why: str
    ms: dict  # row name -> median ms (timed rows only)
    skipped: dict  # row name -> why it was not eligible
    run: Callable = field(repr=False, compare=False, default=None)


class _State:
    """Process-wide dispatch state. The per-call fast path reads `mode`, `graph` and one `decided` lookup."""

    def __init__(self):
        self.mode = "auto"
        self.graph = False  # inside graph_timing()
        self.tuning: str | None = None  # set_tuning(); None: TAESD_FAST_TUNING or "subprocess"
        self.decided: dict[tuple, Record] = {}  # (mode, graph, call key) -> decision
        self.final: dict[tuple, Record] = {}  # (graph, call key) -> the decision from the tuning process
        self.generation = 0  # moves when tuned decisions replace earlier ones: graphs captured before are stale
        self.kernel_chosen = False  # a call of this process was decided to a kernel row (until clear())
        self.deferred = False  # a call ran PyTorch while the kernel modules were imported (see defer)


state = _State()
lock = threading.RLock()  # the decision lock
records: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, Record]]" = weakref.WeakKeyDictionary()
_gpu_names: dict[str, str] = {}


# ----------------------------------------------------------------------------- modes


def set_backend(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"backend mode must be one of {MODES}, got {mode!r}")
    state.mode = mode


def get_backend() -> str:
    return state.mode


@contextlib.contextmanager
def _switched(field: str, setter, value):
    """state.<field> set through `setter` for the with block, then restored."""
    prev = getattr(state, field)
    setter(value)
    try:
        yield
    finally:
        setattr(state, field, prev)


def backend(mode: str):
    """with backend("torch"|"kernels"|"auto"): ... restores the previous mode on exit."""
    return _switched("mode", set_backend, mode)


def set_tuning(mode: str | None) -> None:
    """"subprocess" | "blocking" | "off", or None to follow TAESD_FAST_TUNING again (default subprocess)."""
    if mode is not None and mode not in TUNING_MODES:
        raise ValueError(f"tuning mode must be one of {TUNING_MODES}, got {mode!r}")
    state.tuning = mode


def get_tuning() -> str:
    if state.tuning is not None:
        return state.tuning
    env = os.environ.get("TAESD_FAST_TUNING", "").strip().lower() or "subprocess"
    if env not in TUNING_MODES:
        raise ValueError(f"TAESD_FAST_TUNING must be one of {TUNING_MODES}, got {env!r}")
    return env


def tuning(mode: str):
    """with tuning("blocking"|"off"|"subprocess"): ... restores the previous tuning mode on exit."""
    return _switched("tuning", set_tuning, mode)


@contextlib.contextmanager
def graph_timing():
    """Decide for calls that a CUDA graph will replay: candidates are timed as graph replays, so a launch's CPU
    cost (a Triton launch: ~0.1 ms on the H200's host) counts for nothing, as in the replay. Eager timing charges
    it and keeps cuDNN on small layers where our kernels are faster on the GPU. Eager calls outside this context
    keep their own decisions."""
    prev = state.graph
    state.graph = True
    try:
        yield
    finally:
        state.graph = prev


# ----------------------------------------------------------------------------- eligibility


def device_name(device: str) -> str:
    """The GPU's name in timings keys ("cpu" for CPU calls)."""
    if not device.startswith("cuda"):
        return device.split(":")[0]
    if device not in _gpu_names:
        _gpu_names[device] = torch.cuda.get_device_name(torch.device(device)).replace("|", "/")
    return _gpu_names[device]


def capturing(spec: Spec) -> bool:
    return spec.on_cuda and torch.cuda.is_current_stream_capturing()


def _device_reason(row: table.Row, spec: Spec) -> str | None:
    if spec.device.split(":")[0] not in row.devices:
        return "CPU tensor" if spec.device == "cpu" else f"{spec.device} tensor"
    if row.kernel and kernel_env.kernels_disabled():  # the switch covers the Triton kernels too
        return "disabled by TAESD_FAST_DISABLE_KERNELS"
    return None


def tunable(spec: Spec) -> bool:
    """Whether some kernel row could run this call, by the cheap checks (device, kill switch) alone: the tuner
    does the rest, so a call never imports a kernel module or compiles a probe while deciding to run PyTorch."""
    return any(r.kernel and _device_reason(r, spec) is None for r in table.rows(spec.kind))


def eligible(spec: Spec, mode: str = "auto", in_capture: bool = False) -> tuple[list[table.Row], dict]:
    """Rows of spec.kind that support it, and why each other row does not. Auto mode leaves out kernels that read
    another layout than the input's: converting on the way in hands the next layer a different layout too, a cost
    that timing the kernel alone would hide (seen on the H200: TAESD encode 12% slower)."""
    out, skipped, nvrtc_reason = [], {}, None
    for row in table.rows(spec.kind):
        why = _device_reason(row, spec) or row.supports(spec)
        if why is None and row.kernel and row.nvrtc:
            if nvrtc_reason is None:
                if in_capture and not _backend.probed(spec.device):
                    nvrtc_reason = "kernels not probed before CUDA-graph capture (probing compiles and loads a module)"
                else:
                    nvrtc_reason = _backend.kernels_unavailable_reason(spec.device) or ""
            why = nvrtc_reason or None
        if why is None and mode == "auto" and row.kernel and spec.layout not in row.layouts:
            why = f"input is {spec.layout}; kernel reads {'/'.join(row.layouts)} natively"
        if why is None:
            out.append(row)
        else:
            skipped[row.name] = why
    return out, skipped


# ----------------------------------------------------------------------------- picking


def _record(spec: Spec, name: str, why: str, ms: dict, skipped: dict) -> Record:
    return Record(spec, name, why, ms, skipped, table.row(spec.kind, name).run)


def needs_timing(rows: list[table.Row], entry: dict | None) -> bool:
    if not any(r.kernel for r in rows):
        return False
    return entry is None or any(r.name not in entry["ms"] and r.name not in entry.get("failed", {}) for r in rows)


def _chain_preference(best: str, timed: dict, why: str) -> tuple[str, str]:
    """(row, why) after CHAIN_PREFERRED: the fastest timed row, or the row preferred over it within the slack."""
    for preferred, over, slack in CHAIN_PREFERRED:
        if best == over and preferred in timed and timed[preferred] <= slack * timed[over]:
            return preferred, f"{why}; {preferred} within {slack - 1:.0%} of {over}, taken (faster in a chain)"
    return best, why


def pick(spec: Spec, mode: str, rows: list[table.Row], skipped: dict, entry: dict | None, why: str,
         graph: bool) -> Record:
    """The decision from timings (`entry`, possibly None) without timing anything: in auto mode the fastest kernel
    if it beats PyTorch by the margin, else PyTorch; in kernels mode the fastest kernel, or DEFAULT_ORDER's first.
    For graph replays, "the fastest kernel" is after CHAIN_PREFERRED."""
    ref = table.reference(spec.kind).name
    kernels = [r.name for r in rows if r.kernel]
    if mode == "torch" or not kernels:
        first = next(iter(skipped.items()), None)
        why = "forced torch" if mode == "torch" else (
            "no custom kernel for this call" + (f" ({first[0]}: {first[1]})" if first else ""))
        return _record(spec, ref, why, {}, skipped)
    if graph:
        why += " (graph replays)"
    failed = dict(entry.get("failed", {})) if entry else {}
    ms = {n: t for n, t in (entry or {}).get("ms", {}).items() if n == ref or n in kernels}
    skipped = dict(skipped, **failed)
    timed = {n: t for n, t in ms.items() if n != ref and n not in failed}
    best = min(timed, key=timed.get) if timed else None
    if graph and best is not None:
        best, why = _chain_preference(best, timed, why)
    if mode == "kernels":
        if best is not None:
            return _record(spec, best, f"forced kernels, {why}", ms, skipped)
        untried = [n for n in table.forced_order(spec.layout) if n in kernels and n not in failed]
        if untried:
            return _record(spec, untried[0], f"forced kernels, default order ({why})", ms, skipped)
        return _record(spec, ref, "forced kernels, but every kernel failed", ms, skipped)
    if best is not None and ref in ms and timed[best] < MARGIN * ms[ref]:
        return _record(spec, best, why, ms, skipped)
    return _record(spec, ref, why, ms, skipped)


def time_shortlist(spec: Spec, rows: list[table.Row], meta: tuple, graph: bool, **options) -> tuple[dict, dict]:
    """(ms, failed) of the rows worth timing (known.shortlist: on a GPU model the package was measured on, the rows
    that lost clearly there are not compiled again); the rows left out are in failed with the reason."""
    rows, left_out = known.shortlist(device_name(spec.device), spec, graph, rows)
    if not any(r.kernel for r in rows):
        return {}, left_out
    ms, failed = measure.time_candidates(rows, spec, meta, graph, **options)
    return ms, {**left_out, **failed}


def provisional(spec: Spec) -> Record:
    """What a call runs while the tuning process works on its spec: PyTorch."""
    return _record(spec, table.reference(spec.kind).name, "PyTorch while the tuning process times kernels", {}, {})


def defer(spec: Spec) -> Record:
    """What a call runs, undecided and not remembered, while the kernel modules are imported in the background
    (kernels.rows.importing): PyTorch. Deciding now could pick a kernel, and its first launch would wait for the
    imports and Triton's cache key (~0.4 s each in a new process). The next call decides again; `end_deferral`
    makes graphs captured meanwhile stale."""
    state.deferred = True
    return _record(spec, table.reference(spec.kind).name, "PyTorch while the kernel modules are imported", {}, {})


def capture_again() -> None:
    """A call inside a CUDA-graph capture ran PyTorch, or a simpler form, because what its kernel needs could not be
    prepared there (loading a module, packing a weight): graphs captured now are captured again once the next
    dispatch.poll finds no imports running (`end_deferral`), and that call's warm-up prepares it."""
    state.deferred = True


def end_deferral() -> None:
    """Once the imports are done (dispatch.poll): graphs captured with deferred calls are captured again."""
    with lock:
        if state.deferred:
            state.deferred = False
            state.generation += 1


def decide_now(spec: Spec, mode: str, graph: bool, meta: Callable[[], tuple], tuning_mode: str) -> Record | None:
    """A decision in the calling thread: from stored timings, timing the candidates first in blocking tuning mode
    (not while torch.compile traces or a CUDA graph captures). `meta()` gives the call's argument metadata.
    In subprocess tuning, None when the candidates need timing: the caller sends them to the tuning process."""
    in_capture = capturing(spec)
    rows, skipped = eligible(spec, mode, in_capture)
    if mode == "torch" or not any(r.kernel for r in rows):
        return pick(spec, mode, rows, skipped, None, "", graph)
    key = spec.key(device_name(spec.device), graph)
    entry = store.get(key)
    why = "cached timings"
    if mode == "auto" and needs_timing(rows, entry):
        if tuning_mode == "subprocess":
            return None
        if tuning_mode != "blocking":
            why = "not timed (tuning off)"
        elif in_capture or torch.compiler.is_compiling():
            why = "not timed (compiling/capturing)"
        else:
            ms, failed = time_shortlist(spec, rows, meta(), graph, progress=True)
            store.put(key, ms, failed)
            entry, why = {"ms": ms, "failed": failed}, "measured"
    elif entry is None:
        why = "no timings"
    return pick(spec, mode, rows, skipped, entry, why, graph)


# ----------------------------------------------------------------------------- the tuning process's results


def publish(finals: dict[tuple, Record], changed: bool) -> None:
    """Called (tuner.collect, on a calling thread) with the tuning process's answers: its decisions replace the
    provisional ones. If any changed,
    the decision cache is emptied (the next call of each spec re-decides from `final`) and `generation` moves,
    so graphs captured with the old decisions are captured again."""
    with lock:
        state.final.update(finals)
        if changed:
            state.decided.clear()
            state.generation += 1
        else:  # same choices: only the records' reasons and timings are new
            for graph, key in finals:
                state.decided.pop(("auto", graph, key), None)


def clear() -> None:
    """Forget in-process decisions, the tuning process's results and the per-layer records; graphs captured before are
    stale (generation moves)."""
    with lock:
        state.decided.clear()
        state.final.clear()
        records.clear()
        state.kernel_chosen = False
        state.generation += 1
