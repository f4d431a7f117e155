"""The tuning process: `python -m taesd_fast.dispatch.tune_worker RESULT_FD`, started by tuner.py, never imported
by the user's process.

It reads jobs from stdin, one JSON object a line: the call's metadata only (Spec, argument shapes, strides, dtypes
and devices, the timings file, the cache folders). For each it finds the eligible rows, compiles them, times them on
stand-ins from its own generator, writes the timings to the store and the compiled kernels to the on-disk caches,
and answers on RESULT_FD:
{"event": "start", "id"} when it begins a job, {"event": "done", "id", "ms", "failed", "error", "idle"} when it
ends one ("idle": nothing else is queued). Before timing a job it hands the kernels of every queued job to the
compile workers (compile_pool.py: processes without CUDA), so the compiles of a first use run side by side.

All GPU work of tuning happens here, so none of it can meet the user's synchronizes, RNG draws or captures. Before a
job it checks the GPU's free memory: a job that needs more than the budget (the smaller of
TAESD_FAST_TUNING_MEMORY_MB, default 4096, and 10% of free memory) is not timed and its calls stay on PyTorch; the
allocator is capped at the budget too, so a wrong estimate fails a candidate, not the user's allocation.

It exits when its queue has been empty for IDLE_EXIT_S, and when its parent goes (stdin closed or the parent
process gone): it goes on with the jobs it has for at most EXIT_GRACE_S, so quick work is kept, then stops (at most
EXIT_GRACE_S after its own start where the parent went before any job began: during its imports). Should
the thread that ends it then not get the GIL (a call holding it), faulthandler's watchdog, a native thread, writes
every thread's stack to the log and exits BACKSTOP_S later.
"""

from __future__ import annotations

import faulthandler
import heapq
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path

from .. import kernel_env
from . import compile_pool

IDLE_EXIT_S = 2.0
EXIT_GRACE_S = 5.0
BACKSTOP_S = 2.0
MEMORY_SHARE = 0.10  # of the GPU's free memory
DEFAULT_MEMORY_MB = 4096


class _Inbox:
    """Jobs read from stdin, graph-replayed specs first; records when the parent has gone."""

    def __init__(self, before_exit=lambda: None, started: float | None = None):
        self.cv = threading.Condition()
        self.heap: list = []
        self.parent_gone = False
        self.began = False  # a job has been handed out
        self.timer: threading.Timer | None = None  # the grace period's exit, once the parent has gone
        self.before_exit = before_exit  # run just before the grace period's exit (stops the compile workers)
        self.started = time.time() if started is None else started  # when the parent started this process

    def read(self, stream) -> None:
        for line in stream:
            line = line.strip()
            if not line:
                continue
            job = json.loads(line)
            with self.cv:
                heapq.heappush(self.heap, (0 if job.get("graph") else 1, job["id"], job))
                self.cv.notify_all()
        self.gone("stdin closed")

    def watch(self, parent: int) -> None:
        while not self.parent_gone:
            time.sleep(0.5)
            if os.getppid() != parent:
                self.gone("the parent process exited")

    def gone(self, why: str) -> None:
        """The parent closed stdin or died: go on for at most the grace period, then exit. Before any job began
        (the parent went while this process was still importing, which takes seconds on a loaded machine) the
        parent may have gone at any moment since the start, so the grace period counts from the start."""
        with self.cv:
            if self.parent_gone:
                return
            self.parent_gone = True
            queued = len(self.heap)
            grace = EXIT_GRACE_S if self.began else max(0.0, self.started + EXIT_GRACE_S - time.time())
            self.cv.notify_all()
        print(f"{_now()} {why}: exiting within {grace:.1f} s ({queued} jobs queued)", flush=True)
        faulthandler.dump_traceback_later(grace + BACKSTOP_S, exit=True)  # to stderr: the log
        self.timer = threading.Timer(grace, self._exit)
        self.timer.daemon = True
        self.timer.start()

    def _exit(self) -> None:
        try:
            self.before_exit()
        finally:
            os._exit(0)

    def next(self):
        """The next job, or None when it is time to exit (idle, or the parent gone and nothing left)."""
        with self.cv:
            self.cv.wait_for(lambda: self.heap or self.parent_gone, IDLE_EXIT_S)
            if not self.heap:
                return None
            self.began = True
            return heapq.heappop(self.heap)[2]

    def queued(self) -> list[dict]:
        """The jobs waiting, in the order they will run."""
        with self.cv:
            return [entry[2] for entry in sorted(self.heap)]

    def idle(self) -> bool:
        with self.cv:
            return not self.heap


