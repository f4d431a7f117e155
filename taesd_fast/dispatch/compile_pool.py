"""Kernel compiles for the tuning process, spread over worker processes that never touch the GPU.

Compiling, not timing, is most of a first use's tuning, and Triton's compiler front end holds the GIL, so compiles
on threads barely overlap. So the tuning process first runs each queued job's candidate rows (twice each: see
`record`) with two hooks set: Triton's `jit_cache_hook` records what each launch would compile (the kernel and its specialization: argument
types and alignments, constexprs, options) and skips compiling and launching it, and `_backend.compile_miss_hook`
records an NVRTC build that is not on disk yet. Worker processes (spawned, CUDA hidden from them; Triton is told
the GPU's target) compile those into the on-disk caches (TRITON_CACHE_DIR, TAESD_FAST_CACHE_DIR), many at once.
When the tuning process then runs a row for timing, Triton's compile finds the binary under the same cache key and
only loads it, and so does the NVRTC loader.

What cannot be recorded or compiled this way (a kernel Triton cannot serialize, a worker error) is compiled by the
timing run as before, so this only ever saves time. TAESD_FAST_TUNING_COMPILERS sets the number of workers (0: none).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Callable

from .. import kernel_env
from ..host_memory import available_ram

WAIT_S = 120.0  # the longest a job waits for its compiles before its timing run compiles what is left itself
WORKER_BYTES = 1 << 30  # host memory set aside per worker (torch, Triton and a compile: about half of this)


def default_workers() -> int:
    """TAESD_FAST_TUNING_COMPILERS if set; else one per CPU core but one, at most 8, and no more than the available
    host memory holds at WORKER_BYTES each (at least one)."""
    value = os.environ.get("TAESD_FAST_TUNING_COMPILERS", "").strip()
    if value:
        return max(0, int(value))
    return max(1, min(8, (os.cpu_count() or 2) - 1, available_ram() // WORKER_BYTES))


class _Recorded(Exception):
    """Raised by the NVRTC hook while recording: the row's run stops before it would load the module."""


def record(rows, make_args: Callable[[], tuple]) -> list[tuple]:
    """Run each row on new arguments (`make_args()`) with compiling and launching replaced by recording. Returns
    the compile tasks: ("triton", module, qualname, specialization JSON, target) and ("nvrtc", source, defines,
    cc). Each row runs twice on its own arguments: a first call on a weight launches another variant than the calls
    after it (it packs the weight, so it launches without PDL), and rows share packed weights; then its `variants`
    (kernels/row.py), twice too. Call on the tuning process's main thread, with nothing else launching kernels."""
    import triton
    from triton.runtime import driver

    from .. import _backend

    tasks: list[tuple] = []

    def on_triton(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # keyword names fixed by Triton
        target = driver.active.get_current_target()
        target = (target.backend, target.arch, target.warp_size)
        tasks.append(("triton", fn.module, fn.name, compile["specialization_data"], target))
        return True  # skip this compile and launch

    def on_nvrtc(source_name, defines, cc):
        if source_name == "probe.cu":  # the availability probe builds as usual: its answer is cached
            return
        tasks.append(("nvrtc", source_name, dict(defines), cc))
        raise _Recorded(source_name)

    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Triton before 3.4 has no jit_cache_hook: the timing runs compile
        return []
    knobs = knobs.runtime
    before = knobs.jit_cache_hook
    knobs.jit_cache_hook, _backend.compile_miss_hook = on_triton, on_nvrtc
    try:
        for row in rows:
            args = make_args()
            for launch in filter(None, (row.run, row.variants)):  # the row's other forms of its kernel, if any
                for _ in range(2):
                    try:
                        launch(*args)
                    except Exception:  # noqa: BLE001 - recorded or not, the timing run compiles what was missed
                        break
    finally:
        knobs.jit_cache_hook, _backend.compile_miss_hook = before, None
    return list({task_key(t): t for t in tasks}.values())


def task_key(task: tuple) -> str:
    return repr(task)


class CompilePool:
    """Worker processes compiling recorded tasks; each distinct task is compiled once. `submit` returns futures
    (their results: None, or why the task failed); a broken pool turns into `None` futures (nothing is lost: the
    timing run compiles)."""

    def __init__(self, workers: int):
        import multiprocessing

        self.futures: dict[str, Future] = {}
        self.failed: str | None = None
        self.executor = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(os.getpid(),))
        for _ in range(workers):  # start them now: importing torch and Triton takes each a few seconds
            self.executor.submit(_warm)

    def submit(self, tasks: list[tuple], env: dict[str, str | None]) -> list[Future]:
        out = []
        for task in tasks:
            key = task_key(task)
            if key not in self.futures:
                if self.failed is not None:
                    continue
                try:
                    self.futures[key] = self.executor.submit(_compile, task, env)
                except Exception as e:  # noqa: BLE001 - a broken pool: the timing runs compile instead
                    self.failed = f"{type(e).__name__}: {e}"
                    continue
            out.append(self.futures[key])
        return out

    def shutdown(self) -> None:
        """Stop the workers at once: those compiling (nothing waits for them now) and those still starting. A
        worker importing torch and Triton has not yet run `_init_worker`, so neither its parent-death signal nor
        its watch thread would end it; on a loaded machine that start takes tens of seconds."""
        processes = list((getattr(self.executor, "_processes", None) or {}).values())  # shutdown forgets them
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()


