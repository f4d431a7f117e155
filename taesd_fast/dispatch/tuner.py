"""Subprocess tuning, the user's side: calls auto mode has no timings for run PyTorch at once, and their metadata
goes to a tuning process (tune_worker.py), which compiles and times the candidates there.

Nothing here touches CUDA. A job holds the call's metadata only (Spec, shapes, strides, dtypes, devices), never the
caller's tensors. One process per GPU is started with Popen at the first miss; it exits by itself when its queue is
empty, when this process exits (stdin closed) or dies. A thread per tuning process reads its answers into `results`;
the calls pick them up on their own thread (`poll`, a cheap check at the start of each dispatched call and each
graph replay): the decision is made from the timings the child stored, the chosen kernels load from the on-disk
caches when the call next launches them, and `decide.publish` moves the generation so that graphs captured with the
old decisions are captured again. Nothing is picked up while the calling stream captures a CUDA graph.

Answers are published together once the tuning process says its queue is empty (or PUBLISH_AFTER_S after the
first unpublished one), so a graph is captured again once per round, not once per tuned layer. A tuning process
that dies or runs a job past JOB_TIMEOUT_S costs one warning: its jobs count as failed and their calls keep running
PyTorch.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import kernel_env
from . import decide, measure, store, table
from .spec import Spec, meta_to_json, spec_to_json

JOB_TIMEOUT_S = float(os.environ.get("TAESD_FAST_TUNING_TIMEOUT_S", 300))
PUBLISH_AFTER_S = 3.0
_CACHE_VARS = ("TAESD_FAST_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass
class TuningStatus:
    pending: int  # jobs sent and not yet in effect
    done: int  # jobs in effect since the last clear_cache()
    last_error: str | None  # the last job failure, if any
    generation: int  # decide.state.generation: moves when tuned decisions replace earlier ones
    processes: list = field(default_factory=list)  # pids of the tuning processes alive
    peak_gpu_mb: float = 0.0  # the largest GPU memory a tuning process's allocator held (no CUDA context)


@dataclass
class _Job:
    id: int
    spec: Spec
    graph: bool
    key: tuple  # the call key (calls.py) the decision is cached under
    epoch: int
    meta: tuple  # spec.args_meta of the call (sent again if a process exits before taking the job)


class _Worker:
    """One tuning process and the thread that reads its answers."""

    def __init__(self, device: str):
        self.device = device
        self.jobs: dict[int, _Job] = {}  # sent, not answered
        self.running: tuple[int, float] | None = None  # (job id, start time)
        self.owner = os.getpid()
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # where `import taesd_fast` found this package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env["TAESD_FAST_TUNER_STARTED"] = repr(time.time())  # its log says how long its imports took
        log = _log_file()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "taesd_fast.dispatch.tune_worker", str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write_fd,), env=env,
                start_new_session=True)  # the terminal's Ctrl-C goes to the user's process alone
        finally:
            os.close(write_fd)
            log.close()
        self.answers = os.fdopen(read_fd, "r")
        self.reader = threading.Thread(target=self._read, name=f"taesd_fast-tuner-{device}", daemon=True)
        self.reader.start()

    def send(self, job: _Job, message: dict) -> bool:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # it has exited: the caller starts another
            return False
        self.jobs[job.id] = job
        return True

    def close(self) -> None:
        """Tell it that no more jobs come: it finishes the one it is on (within its grace period) and exits."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def _read(self) -> None:
        global _peak_mb
        fd = self.answers.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                running = self.running
                if running is not None and time.monotonic() - running[1] > JOB_TIMEOUT_S:
                    self.proc.kill()
                    self._end(f"the tuning process ran one job over {JOB_TIMEOUT_S:.0f} s and was stopped")
                    return
                continue
            line = self.answers.readline()
            if not line:
                code = self.proc.wait()
                self._end(None if code == 0 else f"the tuning process exited with code {code} (log: {log_path()})")
                return
            message = json.loads(line)
            if message["event"] == "start":
                self.running = (message["id"], time.monotonic())
                continue
            with _cv:
                _peak_mb = max(_peak_mb, float(message.get("peak_mb") or 0.0))
                self.running = None
                job = self.jobs.pop(message["id"], None)
                if job is not None:
                    results.append((job, message, time.monotonic()))
                if message.get("idle"):
                    _idle.add(self.device)
                _cv.notify_all()

    def _end(self, error: str | None) -> None:
        """The process is gone: whatever it had not answered counts as failed; if it exited cleanly with jobs
        unanswered, those were sent as it was leaving, and go to a new process instead."""
        with _cv:
            if _workers.get(self.device) is self:
                del _workers[self.device]
            orphans = list(self.jobs.values())
            self.jobs.clear()
            self.running = None
            for job in orphans:
                if error is None and job.epoch == _epoch:
                    _send(job)  # to a new process (no CUDA here: a Popen and a pipe write)
                else:
                    _fail(job, error)
            _idle.add(self.device)
            _cv.notify_all()
        self.answers.close()


_cv = threading.Condition()
_ids = itertools.count(1)
_workers: dict[str, _Worker] = {}
_pending: set = set()  # (graph, call key) sent and not yet collected
_idle: set = set()  # devices whose tuning process said its queue is empty
results: list = []  # (job, answer, arrival time): read by poll() on every call, so kept a plain list
_done = 0
_peak_mb = 0.0
_last_error: str | None = None
_warned = False
_epoch = 0


def log_path() -> Path:
    return kernel_env.cache_dir() / "dispatch" / "tuner.log"


