"""The tuning process's compile workers (dispatch/compile_pool.py) on CPU: recording a row's Triton launch compiles
and launches nothing, the workers compile it for a GPU target without a GPU, and a later compile of the same launch
finds their binary in Triton's cache instead of compiling again. tests/gpu/test_compile_pool_gpu.py does the same
with the package's own rows on the GPU."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from taesd_fast import _backend
from taesd_fast.dispatch import compile_pool
from taesd_fast.kernels.row import Row


@triton.jit
def _scale(x, y, n, factor, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * factor, mask=i < n)


def _launch(x, y, block):
    _scale[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), 3.0, BLOCK=block)
    return y


@pytest.fixture
def hopper_target(monkeypatch, tmp_path):
    """Triton told it runs on an sm_90 GPU (no GPU here), with an empty cache folder."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    before = driver._active
    driver.set_active(compile_pool.TargetOnlyDriver(GPUTarget("cuda", 90, 32)))
    yield tmp_path / "triton"
    driver._active = before


def _entries(cache) -> set:
    return {p.relative_to(cache) for p in cache.rglob("*") if p.is_file()} if cache.exists() else set()


def test_workers_compile_what_the_recording_saw_and_the_next_compile_only_loads_it(hopper_target):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1000, generator=g, dtype=torch.float16)
    y = torch.full_like(x, float("nan"))
    rows = [Row(f"block{b}", "conv2d", lambda x, y, b=b: _launch(x, y, b)) for b in (128, 256)]

    tasks = compile_pool.record(rows, lambda: (x, y))

    assert [t[0] for t in tasks] == ["triton", "triton"]
    assert {t[2] for t in tasks} == {"_scale"} and tasks[0][3] != tasks[1][3]  # two specializations (BLOCK)
    assert torch.isnan(y).all()  # recording launched nothing
    assert _entries(hopper_target) == set()  # and compiled nothing

    pool = compile_pool.CompilePool(2)
    try:
        futures = pool.submit(tasks + tasks[:1], {"TRITON_CACHE_DIR": str(hopper_target)})
        assert len(futures) == 3 and futures[0] is futures[2]  # a task already submitted is not compiled again
        done, errors = compile_pool.wait(futures, timeout=300)
    finally:
        pool.shutdown()
    assert (done, errors) == (2, [])  # two distinct compiles
    compiled = _entries(hopper_target)
    assert sum(p.suffix == ".cubin" for p in compiled) == 2

    for block in (128, 256):  # what the timing run's launch compiles: found in the cache, nothing new written
        kernel = _scale.warmup(x, y, x.numel(), 3.0, BLOCK=block, grid=(1,))
        assert "sm_90" in kernel.asm["ptx"] or ".target sm_90" in kernel.asm["ptx"]
    assert _entries(hopper_target) == compiled


def test_a_task_that_cannot_compile_is_reported_not_raised(hopper_target):
    pool = compile_pool.CompilePool(1)
    try:
        bad = ("triton", __name__, "no_such_kernel", "{}", ("cuda", 90, 32))
        done, errors = compile_pool.wait(pool.submit([bad], {}), timeout=300)
    finally:
        pool.shutdown()
    assert done == 1 and len(errors) == 1 and "no_such_kernel" in errors[0] and "AttributeError" in errors[0]


def test_recording_an_nvrtc_build_skips_it_but_the_probe_still_builds(monkeypatch):
    """The NVRTC hook records a build missing from the disk cache and stops the row there; the availability probe
    (whose answer is cached for the process) is never stopped."""
    built = []
    monkeypatch.setattr(_backend, "_read_source", lambda name: f"// {name}")
    monkeypatch.setattr(_backend, "_nvrtc_version", lambda: "test")
    monkeypatch.setattr(_backend, "_target", lambda cc: (f"sm_{cc}", True))
    monkeypatch.setattr(_backend, "_compile", lambda src, name, arch, cubin, opts: built.append(name) or b"image")
    monkeypatch.setenv("TAESD_FAST_CACHE_DIR", os.devnull + "/none")  # unreadable: every build is a miss
    after = []
    rows = [Row("probe", "conv2d", lambda: _backend._binary("probe.cu", {}, 90)),
            Row("conv", "conv2d", lambda: (_backend._binary("conv_row_sm90.cu", {"C": 64}, 90), after.append(1)))]
    tasks = compile_pool.record(rows, tuple)
    assert tasks == [("nvrtc", "conv_row_sm90.cu", {"C": 64}, 90)]
    assert set(built) == {"probe.cu"} and after == []
    assert _backend.compile_miss_hook is None  # restored