def wait(futures: list[Future], timeout: float = WAIT_S) -> tuple[int, list[str]]:
    """Wait for the futures; (how many distinct ones finished, the errors among them)."""
    done, _ = wait_futures(futures, timeout=timeout)
    errors = []
    for f in done:
        try:
            why = f.result()
        except Exception as e:  # noqa: BLE001 - a worker died: reported, the timing run compiles
            why = f"{type(e).__name__}: {e}"
        if why:
            errors.append(why)
    return len(done), errors


# ----------------------------------------------------------------------------- in the worker processes


class TargetOnlyDriver:
    """What Triton's JIT asks of its driver while compiling only: the device index and the GPU's target. Set with
    triton.runtime.driver.set_active in a process that compiles for a GPU it does not use (the workers here,
    tools/compile_check.py)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _init_worker(parent: int) -> None:
    """A worker ends with the tuning process that started it. On Linux the kernel kills it then (PR_SET_PDEATHSIG),
    even in the middle of a compile: Triton's front end holds the GIL, so a Python thread watching the parent could
    not run until the compile ends (tens of seconds on a loaded machine). Elsewhere that thread is the way."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a worker compiles only: no CUDA context, no GPU memory
    _die_with_parent()

    def watch() -> None:  # the tuning process went (killed, or exited without shutting the pool down)
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (the thread that spawned it: the tuning process's main
    thread, which lives as long as the process). A parent gone before this is caught by the watch thread."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no libc prctl: the watch thread still ends the worker
        pass


def _warm() -> None:
    """Import what compiling needs (Triton and the kernel modules), ahead of the first task."""
    from ..kernels.rows import import_all

    import_all()


def _compile(task: tuple, env: dict[str, str | None]) -> str | None:
    """Compile one recorded task into the on-disk caches. Returns None, or why it failed."""
    kernel_env.apply_env(env)
    try:
        if task[0] == "nvrtc":
            from .. import _backend

            _, source, defines, cc = task
            _backend._binary(source, defines, cc)
            return None
        _, module, qualname, data, target = task
        from triton.backends.compiler import GPUTarget
        from triton.runtime import driver

        driver.set_active(TargetOnlyDriver(GPUTarget(*target)))
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        kernel = fn.preload(data)
        _warm_launcher(kernel)
        return None
    except Exception as e:  # noqa: BLE001 - reported; the timing run compiles it
        return f"{task[0]} {task[1]}.{task[2] if task[0] == 'triton' else ''}: {type(e).__name__}: {e}"[:300]


def _warm_launcher(kernel) -> None:
    """Build the kernel's C launcher into Triton's cache too (a C compile per argument signature); best effort."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the tuning process builds it at the first launch instead
        pass