def _setup_hook() -> None:
    """TAESD_FAST_TUNER_SETUP=module:function is called once at start: the CPU tests install a fake row set and
    a fake measure with it, so the protocol runs end to end in CI."""
    hook = os.environ.get("TAESD_FAST_TUNER_SETUP", "").strip()
    if hook:
        module, _, func = hook.partition(":")
        getattr(importlib.import_module(module), func)()


def _memory_budget(device: str) -> int:
    import torch

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    limit = int(float(os.environ.get("TAESD_FAST_TUNING_MEMORY_MB", DEFAULT_MEMORY_MB)) * (1 << 20))
    return min(limit, int(MEMORY_SHARE * free))


def _cap_allocator(device: str, budget: int) -> None:
    import torch

    from . import measure

    measure.capped = True
    d = torch.device(device)
    total = torch.cuda.get_device_properties(d).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(d) + budget) / total), d)


def _job(job: dict) -> tuple:
    """(spec, argument metadata, graph, eligible rows, skipped rows) of a job, with the parent's cache folders (as
    they were at the time of the call) applied to this process."""
    from . import decide
    from .spec import meta_from_json, spec_from_json

    kernel_env.apply_env(job.get("env", {}))
    spec, meta, graph = spec_from_json(job["spec"]), meta_from_json(job["meta"]), bool(job["graph"])
    return (spec, meta, graph, *decide.eligible(spec, "auto"))


