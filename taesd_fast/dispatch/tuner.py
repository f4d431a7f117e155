"""The background tuner: one daemon thread that times the candidates of calls auto mode had no timings for, while
those calls run PyTorch.

A job holds the call's metadata only (Spec, shapes, strides, dtypes, devices), never the caller's tensors. Specs
that a CUDA graph will replay go first: that is what a user's repeated call runs from its third call on. For each
job the thread finds the eligible rows, times them unless timings are stored (disk and memory), picks the winner
and loads its kernel, so a later call, or a capture, launches it without compiling anything. When the queue
drains, the new decisions are published (`decide.publish`): if any differs from what the calls ran meanwhile,
`decide.state.generation` moves and `graphs.GraphCache` captures those calls again with the tuned kernels.

The thread runs on its own CUDA stream and holds `measure.gpu_lock` around each GPU step (`measure.tuner_step`),
never the decision lock while measuring. It is silent; if a job fails, one warning says so and those calls keep running PyTorch."""

from __future__ import annotations

import atexit
import heapq
import itertools
import threading
import warnings
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from .. import _backend
from . import decide, measure, store, table
from .spec import Spec


@dataclass
class TuningStatus:
    pending: int  # jobs queued or running
    done: int  # jobs finished since the last clear_cache()
    last_error: str | None  # the last job failure, if any
    generation: int  # decide.state.generation: moves when tuned decisions replace earlier ones


@dataclass
class _Job:
    spec: Spec
    graph: bool
    key: tuple  # the call key (calls.py) the decision is cached under
    meta: tuple  # spec.args_meta of the call
    path: object  # the timings file when the job was queued
    epoch: int


_cv = threading.Condition()
_queue: list = []  # heap of (priority, seq, job): graph-replayed specs first, then first come first served
_seq = itertools.count()
_pending: set = set()  # (graph, key) queued or running
_running: _Job | None = None
_round: dict = {}  # (graph, key) -> Record, published when the queue drains
_changed = False
_done = 0
_last_error: str | None = None
_warned = False
_epoch = 0
_thread: threading.Thread | None = None
_streams: dict = {}
_stopping = False
_releasing = False  # the queue drained and the tuner's memory is being returned: wait() waits for that too


def submit(spec: Spec, graph: bool, key: tuple, meta: tuple) -> None:
    """Queue a spec (no-op if it is queued or running already); starts the thread on first use."""
    global _thread
    with _cv:
        if (graph, key) in _pending or _stopping:
            return
        _pending.add((graph, key))
        job = _Job(spec, graph, key, meta, store.timings_path(), _epoch)
        heapq.heappush(_queue, (0 if graph else 1, next(_seq), job))
        if _thread is None:
            _thread = threading.Thread(target=_work, name="taesd_fast-tuner", daemon=True)
            _thread.start()
        _cv.notify_all()


def wait(timeout: float | None = None) -> bool:
    """Block until every queued job is done and published; False if `timeout` seconds passed first."""
    with _cv:
        return _cv.wait_for(lambda: not _queue and _running is None and not _releasing, timeout)


def status() -> TuningStatus:
    with _cv:
        return TuningStatus(len(_queue) + (_running is not None), _done, _last_error, decide.state.generation)


def reset() -> None:
    """Drop queued jobs and forget results (clear_cache); a job already running finishes but is not published."""
    global _round, _changed, _done, _last_error, _epoch
    with _cv:
        _queue.clear()
        _pending.clear()
        if _running is not None:
            _pending.add((_running.graph, _running.key))
        _round, _changed, _done, _last_error = {}, False, 0, None
        _epoch += 1
        _cv.notify_all()


def _stream(device: str):
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(torch.device(device))
    return _streams[device]


def _tune(job: _Job) -> decide.Record:
    """The decision for one job, timing and loading kernels as needed. Holds no lock but gpu_lock's steps."""
    spec, graph = job.spec, job.graph
    with ExitStack() as ctx:
        ctx.enter_context(torch.no_grad())
        if spec.on_cuda:
            with measure.tuner_step():  # creating a stream and probing NVRTC (it loads a module) stay out of captures
                stream = _stream(spec.device)
                _backend.kernels_unavailable_reason(spec.device)
            ctx.enter_context(torch.cuda.device(torch.device(spec.device)))
            ctx.enter_context(torch.cuda.stream(stream))
        rows, skipped = decide.eligible(spec, "auto")
        if not any(r.kernel for r in rows):
            return decide.pick(spec, "auto", rows, skipped, None, "", graph)
        tkey = spec.key(decide.device_name(spec.device), graph)
        entry, why = store.get(tkey), "cached timings"
        if decide.needs_timing(rows, entry):
            ms, failed = measure.time_candidates(rows, spec, job.meta, graph)
            store.put(tkey, ms, failed, job.path)
            entry, why = {"ms": ms, "failed": failed}, "measured in the background"
        rec = decide.pick(spec, "auto", rows, skipped, entry, why, graph)
        row = table.row(spec.kind, rec.choice)
        if row.kernel and not row.ready(spec):
            measure.warm(row, spec, job.meta)
        return rec


def _release_memory() -> None:
    """Return the stand-ins' memory to the driver when the queue drains: the caching allocator keeps blocks per
    stream, so what the tuner's stream cached could not serve the caller's allocations. Under gpu_lock: no
    capture of ours is under way."""
    if _streams:
        with measure.tuner_step():
            torch.cuda.empty_cache()


def _work() -> None:
    global _running, _round, _changed, _done, _last_error, _warned, _releasing
    while True:
        with _cv:
            while not _queue:
                _cv.wait()
            job = heapq.heappop(_queue)[2]
            _running = job
        error = None
        try:
            rec = _tune(job)
        except Exception as e:  # noqa: BLE001 - the calls keep running PyTorch; say so once
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rec = decide.provisional(job.spec)
            rec.why = f"PyTorch: background tuning failed ({error})"
        with _cv:  # lock order: gpu_lock, then _cv (a capture may queue work); never _cv then gpu_lock
            _running = None
            _pending.discard((job.graph, job.key))
            if job.epoch == _epoch:
                _done += 1
                _round[(job.graph, job.key)] = rec
                _changed = _changed or rec.choice != table.reference(job.spec.kind).name
                if error is not None:
                    _last_error = error
            drained = _releasing = not _queue
            if drained:
                decide.publish(_round, _changed)
                _round, _changed = {}, False
            _cv.notify_all()
        if drained:
            try:
                _release_memory()
            finally:
                with _cv:
                    _releasing = False
                    _cv.notify_all()
        if error is not None and not _warned:
            _warned = True
            warnings.warn(f"taesd_fast: background tuning failed for {job.spec.kind} {job.spec.x_shape} ({error}); "
                          "such calls keep running PyTorch (dispatch.tuning_status() has the last error)",
                          RuntimeWarning, stacklevel=1)


@atexit.register
def _stop(timeout: float = 5.0) -> None:
    """At exit: drop queued jobs and give a running one a moment, so the thread is not cut off inside a CUDA call
    while the interpreter tears down."""
    global _stopping
    measure.stop.set()
    with _cv:
        _stopping = True
        _queue.clear()
        _cv.wait_for(lambda: _running is None, timeout)
