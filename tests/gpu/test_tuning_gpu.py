"""Subprocess tuning on the GPU, as users meet it: fresh processes with empty caches and default settings, whose
own CUDA work (synchronizes, RNG draws, CUDA graphs, torch.compile) runs while tuning is pending and must neither
fail nor change; an exit right after the first call; then tuned kernels in the replays, and a second process on the
caches the first left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import process_gone
from taesd_fast import TAESD, CUDAGraphed, dispatch
from taesd_fast._backend import kernels_unavailable_reason

_REASON = kernels_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"taesd_fast kernels unavailable: {_REASON}")
SCRIPT = Path(__file__).with_name("user_during_tuning.py")
REPO = Path(__file__).resolve().parents[2]
PROCESSES = 5


def _user(mode: str, caches: Path | None = None, timeout: float = 400) -> dict:
    """Run the user's script in a fresh process (empty caches unless given), default tuning settings."""
    caches = caches or Path(tempfile.mkdtemp(prefix="taesd_fast_user_"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAESD_FAST_")}
    env.update(TAESD_FAST_CACHE_DIR=str(caches / "taesd_fast"), TRITON_CACHE_DIR=str(caches / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), mode], env=env, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(wall_s=wall, caches=str(caches), stderr=proc.stderr)
    return out


def _left_behind(caches: str, within: float = 10.0) -> list[int]:
    """Pids still alive `within` seconds on whose environment names the run's own cache folder: the tuning process
    and its compile workers (which inherit it), or anything else the run started."""
    deadline = time.monotonic() + within
    while True:
        alive = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if caches.encode() in (d / "environ").read_bytes():
                        alive.append(int(d.name))
                except OSError:  # gone, or not ours to read
                    pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_user_cuda_work_while_tuning_is_pending_neither_fails_nor_changes():
    """5 fresh processes at once: each decodes new shapes while tuning is pending and between calls synchronizes,
    draws from the CUDA RNG, captures a CUDA graph of its own in global mode and calls a torch.compile'd function;
    then exits with tuning pending. Exit status 0, nothing printed, the draws equal those of a process that never
    imported taesd_fast, and no tuning process or compile worker outlives its user by 10 s."""
    reference = _user("reference")["draws"]
    with ThreadPoolExecutor(PROCESSES) as pool:
        runs = list(pool.map(lambda _: _user("busy"), range(PROCESSES)))
    for run in runs:
        assert run["tuning"] == "subprocess"
        assert run["draws"] == reference
        assert run["pending"][0] > 0, run["pending"]  # the first calls ran while tuning was pending
        assert run["processes"] and all(process_gone(pid, 10) for pid in run["processes"])
        assert _left_behind(run["caches"]) == []
    print("\npending per step:", [r["pending"] for r in runs], "wall s:", [round(r["wall_s"], 1) for r in runs])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


def _gone_or_why(pid: int, caches: str, within: float = 10) -> str:
    """"" if process pid is gone within `within` s; else when it did go (up to a minute more) and its log's end."""
    if process_gone(pid, within):
        return ""
    t0 = time.monotonic()
    gone = process_gone(pid, 60)
    log = Path(caches, "taesd_fast", "dispatch", "tuner.log")
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
    return (f"tuning process {pid} alive {within:.0f} s after its user's exit; "
            + (f"gone {within + time.monotonic() - t0:.1f} s after" if gone else "still alive a minute later")
            + f" ({time.strftime('%H:%M:%S')}); its log ends:\n{tail}")


def test_exit_right_after_the_first_call():
    with ThreadPoolExecutor(PROCESSES) as pool:
        runs = list(pool.map(lambda _: _user("exit"), range(PROCESSES)))
    for run in runs:
        assert len(run["processes"]) == 1
        why = _gone_or_why(run["processes"][0], run["caches"])
        assert not why, why
        left = _left_behind(run["caches"])  # the compile workers too
        assert left == [], [(pid, _cmdline(pid)) for pid in left]
    print("\nwall s:", [round(r["wall_s"], 1) for r in runs])


@pytest.mark.usefixtures("isolated_dispatch")
def test_first_calls_run_pytorch_then_replays_run_tuned_kernels_and_a_second_process_starts_tuned(tmp_path):
    cache = Path(os.environ["TAESD_FAST_CACHE_DIR"])
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    z = torch.randn(1, 32, 32, 32, device="cuda", dtype=torch.float16)
    with torch.no_grad(), dispatch.backend("torch"):
        reference = model.decode(z)  # also initialises cuDNN: what is left is the dispatcher's own cost
    dispatch.set_tuning("subprocess")
    generation = dispatch.generation()
    times = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture or tuning warns: make it fail the test
        for _ in range(3):  # eager, captured, replayed: all PyTorch while the tuning process works
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = model.decode(z)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            torch.testing.assert_close(y, reference, rtol=0, atol=1e-3)
    print(f"\ncalls {[round(t, 3) for t in times]} s; {dispatch.tuning_status()}")
    assert max(times) < 1.0 and dispatch.tuning_status().pending > 0
    tick = time.perf_counter()
    assert dispatch.wait_for_tuning(timeout=300), dispatch.tuning_status()
    status = dispatch.tuning_status()
    print(f"tuning done {time.perf_counter() - tick:.1f} s after the third call: {status}")
    assert status.last_error is None and status.generation > generation
    with torch.no_grad():
        latents = torch.randn_like(z)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tuned = model.decode(latents)  # captured again: the generation moved
        torch.cuda.synchronize()
        t_recapture = time.perf_counter() - t0
        replay = model.decode(latents)
    print(f"re-capture {t_recapture:.3f} s")
    assert t_recapture < 1.0 and len(model._graph_caches["decoder"]) == 1
    kernel_rows = [r for _, r in dispatch.rows_of(model.decoder) if r.choice != "torch"]
    assert kernel_rows and all("graph replays" in r.why for r in kernel_rows), model.dispatch_table()
    model.cuda_graphs = False
    with torch.no_grad(), dispatch.graph_timing():
        expected = model.decode(latents)  # eagerly, with the decisions the replay runs
    model.cuda_graphs = True
    torch.testing.assert_close(tuned, expected, rtol=0, atol=1e-3)
    torch.testing.assert_close(replay, expected, rtol=0, atol=1e-3)
    m32 = TAESD.from_pretrained(dtype=torch.float32, device="cuda")
    with torch.no_grad(), dispatch.backend("torch"):
        ref32 = m32.decode(latents.float()).double()
        torch_err = (model.decode(latents).double() - ref32).norm() / ref32.norm()
    assert (replay.double() - ref32).norm() / ref32.norm() <= 2 * torch_err
    # A second process on these caches: its first call takes under 1 s (PyTorch while the kernel modules import in
    # the background), the stored timings then choose kernels within seconds, and no tuning process starts.
    # (The Triton cache is this process's: TRITON_CACHE_DIR as set, or Triton's default.)
    env_caches = Path(tempfile.mkdtemp(prefix="taesd_fast_second_"))
    (env_caches / "taesd_fast").symlink_to(cache)
    triton_dir = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    (env_caches / "triton").symlink_to(triton_dir)
    second = _user("second", env_caches)
    print(f"second process: first call {second['first_call_s']:.3f} s ({second['kernel_rows_first_call']} kernel "
          f"rows), {second['kernel_rows']} kernel rows after {second['calls']} calls, {second['kernels_after_s']:.2f} s")
    assert second["first_call_s"] <= 1.0 and second["processes"] == [] and second["kernel_rows"] > 0
    assert second["kernels_after_s"] < 5.0


@pytest.mark.usefixtures("isolated_dispatch")
def test_captures_while_the_tuning_process_works_do_not_fail():
    model = TAESD.from_pretrained(dtype=torch.float16, device="cuda")
    dispatch.set_tuning("subprocess")
    with torch.no_grad():
        for batch in (1, 2, 4):  # several shapes: a while of tuning on a fresh cache
            model.decode(torch.randn(batch, 32, 24, 24, device="cuda", dtype=torch.float16))
    assert dispatch.tuning_status().pending > 0
    captured = 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        while dispatch.tuning_status().pending > 0 and captured < 8:
            z = torch.randn(1, 32, 8 + 2 * (captured % 2), 8, device="cuda", dtype=torch.float16)
            y = CUDAGraphed(model.decode, z)(z)
            with dispatch.backend("torch"):
                torch.testing.assert_close(y, model.decode(z), rtol=0, atol=1e-2)
            captured += 1
    print(f"\n{captured} captures while tuning; {dispatch.tuning_status()}")
    assert captured > 0 and dispatch.tuning_status().last_error is None
