"""Timing a call's candidate rows on the GPU, on random stand-ins built from the call's metadata.

`gpu_lock` orders the GPU work of tuning against CUDA-graph captures: tuning holds it around each candidate's
compile / warm-up / capture / timing step (`tuner_step`) and `graphs.capture` holds it around its warm-up and capture
(`capture_turn`), so no synchronize, allocation or module load from tuning lands inside a capture. Even a capture
in "thread_local" mode is invalidated by another thread's synchronize on the same GPU. A capture that may not wait
(GraphCache in background tuning) takes the lock only if it is free, else asks the tuner to pause at its next step
boundary and runs eagerly this once. The lock is never held together with the decision lock."""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time

import torch
from tqdm import tqdm

from .. import timing
from .spec import Spec, TensorMeta, fmt_shape
from .table import Row

gpu_lock = threading.RLock()
stop = threading.Event()  # set at interpreter exit: measuring stops between candidates
_capture_wanted = threading.Event()  # a capture found gpu_lock busy: the tuner pauses at its next step boundary
CAPTURE_PAUSE_S = 0.5  # how long the tuner waits for that capture before it goes on


class GpuBusy(RuntimeError):
    """gpu_lock was busy with a tuning step and the capture was not to wait."""


@contextlib.contextmanager
def capture_turn(wait: bool = True):
    """gpu_lock for a CUDA-graph capture. wait=False: raise GpuBusy at once if a tuning step holds it (and have
    the tuner pause at its next step boundary, so the next try finds it free)."""
    if not gpu_lock.acquire(blocking=wait):
        _capture_wanted.set()
        raise GpuBusy("the background tuner is using the GPU")
    try:
        yield
    finally:
        _capture_wanted.clear()
        gpu_lock.release()


@contextlib.contextmanager
def tuner_step():
    """gpu_lock for one GPU step of tuning, after a pause for a capture that asked for the GPU."""
    if _capture_wanted.is_set() and not stop.is_set():
        deadline = time.monotonic() + CAPTURE_PAUSE_S
        while _capture_wanted.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        _capture_wanted.clear()  # the capture did not come back in time: go on
    with gpu_lock:
        yield
REPS, WARMUP = 7, 3
PROGRESS_DELAY_S = 1.0  # the bar appears once timing a call has taken this long; TAESD_FAST_PROGRESS=0 hides it


def _fresh(meta: TensorMeta | None, scale: float = 1.0) -> torch.Tensor | None:
    """Random non-zero stand-in with the metadata's shape, strides, dtype and device."""
    if meta is None:
        return None
    t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
    return t.normal_(0.0, scale)


def _fan_in(w: TensorMeta) -> float:
    n = 1
    for d in w.shape[1:]:
        n *= d
    return n ** -0.5


def fresh_args(kind: str, meta: tuple) -> tuple:
    """A call's arguments rebuilt from `spec.args_meta`: random tensors of the same shapes, strides and dtypes,
    weights scaled like an initialised layer's (so values stay in the range real activations have)."""
    with torch.inference_mode(False), torch.no_grad():
        if kind == "conv2d":
            x, w, b, stride, res, relu, *folds = meta
            return (_fresh(x), _fresh(w, _fan_in(w)), _fresh(b, 0.1), stride, _fresh(res), relu, *folds)
        if kind == "head_full":
            x, cache, gamma, w, b, eps, patch = meta
            return (_fresh(x), _fresh(cache), _fresh(gamma).add_(1.0), _fresh(w, _fan_in(w)), _fresh(b, 0.1), eps,
                    patch)
        x, w, b = meta
        return _fresh(x), _fresh(w, _fan_in(w)), _fresh(b, 0.1)


def _why(prefix: str, e: Exception) -> str:
    return f"{prefix}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def _sync() -> None:
    torch.cuda.current_stream().synchronize()  # this stream only: other threads' work is not waited for


def progress_bar(spec: Spec, candidates: int, show: bool) -> tqdm:
    """A bar over the candidates being compiled and timed, shown once that takes over PROGRESS_DELAY_S."""
    return tqdm(total=candidates, desc=f"taesd_fast: timing kernels for {spec.kind} {fmt_shape(spec.x_shape)} "
                "(once per GPU)", unit="candidate", leave=False, delay=PROGRESS_DELAY_S,
                disable=not show or os.environ.get("TAESD_FAST_PROGRESS", "1") == "0")


def time_candidates(rows: list[Row], spec: Spec, meta: tuple, graph: bool, reps: int = REPS,
                    progress: bool = False) -> tuple[dict, dict]:
    """Median ms per call of each row on fresh random inputs; interleaved reps so clock drift hits all rows alike.
    Returns (ms, failures).

    GPU time is taken from replays of a CUDA graph of the calls (no launch gaps). graph=True returns that alone: it
    is what a replay costs. Otherwise the CPU time of launching the call eagerly is added: in a model's chain of
    layers the launch costs add up (a Triton launch costs ~0.1 ms of CPU on the H200's host), so a kernel that wins
    on the GPU but costs more to launch only pays off where the GPU saving covers its launch."""
    with tuner_step():
        fresh = fresh_args(spec.kind, meta)
    ok, failed, iters, replay = [], {}, {}, {}
    with progress_bar(spec, len(rows), progress) as bar:
        for row in rows:
            if stop.is_set():
                raise RuntimeError("tuning stopped: the interpreter is exiting")
            bar.set_postfix_str(row.name, refresh=False)
            run = row.run
            with tuner_step():
                try:
                    for _ in range(WARMUP):
                        run(*fresh)  # the first run compiles the kernel: the slow part of a first use
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(*fresh)
                    end.record()
                    end.synchronize()
                    # Calls per rep so each rep is ~1 ms of work: one event pair's resolution does not dominate.
                    iters[row.name] = max(1, min(50, int(1.0 / max(start.elapsed_time(end), 1e-3))))
                except Exception as e:  # noqa: BLE001 - a kernel that cannot build or launch here is no candidate
                    failed[row.name] = _why("failed", e)
                else:
                    try:
                        replay[row.name] = timing.capture_calls(lambda run=run: run(*fresh), iters[row.name])
                        replay[row.name]()
                        _sync()
                        ok.append(row)
                    except Exception as e:  # noqa: BLE001
                        failed[row.name] = _why("failed in a CUDA graph", e)
            bar.update()
    events = {r.name: [] for r in ok}
    launch_ms = {r.name: [] for r in ok}
    for _ in range(reps):
        with tuner_step():
            for row in ok:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                timing.busy_gpu()  # keeps the replay's submission out of the timed span
                s.record()
                replay[row.name]()
                e.record()
                events[row.name].append((s, e))
                if not graph:
                    run, n = row.run, iters[row.name]
                    t0 = time.perf_counter()
                    for _ in range(n):
                        run(*fresh)
                    launch_ms[row.name].append((time.perf_counter() - t0) * 1e3 / n)
            _sync()  # keeps the launch loops from queueing behind each other's GPU work
    ms = {}
    for name, ev in events.items():
        ms[name] = statistics.median(s.elapsed_time(e) / iters[name] for s, e in ev)
        if not graph:
            ms[name] += statistics.median(launch_ms[name])
    return ms, failed


def warm(row: Row, spec: Spec, meta: tuple) -> None:
    """Run a row twice on stand-ins so its kernel is compiled and loaded (then `row.ready` holds and a CUDA-graph
    capture may use it)."""
    with tuner_step():
        fresh = fresh_args(spec.kind, meta)
        run = row.run
        run(*fresh)
        run(*fresh)
        if spec.on_cuda:
            _sync()