def test_compile_planning_that_fails_gives_the_workers_up_without_raising(monkeypatch, capsys):
    """Planning a job's compiles can fail (no way to start processes, a recording error): the tuning process logs
    it once and stops using the workers, and nothing is raised into the job's tuning (whose timing run then
    compiles, as with TAESD_FAST_TUNING_COMPILERS=0)."""
    from taesd_fast.dispatch import tune_worker

    compiles = tune_worker._Compiles()
    compiles.workers = 2

    def broken(job):
        raise OSError("cannot start processes here")

    monkeypatch.setattr(compiles, "_plan", broken)
    compiles.plan({"id": 1})
    assert compiles.workers == 0 and compiles.pool is None and compiles.futures == {}
    assert "compile workers given up: OSError: cannot start processes here" in capsys.readouterr().out
    compiles.plan({"id": 2})  # nothing more is tried
    assert compiles.wait({"id": 2}) == "" and compiles.futures == {}


def test_default_worker_count_follows_cores_memory_and_the_switch(monkeypatch):
    monkeypatch.delenv("TAESD_FAST_TUNING_COMPILERS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(compile_pool, "available_ram", lambda: 100 << 30)
    assert compile_pool.default_workers() == 8
    monkeypatch.setattr(compile_pool, "available_ram", lambda: 3 * compile_pool.WORKER_BYTES + 5)
    assert compile_pool.default_workers() == 3  # what the host memory holds
    monkeypatch.setattr(compile_pool, "available_ram", lambda: 0)
    assert compile_pool.default_workers() == 1
    monkeypatch.setattr(compile_pool, "available_ram", lambda: 100 << 30)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert compile_pool.default_workers() == 3
    monkeypatch.setenv("TAESD_FAST_TUNING_COMPILERS", "0")
    assert compile_pool.default_workers() == 0


_STAND_IN = """
import os, sys, time
from taesd_fast.dispatch import compile_pool
pool = compile_pool.CompilePool(1)
pid = pool.executor.submit(os.getpid).result(timeout=300)
pool.executor.submit(pow, 7, 4 * 10**7)  # one C call holding the worker's GIL for tens of seconds, as a compile can
time.sleep(1.0)
open(sys.argv[1], "w").write(str(pid))
os._exit(0)  # the tuning process goes without shutting its pool down (killed, or its grace period over)
"""


@pytest.mark.skipif(not os.sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_busy_compile_worker_ends_with_the_tuning_process(tmp_path):
    """A worker in the middle of a GIL-holding call (Triton's front end) must not outlive the tuning process: no
    Python thread of it can run then, so the kernel has to end it. (Output goes to files: the worker inherits the
    stand-in's stdout, and waiting for a pipe's end would wait for the worker.)"""
    import subprocess
    import sys

    from conftest import process_gone

    pid_file, log = tmp_path / "pid", tmp_path / "log"
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-c", _STAND_IN, str(pid_file)], stdout=out, stderr=out, timeout=300,
                              env=dict(os.environ, TAESD_FAST_TUNING_COMPILERS="1")).returncode
    assert code == 0, log.read_text()[-2000:]
    pid = int(pid_file.read_text())
    assert process_gone(pid, 3.0), f"compile worker {pid} outlived the tuning process by 3 s"


_SLOW_START = """
import os, sys, time
if "--multiprocessing-fork" in sys.argv:  # a spawned worker: its start (importing torch, Triton) takes long
    time.sleep(60)
"""

_STAND_IN_STARTING = """
import multiprocessing, os, sys, time
from taesd_fast.dispatch import compile_pool
pool = compile_pool.CompilePool(1)
time.sleep(1.0)
(worker,) = multiprocessing.active_children()
open(sys.argv[1], "w").write(str(worker.pid))
pool.shutdown()  # the tuning process's exit: idle, or at the end of its grace period
os._exit(0)
"""


def test_a_compile_worker_still_starting_ends_with_the_pool(tmp_path):
    """A worker still importing (before its initializer has set the parent-death signal or started its watch) is
    stopped by the pool's shutdown: on a loaded machine that start lasts longer than the tuning process."""
    import subprocess
    import sys

    from conftest import process_gone

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_START)
    pid_file, log = tmp_path / "pid", tmp_path / "log"
    env = dict(os.environ, TAESD_FAST_TUNING_COMPILERS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, "-c", _STAND_IN_STARTING, str(pid_file)], stdout=out, stderr=out,
                              timeout=120, env=env).returncode
    assert code == 0, log.read_text()[-2000:]
    pid = int(pid_file.read_text())
    assert process_gone(pid, 3.0), f"compile worker {pid}, still starting, outlived the pool's shutdown by 3 s"