class _Compiles:
    """The queued jobs' candidate kernels handed to the compile workers (compile_pool.py) ahead of their timing."""

    def __init__(self):
        self.workers = compile_pool.default_workers()
        self.pool: compile_pool.CompilePool | None = None
        self.futures: dict[int, list] = {}

    def plan(self, job: dict) -> None:
        """Record what the job's shortlisted kernel rows compile and submit it (once per job; CUDA jobs only). If
        that fails (the workers cannot start here, say), the workers are given up for this process, with a line in
        the log: the timing runs compile as they would without them, and no job fails for it."""
        if self.workers == 0 or job["id"] in self.futures:
            return
        self.futures[job["id"]] = []
        try:
            self._plan(job)
        except Exception as e:  # noqa: BLE001 - the workers only save time
            from .measure import error_line

            print(f"{_now()} compile workers given up: {error_line(e)}", flush=True)
            self.close()
            self.workers, self.pool = 0, None
            self.futures = {}

    def _plan(self, job: dict) -> None:
        import torch

        from . import decide, known, measure, store

        spec, meta, graph, rows, _ = _job(job)
        if not spec.on_cuda or not decide.needs_timing(rows, store.get(spec.key(decide.device_name(spec.device),
                                                                                  graph))):
            return
        rows, _ = known.shortlist(decide.device_name(spec.device), spec, graph, rows)
        kernels = [r for r in rows if r.kernel]
        budget = _memory_budget(spec.device)
        if not kernels or measure.bytes_needed(spec, meta) > budget:
            return
        if self.pool is None:  # its processes start while the first job records
            self.pool = compile_pool.CompilePool(self.workers)
        _cap_allocator(spec.device, budget)
        with torch.cuda.device(torch.device(spec.device)), torch.no_grad():
            tasks = compile_pool.record(kernels, lambda: measure.fresh_args(spec.kind, meta))
        self.futures[job["id"]] = self.pool.submit(tasks, job.get("env", {}))

    def wait(self, job: dict) -> str:
        """Wait for the job's compiles; a note for the job's log line."""
        futures = self.futures.pop(job["id"], [])
        if not futures:
            return ""
        t0 = time.perf_counter()
        done, errors = compile_pool.wait(futures)
        return (f", {done}/{len(futures)} compiles by the workers (waited {time.perf_counter() - t0:.1f} s)"
                + "".join(f"\n  compile worker: {e}" for e in errors[:3]))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def tune(job: dict, note: str = "") -> dict:
    """One job: {"ms", "failed"} (row name -> ms / why), timings stored in job["path"]. Logs a line per job."""
    import torch

    t0 = time.perf_counter()
    from . import decide, measure, store

    spec, meta, graph, rows, skipped = _job(job)
    torch.backends.cudnn.benchmark = bool(job.get("cudnn_benchmark", torch.backends.cudnn.benchmark))
    tkey = spec.key(decide.device_name(spec.device), graph)
    path = Path(job["path"]) if job.get("path") else None
    if not any(r.kernel for r in rows):  # recorded, so that the next process decides PyTorch without asking
        store.put(tkey, {}, skipped, path)
        return {"ms": {}, "failed": {}}
    entry = store.get(tkey)
    if not decide.needs_timing(rows, entry):  # another process timed it meanwhile
        return {"ms": entry["ms"], "failed": {}}
    threads = int(os.environ.get("TAESD_FAST_TUNING_THREADS", min(8, os.cpu_count() or 1)))
    if not spec.on_cuda:
        ms, failed = decide.time_shortlist(spec, rows, meta, graph, threads=threads)
    else:
        budget, need = _memory_budget(spec.device), measure.bytes_needed(spec, meta)
        if need > budget:
            why = (f"not tuned: timing needs ~{need / 2**30:.2f} GiB of GPU memory, over the tuning budget of "
                   f"{budget / 2**30:.2f} GiB (TAESD_FAST_TUNING_MEMORY_MB, 10% of free memory)")
            return {"ms": {}, "failed": {r.name: why for r in rows if r.kernel}}
        threads = max(1, min(threads, 1 + (budget - need) // max(1, measure.output_bytes(spec))))
        _cap_allocator(spec.device, budget)
        try:
            with torch.cuda.device(torch.device(spec.device)), torch.no_grad():
                ms, failed = decide.time_shortlist(spec, rows, meta, graph, threads=threads)
        finally:
            torch.cuda.empty_cache()
    store.put(tkey, ms, failed, path)
    best = min(ms, key=ms.get) if ms else "-"
    print(f"{_now()} job {job['id']}: {spec.kind} x{spec.x_shape} w{spec.w_shape} "
          f"graph={int(graph)}: {len(rows)} rows, {threads} threads, {time.perf_counter() - t0:.1f} s, fastest "
          f"{best}{note}" + "".join(f"\n  {name} {why}" for name, why in failed.items()), flush=True)
    return {"ms": ms, "failed": failed}


def _now() -> str:
    """The time of day with milliseconds, for the log's lines (one clock reading for both parts)."""
    t = time.time()
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _peak_mb() -> float:
    """The most GPU memory this process's allocator has held (0 before any CUDA use)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0.0
    return max(torch.cuda.max_memory_reserved(d) for d in range(torch.cuda.device_count())) / 2**20


def main(argv: list[str]) -> int:
    out = os.fdopen(int(argv[1]), "w", buffering=1)

    def send(**message) -> None:
        try:
            out.write(json.dumps(message) + "\n")
            out.flush()
        except OSError:  # the parent has gone: nobody to tell
            inbox.gone("the answer pipe closed")

    started = os.environ.get("TAESD_FAST_TUNER_STARTED")
    compiles = _Compiles()
    inbox = _Inbox(before_exit=compiles.close, started=float(started) if started else None)
    threading.Thread(target=inbox.read, args=(sys.stdin,), daemon=True).start()
    threading.Thread(target=inbox.watch, args=(os.getppid(),), daemon=True).start()
    took = f", {time.time() - float(started):.1f} s after its start" if started else ""
    print(f"{_now()} tuning process {os.getpid()} ready{took}", flush=True)
    _setup_hook()
    try:
        while True:
            job = inbox.next()
            if job is None:
                return 0
            send(event="start", id=job["id"])
            try:
                for queued in [job, *inbox.queued()]:  # compiles of everything queued start before this timing
                    compiles.plan(queued)
                reply, error = tune(job, compiles.wait(job)), None
            except Exception as e:  # noqa: BLE001 - reported to the parent, whose calls keep running PyTorch
                from .measure import error_line

                reply, error = {"ms": {}, "failed": {}}, error_line(e)
            send(event="done", id=job["id"], error=error, idle=inbox.idle(), peak_mb=_peak_mb(), **reply)
    finally:
        compiles.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
