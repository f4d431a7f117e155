"""Subprocess, blocking and off tuning, driven on the CPU: a fake kernel row that runs on CPU tensors and a fake,
deterministic measure function (tests/tuning_fakes.py) stand in for the GPU kernels and their timing, in this
process and in the real tuning process, which the tests start through the real protocol (the GPU tests time real
kernels)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tuning_fakes
from conftest import process_gone
from taesd_fast import dispatch, graphs
from taesd_fast.dispatch import decide, measure, spec as spec_mod, store, tuner
from taesd_fast.kernels import rows as kernel_rows

pytestmark = pytest.mark.usefixtures("isolated_dispatch")
TESTS_DIR = Path(__file__).resolve().parent


def _conv(x, w, b):
    return dispatch.conv2d(x, w, b, relu=True)


def _data(seed=0, shape=(2, 4, 9, 7)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g), torch.randn(5, shape[1], 3, 3, generator=g), torch.randn(5, generator=g))


def _reference(x, w, b):
    return torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))


def _torch_row(x, w, b):
    return torch.relu(F.conv2d(x, w, b, padding=1))


def test_a_miss_runs_pytorch_at_once_and_the_tuning_process_times_it(fake_kernel, monkeypatch):
    monkeypatch.setenv("FAKE_TUNING_SLEEP", "1.0")
    x, w, b = _data()
    generation = dispatch.generation()
    t0 = time.perf_counter()
    with torch.no_grad():
        y = _conv(x, w, b)
    assert time.perf_counter() - t0 < 1.0  # did not wait for the tuning process
    assert torch.equal(y, _torch_row(x, w, b)) and tuning_fakes.CALLS == []
    status = dispatch.tuning_status()
    assert status.pending == 1 and status.done == 0
    (pid,) = status.processes
    assert pid != os.getpid()
    assert not dispatch.wait_for_tuning(timeout=0.05)  # still timing
    assert dispatch.wait_for_tuning(timeout=60)
    status = dispatch.tuning_status()
    assert status.pending == 0 and status.done == 1 and status.last_error is None
    assert dispatch.generation() == generation + 1  # the decision changed
    with torch.no_grad():
        y2 = _conv(x, w, b)
    assert tuning_fakes.CALLS == [tuple(x.shape)]
    torch.testing.assert_close(y2.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    (line,) = fake_kernel.read_text().splitlines()  # timed once, in the tuning process
    assert line == f"2x4x9x7 0 {pid}"
    # the tuning process wrote the timings to the file, keyed like any other (device "cpu" for CPU calls)
    saved = store.read_json(store.timings_path())
    ((key, entry),) = saved.items()
    assert key.startswith("cpu|") and entry == {"ms": {"torch": 1.0, "fake": 0.5}}
    assert process_gone(pid, 10)  # its queue is empty: it exits


def test_the_tuning_process_is_sent_metadata_never_the_callers_tensors(fake_kernel, monkeypatch):
    monkeypatch.setenv("FAKE_TUNING_SLEEP", "0.5")
    x, w, b = _data(1)
    alive = weakref.ref(x)
    with torch.no_grad():
        _conv(x, w, b)
    del x
    gc.collect()
    assert alive() is None  # the job keeps no reference to the input
    ((job),) = [j for worker in tuner._workers.values() for j in worker.jobs.values()]
    assert not any(isinstance(a, torch.Tensor) for a in job.meta)
    assert job.meta[0] == spec_mod.TensorMeta((2, 4, 9, 7), (252, 63, 7, 1), torch.float32, "cpu")


def test_spec_and_metadata_survive_the_trip_as_json():
    import json

    spec = decide.Spec("conv2d", "cuda:1", (2, 64, 9, 7), (64, 64, 3, 3), torch.bfloat16, 1, True, True, False,
                       "channels_last", 2, True, 0)
    meta = (spec_mod.TensorMeta((2, 64, 9, 7), (4032, 1, 448, 64), torch.bfloat16, "cuda:1"), None, 1, True, 1e-6)
    assert spec_mod.spec_from_json(json.loads(json.dumps(spec_mod.spec_to_json(spec)))) == spec
    assert spec_mod.meta_from_json(json.loads(json.dumps(spec_mod.meta_to_json(meta)))) == meta


def test_graph_replayed_specs_are_timed_first(fake_kernel, monkeypatch):
    monkeypatch.setenv("FAKE_TUNING_SLEEP", "0.7")
    shapes = [(1, 4, 6, 6), (1, 4, 8, 8), (1, 4, 10, 10)]
    with torch.no_grad():
        _conv(*_data(0, shapes[0]))  # eager: starts the tuning process, which times it first
        deadline = time.monotonic() + 60
        while not (fake_kernel.exists() and fake_kernel.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)  # the process has started timing it
        _conv(*_data(0, shapes[1]))  # eager, queued
        with dispatch.graph_timing():
            _conv(*_data(0, shapes[2]))  # for a graph: queued behind, timed before shapes[1]
    assert dispatch.wait_for_tuning(timeout=60)
    order = [line.split()[:2] for line in fake_kernel.read_text().splitlines()]
    assert order == [["1x4x6x6", "0"], ["1x4x10x10", "1"], ["1x4x8x8", "0"]]
    assert dispatch.tuning_status().done == 3


def _fake_captures(monkeypatch) -> list:
    """graphs.CUDAGraphed faked (CI has no GPU): a "capture" decides and runs fn under graph_timing, as
    graphs.capture does, and its replays run fn again. Returns the list of the generations captured under."""
    captures = []

    class Captured:
        def __init__(self, fn, example):
            self.generation = dispatch.generation()
            with dispatch.graph_timing():  # as graphs.capture decides
                fn(example)
            self.fn = fn
            captures.append(self.generation)

        def __call__(self, x):
            with dispatch.graph_timing():
                return self.fn(x)

    monkeypatch.setattr(graphs, "CUDAGraphed", Captured)
    monkeypatch.setattr(graphs, "_replayable", lambda x, params: True)
    return captures


def test_graph_cache_captures_again_once_tuning_changes_a_decision(fake_kernel, monkeypatch):
    """The whole path: a call's graph is captured with PyTorch while the tuning process works; once it has
    answered, the next call picks the answer up and captures again, now with the tuned kernel. Capture is faked
    (CI has no GPU)."""
    monkeypatch.setenv("FAKE_TUNING_SLEEP", "1.0")
    captures = _fake_captures(monkeypatch)
    cache = graphs.GraphCache()
    x, w, b = _data(2)
    fn = lambda t: _conv(t, w, b)  # noqa: E731
    with torch.no_grad():
        cache(fn, x, [])  # eager
        cache(fn, x, [])  # captured: PyTorch, while the graph-replay spec is timed
        cache(fn, x, [])  # replay
    assert tuning_fakes.CALLS == [] and len(captures) == 1
    deadline = time.monotonic() + 60
    while dispatch.tuning_status().pending and not tuner.results and time.monotonic() < deadline:
        time.sleep(0.05)  # answered, not yet picked up: the next call does that
    assert [line.split()[1] for line in fake_kernel.read_text().splitlines()] == ["1"]  # what the replays run
    with torch.no_grad():
        y = cache(fn, x, [])  # picks up the answer; the generation moved: captured again at once
    assert len(captures) == 2 and captures[1] == dispatch.generation() and tuning_fakes.CALLS
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    tuning_fakes.CALLS.clear()
    with torch.no_grad():
        cache(fn, x, [])
    assert len(captures) == 2 and tuning_fakes.CALLS == [tuple(x.shape)]  # a replay of the new graph


def test_stored_timings_decide_without_a_tuning_process(fake_kernel):
    """A second process on the same caches: the first call already runs the tuned row, and no process starts."""
    x, w, b = _data(3)
    spec = spec_mod.spec_of(spec_mod.call_key("conv2d", x, w, b, 1, None, True))
    store.put(spec.key("cpu"), {"torch": 1.0, "fake": 0.5}, {})
    dispatch.clear_cache()  # forget the copy in memory: the file is read again
    with torch.no_grad():
        y = _conv(x, w, b)
    assert tuning_fakes.CALLS == [tuple(x.shape)] and dispatch.tuning_status().processes == []
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)


def test_calls_while_the_kernel_modules_import_run_pytorch_then_graphs_capture_again(fake_kernel, monkeypatch):
    """A second process on stored timings: while the background imports run (Triton, its cache key), calls run
    PyTorch and decide nothing, so the first call waits for none of it; once they are done, the next call decides
    from the stored timings and a graph captured meanwhile is captured again with the kernel row."""
    importing = [True]
    monkeypatch.setattr(kernel_rows, "importing", lambda: importing[0])
    captures = _fake_captures(monkeypatch)
    x, w, b = _data(5)
    for graph in (False, True):
        spec = spec_mod.spec_of(spec_mod.call_key("conv2d", x, w, b, 1, None, True))
        store.put(spec.key("cpu", graph), {"torch": 1.0, "fake": 0.5}, {})
    dispatch.clear_cache()
    cache = graphs.GraphCache()
    fn = lambda t: _conv(t, w, b)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed
            y = cache(fn, x, [])
            torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-3, atol=1e-3)
        assert tuning_fakes.CALLS == [] and len(captures) == 1 and not dispatch.kernel_chosen()
        assert dispatch.tuning_status().processes == []  # stored timings: nothing to tune
        importing[0] = False
        y = cache(fn, x, [])  # the imports are done: stale graph, captured again with the stored decision
    assert len(captures) == 2 and captures[1] == dispatch.generation() and tuning_fakes.CALLS
    assert dispatch.kernel_chosen()
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    tuning_fakes.CALLS.clear()
    with torch.no_grad():
        cache(fn, x, [])
        _conv(x, w, b)  # an eager call decides from the stored timings too
    assert len(captures) == 2 and tuning_fakes.CALLS == [tuple(x.shape)] * 2


def test_kernel_chosen_says_whether_a_kernel_row_was_decided(fake_kernel):
    """What passes that are no rows follow (TAEHV's output frames): false while every call ran PyTorch (a miss with
    nothing stored), true once a call was decided to a kernel row, false again after clear_cache."""
    x, w, b = _data(4)
    dispatch.clear_cache()
    with torch.no_grad(), dispatch.tuning("off"):
        _conv(x, w, b)
    assert not dispatch.kernel_chosen() and tuning_fakes.CALLS == []
    spec = spec_mod.spec_of(spec_mod.call_key("conv2d", x, w, b, 1, None, True))
    store.put(spec.key("cpu"), {"torch": 1.0, "fake": 0.5}, {})
    dispatch.clear_cache()
    assert not dispatch.kernel_chosen()
    with torch.no_grad():
        _conv(x, w, b)
    assert dispatch.kernel_chosen() and tuning_fakes.CALLS == [tuple(x.shape)]
    dispatch.clear_cache()
    assert not dispatch.kernel_chosen()


def test_a_row_that_failed_in_tuning_is_not_tuned_again_by_the_next_process(fake_kernel, monkeypatch):
    monkeypatch.setenv("FAKE_TUNING_ROW_OOM", "1")
    x, w, b = _data(8)
    with torch.no_grad():
        _conv(x, w, b)
    assert dispatch.wait_for_tuning(timeout=60)
    ((key, entry),) = store.read_json(store.timings_path()).items()
    assert entry == {"ms": {"torch": 1.0}, "failed": {"fake": "failed: OutOfMemoryError: CUDA out of memory"}}
    for pid in dispatch.tuning_status().processes:
        assert process_gone(pid, 10)
    dispatch.clear_cache()  # as a new process: only the file is left
    with torch.no_grad():
        y = _conv(x, w, b)
    assert dispatch.tuning_status().processes == [] and dispatch.tuning_status().pending == 0
    assert torch.equal(y, _torch_row(x, w, b))
    (rec,) = [r for r in decide.state.decided.values()]
    assert rec.choice == "torch" and "OutOfMemoryError" in rec.skipped["fake"]


def test_a_call_no_kernel_row_supports_is_recorded_so_the_next_process_does_not_ask(fake_kernel):
    """The cheap check before sending a call (device, kill switch) cannot see a row's rule: a 1x1 conv goes to the
    tuning process, which finds no eligible kernel row and records why, so the next process decides at once."""
    g = torch.Generator().manual_seed(9)
    x, w, b = torch.randn(1, 4, 6, 6, generator=g), torch.randn(5, 4, 1, 1, generator=g), torch.randn(5, generator=g)
    with torch.no_grad():
        dispatch.conv2d(x, w, b)
    assert dispatch.wait_for_tuning(timeout=60)
    ((key, entry),) = store.read_json(store.timings_path()).items()
    assert entry == {"ms": {}, "failed": {"fake": "1x1 kernel (3x3 only)"}}
    dispatch.clear_cache()  # as a new process: only the file is left
    with torch.no_grad():
        y = dispatch.conv2d(x, w, b)
    assert dispatch.tuning_status().processes == [] and dispatch.tuning_status().pending == 0
    assert torch.equal(y, F.conv2d(x, w, b))


def test_off_mode_never_times_but_uses_stored_timings(fake_kernel):
    x, w, b = _data(3)
    with dispatch.tuning("off"), torch.no_grad():
        y = _conv(x, w, b)
        assert torch.equal(y, _torch_row(x, w, b)) and tuning_fakes.CALLS == []
        assert dispatch.tuning_status().pending == 0 and dispatch.tuning_status().processes == []
        (rec,) = [r for r in decide.state.decided.values()]
        assert rec.choice == "torch" and rec.why == "not timed (tuning off)"
        store.put(rec.spec.key("cpu"), {"torch": 1.0, "fake": 0.5}, {})  # as a tuning run on this machine left them
        dispatch.clear_cache()
        _conv(x, w, b)
    assert tuning_fakes.CALLS == [tuple(x.shape)]


def test_blocking_mode_times_in_the_calling_thread(fake_kernel, monkeypatch):
    calls = []

    def fake(rows, spec, meta, graph, reps=7, progress=False, threads=1):
        calls.append(threading.current_thread().name)
        return tuning_fakes.fake_time_candidates(rows, spec, meta, graph)

    monkeypatch.setattr(measure, "time_candidates", fake)
    x, w, b = _data(4)
    generation = dispatch.generation()
    with dispatch.tuning("blocking"), torch.no_grad():
        y = _conv(x, w, b)
    assert calls == [threading.current_thread().name] and dispatch.tuning_status().processes == []
    assert tuning_fakes.CALLS == [tuple(x.shape)] and dispatch.generation() == generation
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    ((_, rec),) = [(k, r) for k, r in decide.state.decided.items()]
    assert rec.why == "measured" and rec.ms == {"torch": 1.0, "fake": 0.5}


@pytest.mark.parametrize("how,expect", [("FAKE_TUNING_FAIL", "RuntimeError: kernel build exploded"),
                                        ("FAKE_TUNING_CRASH", "exited with code 3")])
def test_a_failing_or_crashing_tuning_process_warns_once_and_calls_keep_running_pytorch(fake_kernel, monkeypatch,
                                                                                        how, expect):
    monkeypatch.setenv(how, "3" if how == "FAKE_TUNING_CRASH" else "1")
    x, w, b = _data(6)
    generation = dispatch.generation()
    with pytest.warns(RuntimeWarning, match=f"tuning failed.*{expect}"):
        with torch.no_grad():
            _conv(x, w, b)
            _conv(*_data(6, (1, 4, 5, 5)))  # a second failure: no second warning (pytest.warns counts them below)
        assert dispatch.wait_for_tuning(timeout=60)
    status = dispatch.tuning_status()
    assert expect in status.last_error and status.done == 2
    assert dispatch.generation() == generation  # nothing changed: graphs are not captured again
    with torch.no_grad():
        y = _conv(x, w, b)
    assert tuning_fakes.CALLS == [] and torch.equal(y, _torch_row(x, w, b))
    rec = next(r for r in decide.state.decided.values() if r.spec.x_shape == tuple(x.shape))
    assert rec.choice == "torch" and "tuning failed" in rec.why


def test_a_hung_tuning_process_is_stopped_after_the_timeout(fake_kernel, monkeypatch):
    monkeypatch.setenv("FAKE_TUNING_SLEEP", "600")
    monkeypatch.setattr(tuner, "JOB_TIMEOUT_S", 1.5)
    x, w, b = _data(7)
    with pytest.warns(RuntimeWarning, match="over 2 s and was stopped"):
        with torch.no_grad():
            _conv(x, w, b)
        (pid,) = dispatch.tuning_status().processes
        assert dispatch.wait_for_tuning(timeout=30)
    assert process_gone(pid, 5) and dispatch.tuning_status().processes == []
    with torch.no_grad():
        assert torch.equal(_conv(x, w, b), _torch_row(x, w, b))


def _user_script(body: str) -> str:
    return textwrap.dedent("""
        import sys, torch
        import tuning_fakes
        from taesd_fast import dispatch
        from taesd_fast.dispatch import table
        table.ROWS[:] = tuning_fakes.rows() + [r for r in table.ROWS if r.kind != "conv2d"]
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(1, 4, 9, 7, generator=g), torch.randn(5, 4, 3, 3, generator=g), torch.randn(5, generator=g)
        with torch.no_grad():
            dispatch.conv2d(x, w, b, relu=True)
        print(dispatch.tuning_status().processes[0], flush=True)
        """) + textwrap.dedent(body)


def _run_user(tmp_path, body: str, **env):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
                TAESD_FAST_TUNER_SETUP="tuning_fakes:install", TAESD_FAST_TUNING="subprocess",
                TAESD_FAST_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.Popen([sys.executable, "-c", _user_script(body)], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sleep,kept", [("0.1", True), ("30", False)])
def test_the_users_exit_is_not_delayed_and_no_tuning_process_outlives_it(tmp_path, sleep, kept):
    """A script that exits right after its first call: exit status 0 at once, nothing printed, the tuning process
    gone within 10 s; a job that ends within its grace period is finished and its timings kept."""
    t0 = time.perf_counter()
    proc = _run_user(tmp_path, "sys.exit(0)", FAKE_TUNING_SLEEP=sleep)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.perf_counter() - t0 < 20 and "terminate called" not in err and "Traceback" not in err, err
    pid = int(out.split()[0])
    assert process_gone(pid, 10)
    saved = store.read_json(tmp_path / "cache" / "dispatch" / "timings.json")
    assert bool(saved) == kept


def test_a_killed_user_process_takes_its_tuning_process_with_it(tmp_path):
    proc = _run_user(tmp_path, "import time; time.sleep(120)", FAKE_TUNING_SLEEP="600")
    pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert process_gone(pid, 10)


def test_stand_ins_never_draw_from_the_callers_rng():
    meta = (spec_mod.TensorMeta((2, 4, 9, 7), (252, 63, 7, 1), torch.float32, "cpu"),
            spec_mod.TensorMeta((5, 4, 3, 3), (36, 9, 3, 1), torch.float32, "cpu"),
            spec_mod.TensorMeta((5,), (1,), torch.float32, "cpu"), 1, None, True, 1, False)
    torch.manual_seed(123)
    expected = torch.randn(4)
    torch.manual_seed(123)
    fresh = measure.fresh_args("conv2d", meta)
    assert torch.equal(torch.randn(4), expected)
    again = measure.fresh_args("conv2d", meta)
    assert all(torch.equal(a, b) for a, b in zip(fresh[:3], again[:3]))  # its own seeded generator
    assert fresh[0].abs().min() > 0 or fresh[0].std() > 0.5  # random, never zeros


def test_the_memory_estimate_counts_stand_ins_and_outputs():
    x = spec_mod.TensorMeta((64, 64, 256, 256), (4194304, 1, 16384, 64), torch.float16, "cuda:0")
    w = spec_mod.TensorMeta((64, 64, 3, 3), (576, 1, 192, 64), torch.float16, "cuda:0")
    b = spec_mod.TensorMeta((64,), (1,), torch.float16, "cuda:0")
    spec = decide.Spec("conv2d", "cuda:0", x.shape, w.shape, torch.float16, 1, True, True, True, "channels_last")
    mib = 2**20
    plane = 64 * 64 * 256 * 256 * 2  # one 64-channel 256² B=64 f16 activation: 512 MiB
    need = measure.bytes_needed(spec, (x, w, b, 1, x, True, 1, False))
    assert need == 2 * plane + 64 * 576 * 2 + 128 + 3 * plane + 64 * mib
    up = decide.Spec("conv2d", "cuda:0", (1, 64, 32, 32), w.shape, torch.float16, 1, False, False, False, "nchw", 2)
    xm = spec_mod.TensorMeta((1, 64, 32, 32), (65536, 1024, 32, 1), torch.float16, "cuda:0")
    assert measure.bytes_needed(up, (xm, w, None, 1, None, False, 2, False)) == (
        65536 * 2 + 64 * 576 * 2 + 3 * 64 * 64 * 64 * 2 + 64 * mib)


def test_tuning_modes_from_env_and_switches(monkeypatch):
    monkeypatch.delenv("TAESD_FAST_TUNING")
    assert dispatch.get_tuning() == "subprocess"
    monkeypatch.setenv("TAESD_FAST_TUNING", "off")
    assert dispatch.get_tuning() == "off"
    with dispatch.tuning("blocking"):
        assert dispatch.get_tuning() == "blocking"
    assert dispatch.get_tuning() == "off"
    monkeypatch.setenv("TAESD_FAST_TUNING", "background")
    with pytest.raises(ValueError, match=r"TAESD_FAST_TUNING must be one of .*subprocess.*got 'background'"):
        dispatch.get_tuning()
    with pytest.raises(ValueError, match="tuning mode must be one of"):
        dispatch.set_tuning("eventually")


def test_cpu_models_start_no_tuning_process():
    """Nothing on a CPU call can be tuned: subprocess mode decides PyTorch in the calling thread, no job sent."""
    from taesd_fast import TAESD

    dispatch.set_tuning("subprocess")
    with torch.no_grad():
        TAESD("taesd", encoder=False).decode(torch.randn(1, 4, 8, 8))
    status = dispatch.tuning_status()
    assert status.pending == 0 and status.done == 0 and status.processes == []


def test_warmup_runs_each_shape_twice_with_blocking_tuning(monkeypatch):
    """TAESD.warmup: blocking tuning, both calls per shape (the eager one and the one a graph is captured in),
    inputs of the right shape per part, and the dispatch table back. On CPU nothing is timed; the calls are real."""
    from taesd_fast import TAESD

    model = TAESD("taesd")
    seen = []
    real_decode, real_encode = model.decode, model.encode
    monkeypatch.setattr(model, "decode", lambda x: seen.append(("dec", tuple(x.shape), dispatch.get_tuning()))
                        or real_decode(x))
    monkeypatch.setattr(model, "encode", lambda x: seen.append(("enc", tuple(x.shape), dispatch.get_tuning()))
                        or real_encode(x))
    dispatch.set_tuning("off")
    torch.manual_seed(5)
    expected = torch.randn(3)
    torch.manual_seed(5)
    table_text = model.warmup([(2, 16, 24)], part="both")
    assert torch.equal(torch.randn(3), expected)  # the caller's RNG is untouched
    assert seen == [("enc", (2, 3, 16, 24), "blocking")] * 2 + [("dec", (2, 4, 2, 3), "blocking")] * 2
    assert dispatch.get_tuning() == "off"  # restored
    assert "decoder.1" in table_text and "encoder.0" in table_text
    seen.clear()
    model.warmup([(1, 4, 5, 6)])  # the decoder's input shape as given
    assert seen == [("dec", (1, 4, 5, 6), "blocking")] * 2
    with pytest.raises(ValueError, match=r"warmup shape \(1, 4, 5, 6\): expected \(B, H, W\) in pixels$"):
        model.warmup([(1, 4, 5, 6)], part="both")
    with pytest.raises(ValueError, match="part must be 'decoder', 'encoder' or 'both', got 'decode'"):
        model.warmup([(1, 16, 16)], part="decode")


def test_tune_cli_parses_shapes_and_tunes_through_warmup(monkeypatch, capsys):
    """The `tune` subcommand as cli.py wires it: shapes parsed, latents turned into pixel sizes, warmup called with
    them; a CPU model is refused with a one-line reason."""
    import argparse
    from types import SimpleNamespace

    from taesd_fast import TAESD
    from taesd_fast.apps import tune_cli

    assert tune_cli.parse_shape("1x32x32x32") == (1, 32, 32, 32) and tune_cli.parse_shape("4X256x256") == (4, 256, 256)
    for bad in ("1x32", "ax2x3", "0x4x4"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a shape: expected latents BxCxhxw"):
            tune_cli.parse_shape(bad)

    calls = []

    class FakeModel(TAESD):
        def warmup(self, shapes, part="decoder"):
            calls.append((shapes, part))
            return "TABLE"

    model = FakeModel("taef2")
    on = lambda device: lambda: iter([SimpleNamespace(device=torch.device(device))])  # noqa: E731

    def model_args(p):
        p.add_argument("--weights")

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    tune_cli.add_parser(sub, model_args, lambda args, encoder: model)
    args = parser.parse_args(["tune", "--shape", "2x32x8x16", "--shape", "1x64x64", "--encode"])
    monkeypatch.setattr(model, "parameters", on("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        args.func(args)
    monkeypatch.setattr(model, "parameters", on("cuda"))  # a stand-in: warmup is faked, nothing runs
    assert args.func(args) == 0
    assert calls == [([(2, 64, 128), (1, 64, 64)], "both")]
    assert "TABLE" in capsys.readouterr().out