def test_the_tuning_process_stops_its_workers_at_the_end_of_its_grace_period(monkeypatch):
    """When the parent goes, the tuning process's exit at the end of the grace period first runs the hook that
    shuts its compile pool down."""
    import faulthandler

    from taesd_fast.dispatch import tune_worker

    calls = []
    monkeypatch.setattr(tune_worker, "EXIT_GRACE_S", 0.05)
    monkeypatch.setattr(tune_worker.os, "_exit", lambda code: calls.append(("exit", code)))
    inbox = tune_worker._Inbox(before_exit=lambda: calls.append("workers stopped"))
    try:
        inbox.gone("test")
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        faulthandler.cancel_dump_traceback_later()  # the backstop gone() armed in this process
    assert calls == ["workers stopped", ("exit", 0)] and inbox.parent_gone


@pytest.mark.parametrize("began", [False, True])
def test_the_grace_period_counts_from_the_start_when_no_job_began(monkeypatch, began):
    """A parent that went while the tuning process was still importing (seconds on a loaded machine) may have gone
    at any moment since its start: with no job begun, the grace period ends EXIT_GRACE_S after the start (here long
    past: at once). Once a job has begun, the parent's going was seen as it happened: the whole grace period."""
    import faulthandler

    from taesd_fast.dispatch import tune_worker

    calls = []
    monkeypatch.setattr(tune_worker.os, "_exit", lambda code: calls.append(("exit", code)))
    inbox = tune_worker._Inbox(before_exit=lambda: calls.append("workers stopped"),
                               started=time.time() - 2 * tune_worker.EXIT_GRACE_S)
    if began:
        inbox.heap.append((0, 0, {"id": 1}))
        assert inbox.next() == {"id": 1}
    try:
        inbox.gone("test")
        time.sleep(0.5)
    finally:
        inbox.timer.cancel()  # the whole grace period's exit must not fire after the test
        faulthandler.cancel_dump_traceback_later()
    assert calls == ([] if began else ["workers stopped", ("exit", 0)])


def test_recording_the_tma_row_records_its_tgrow_fold(hopper_target):
    """The triton_conv_tma row's variants (kernels/triton_conv_tma.py grow_variants): recording the row for a conv on
    TGrow's output of two frames per input frame also records the fold's launch (GROW=2), so the tuning process
    compiles it; for a conv the fold never runs (a residual) it records nothing more. Compiles and launches nothing."""
    from taesd_fast.dispatch import table

    row = table.row("conv2d", "triton_conv_tma")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 6, 16, generator=g).half().contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(64, 64, 3, 3, generator=g).half(), torch.randn(64, generator=g).half()
    grows = [_constant(t[3], "GROW") for t in compile_pool.record([row], lambda: (x, w, b, 1, None, True, 2, False))
             if t[0] == "triton" and t[2] == "_conv3x3_tc_tma_kernel"]
    assert 2 in grows, grows
    res = torch.randn(4, 64, 12, 32, generator=g).half().contiguous(memory_format=torch.channels_last)
    with_residual = compile_pool.record([row], lambda: (x, w, b, 1, res, True, 2, False))
    assert 2 not in [_constant(t[3], "GROW") for t in with_residual
                     if t[0] == "triton" and t[2] == "_conv3x3_tc_tma_kernel"]
    assert _entries(hopper_target) == set()


def _constant(specialization: str, name: str):
    """A constexpr's value in a recorded Triton specialization (JSON: constants by argument position)."""
    d = json.loads(specialization)
    position = [list(d["signature"]).index(name)]
    return dict(zip(map(tuple, d["constant_keys"]), d["constant_vals"])).get(tuple(position))