def _log_file():
    """The tuning process's stdout and stderr (compiler output, tracebacks): appended, restarted past 8 MiB."""
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        big = path.exists() and path.stat().st_size > (8 << 20)
        return open(path, "wb" if big else "ab")
    except OSError:
        return open(os.devnull, "wb")


def submit(spec: Spec, graph: bool, key: tuple, meta: tuple) -> None:
    """Send a call's metadata to the tuning process of its device (started if none runs); no-op if it was sent."""
    with _cv:
        if (graph, key) in _pending:
            return
        _pending.add((graph, key))
        _send(_Job(next(_ids), spec, graph, key, _epoch, meta))


def _send(job: _Job) -> None:
    """Under _cv."""
    message = {"id": job.id, "spec": spec_to_json(job.spec), "graph": job.graph, "meta": meta_to_json(job.meta),
               "path": str(store.timings_path()), "env": {v: os.environ.get(v) for v in _CACHE_VARS},
               "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
    _idle.discard(job.spec.device)
    for _ in range(2):
        worker = _workers.get(job.spec.device)
        if worker is None or worker.owner != os.getpid():
            try:
                worker = _workers[job.spec.device] = _Worker(job.spec.device)
            except OSError as e:
                _fail(job, f"could not start the tuning process: {e}")
                return
        if worker.send(job, message):
            return
        _workers.pop(job.spec.device, None)
    _fail(job, "the tuning process did not take the job")


def _fail(job: _Job, error: str) -> None:
    """Under _cv: the job's answer is a failure (its calls keep running PyTorch)."""
    results.append((job, {"error": error, "ms": {}, "failed": {}}, time.monotonic()))


def poll() -> None:
    """The cheap check at the start of a call: pick up what the tuning processes answered, on this thread."""
    if results and _ready_to_publish():
        collect()


def _ready_to_publish() -> bool:
    busy = any(w.jobs for w in list(_workers.values()))
    return not busy or len(_idle) > 0 or time.monotonic() - results[0][2] > PUBLISH_AFTER_S


def collect() -> bool:
    """Decide every answered job from the timings the tuning process stored, and publish the decisions. Returns
    False (doing nothing) while the calling stream captures a CUDA graph."""
    global _done, _last_error, _warned
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return False
    with _cv:
        answered, results[:] = list(results), []
        _idle.clear()
    finals, changed, first_error = {}, False, None
    for job, answer, _ in answered:
        with _cv:
            _pending.discard((job.graph, job.key))
        if job.epoch != _epoch:
            continue
        spec, error = job.spec, answer.get("error")
        try:
            rec = _decide(job, answer) if error is None else None
        except Exception as e:  # noqa: BLE001 - deciding (importing a kernel module) failed here: PyTorch
            error, rec = measure.error_line(e), None
        if rec is None:
            rec = decide.provisional(spec)
            rec.why = f"PyTorch: tuning failed ({error})"
            _last_error = error
            first_error = first_error or (spec, error)
        finals[(job.graph, job.key)] = rec
        changed = changed or rec.choice != table.reference(spec.kind).name
        _done += 1
    if finals:
        decide.publish(finals, changed)
    with _cv:
        _cv.notify_all()
    if first_error is not None and not _warned:
        _warned = True
        spec, error = first_error
        warnings.warn(f"taesd_fast: tuning failed for {spec.kind} {spec.x_shape} ({error}); such calls keep running "
                      "PyTorch (dispatch.tuning_status() has the last error)", RuntimeWarning, stacklevel=2)
    return True


def _decide(job: _Job, answer: dict) -> decide.Record:
    spec = job.spec
    rows, skipped = decide.eligible(spec, "auto")
    tkey = spec.key(decide.device_name(spec.device), job.graph)
    store.remember(tkey, answer.get("ms", {}), answer.get("failed", {}))
    entry = store.get(tkey)
    why = "measured in the tuning process" if answer.get("ms") else "cached timings"
    if not any(r.kernel for r in rows):
        return decide.pick(spec, "auto", rows, skipped, None, "", job.graph)
    return decide.pick(spec, "auto", rows, skipped, entry, why, job.graph)


def wait(timeout: float | None = None) -> bool:
    """Block until every job sent is answered, then put the answers in effect (on this thread). False if
    `timeout` seconds passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _cv:
            done = _cv.wait_for(lambda: not any(w.jobs for w in _workers.values()),
                                None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not done:
            return False
        if not results:
            return True
        if not collect():
            return False  # capturing: nothing can be put in effect now


def status() -> TuningStatus:
    with _cv:
        pending = len(_pending)
        pids = [w.proc.pid for w in _workers.values() if w.proc.poll() is None]
        return TuningStatus(pending, _done, _last_error, decide.state.generation, pids, _peak_mb)


def reset() -> None:
    """Forget jobs and answers (clear_cache); the tuning processes are told to finish and exit."""
    global _done, _last_error, _epoch
    with _cv:
        _epoch += 1
        _pending.clear()
        results.clear()
        _idle.clear()
        _done, _last_error = 0, None
        for worker in list(_workers.values()):
            worker.jobs.clear()  # answers to them are dropped
            worker.close()
        _workers.clear()
        _cv.notify_all()


@atexit.register
def _stop() -> None:
    """At exit: close the tuning processes' stdin and return at once. Each finishes its current job if it can
    within its grace period (the timings are kept) and exits; none outlives this process by more than that."""
    for worker in list(_workers.values()):
        if worker.owner == os.getpid():
            worker.close()
