"""Background, blocking and off tuning, driven on the CPU: a fake kernel row that runs on CPU tensors and a fake,
deterministic measure function stand in for the GPU kernels and their timing (the GPU tests time real ones)."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch, graphs
from taesd_fast.dispatch import decide, measure, store, table, tuner

pytestmark = pytest.mark.usefixtures("isolated_dispatch")


def _fake_kernel_conv(x, w, b, stride, residual, relu, upsample=1, pre_clamp=False):
    """A correct conv computed another way (float64), so a test can tell which row ran: it logs each call."""
    FAKE_CALLS.append(tuple(x.shape))
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=stride, padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual.double()
    return (torch.relu(y) if relu else y).to(x.dtype)


FAKE_CALLS: list = []


class FakeMeasure:
    """time_candidates stand-in: the fake kernel is twice as fast as PyTorch; optionally blocks until released."""

    def __init__(self, block: bool = False, fail: bool = False):
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.fail = fail
        self.calls = []  # (spec, graph, thread name)
        self.started = threading.Event()

    def __call__(self, rows, spec, meta, graph, reps=measure.REPS, progress=False):
        self.calls.append((spec, graph, threading.current_thread().name))
        self.metas = getattr(self, "metas", []) + [meta]
        self.started.set()
        assert self.release.wait(30), "test never released the fake measure"
        if self.fail:
            raise RuntimeError("kernel build exploded")
        return {r.name: (1.0 if r.name == "torch" else 0.5) for r in rows}, {}


@pytest.fixture
def fake_kernel(monkeypatch):
    """The conv2d table reduced to PyTorch plus one fake kernel row that runs on CPU tensors."""
    FAKE_CALLS.clear()
    rows = [table.row("conv2d", "torch"),
            table.Row("fake", "conv2d", _fake_kernel_conv, devices=("cpu",), nvrtc=False, layouts=("nchw",))]
    monkeypatch.setattr(table, "ROWS", rows + [r for r in table.ROWS if r.kind != "conv2d"])
    yield
    dispatch.wait_for_tuning(timeout=30)


def _install(monkeypatch, fake: FakeMeasure) -> FakeMeasure:
    monkeypatch.setattr(measure, "time_candidates", fake)
    return fake


def _conv(x, w, b):
    return dispatch.conv2d(x, w, b, relu=True)


def _data(seed=0, shape=(2, 4, 9, 7)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g), torch.randn(5, shape[1], 3, 3, generator=g), torch.randn(5, generator=g))


def _reference(x, w, b):
    return torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=1))


def test_background_miss_runs_pytorch_at_once_then_the_tuned_kernel(fake_kernel, monkeypatch):
    fake = _install(monkeypatch, FakeMeasure(block=True))
    dispatch.set_tuning("background")
    x, w, b = _data()
    generation = dispatch.generation()
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            y = _conv(x, w, b)
        assert time.perf_counter() - t0 < 5  # did not wait for the (blocked) tuner
        assert torch.equal(y, torch.relu(F.conv2d(x, w, b, padding=1)))  # exactly the PyTorch row
        assert FAKE_CALLS == []
        assert fake.started.wait(10) and fake.calls[0][2] == "taesd_fast-tuner"
        status = dispatch.tuning_status()
        assert status.pending == 1 and status.done == 0
        assert not dispatch.wait_for_tuning(timeout=0.05)  # still measuring
    finally:
        fake.release.set()
    assert dispatch.wait_for_tuning(timeout=10)
    status = dispatch.tuning_status()
    assert status.pending == 0 and status.done == 1 and status.last_error is None
    assert dispatch.generation() == generation + 1  # the decision changed
    with torch.no_grad():
        y2 = _conv(x, w, b)
    assert FAKE_CALLS == [tuple(x.shape)]
    torch.testing.assert_close(y2.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    # the timings went to the file, keyed like any other (device name "cpu" for CPU calls)
    saved = store.read_json(store.timings_path())
    ((key, entry),) = saved.items()
    assert key.startswith("cpu|") and entry == {"ms": {"torch": 1.0, "fake": 0.5}}


def test_the_tuner_is_given_metadata_never_the_callers_tensors(fake_kernel, monkeypatch):
    fake = _install(monkeypatch, FakeMeasure(block=True))
    dispatch.set_tuning("background")
    x, w, b = _data(1)
    alive = weakref.ref(x)
    try:
        with torch.no_grad():
            _conv(x, w, b)
        assert fake.started.wait(10)
        del x
        gc.collect()
        assert alive() is None  # the queued/running job keeps no reference to the input
        assert not any(isinstance(a, torch.Tensor) for a in fake.metas[0])
        assert fake.metas[0][0] == dispatch.spec.TensorMeta((2, 4, 9, 7), (252, 63, 7, 1), torch.float32, "cpu")
    finally:
        fake.release.set()


def test_graph_replayed_specs_are_tuned_first(fake_kernel, monkeypatch):
    fake = _install(monkeypatch, FakeMeasure(block=True))
    dispatch.set_tuning("background")
    shapes = [(1, 4, 6, 6), (1, 4, 8, 8), (1, 4, 10, 10)]
    try:
        with torch.no_grad():
            _conv(*_data(0, shapes[0]))  # eager: starts the tuner, which blocks on it
            assert fake.started.wait(10)
            _conv(*_data(0, shapes[1]))  # eager, queued
            with dispatch.graph_timing():
                _conv(*_data(0, shapes[2]))  # for a graph: queued behind, tuned before shapes[1]
    finally:
        fake.release.set()
    assert dispatch.wait_for_tuning(timeout=10)
    assert [(c[0].x_shape, c[1]) for c in fake.calls] == [(shapes[0], False), (shapes[2], True), (shapes[1], False)]
    assert dispatch.tuning_status().done == 3


def test_graph_cache_captures_again_once_tuning_changes_a_decision(fake_kernel, monkeypatch):
    """The whole path: a call's graph is captured with PyTorch while tuning runs; when the tuner publishes, the
    next call captures again and the new graph runs the tuned kernel. Capture is faked (CI has no GPU)."""
    fake = _install(monkeypatch, FakeMeasure(block=True))
    dispatch.set_tuning("background")
    captures = []

    class Captured:
        def __init__(self, fn, example, wait=True):
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
    cache = graphs.GraphCache()
    x, w, b = _data(2)
    fn = lambda t: _conv(t, w, b)  # noqa: E731
    try:
        with torch.no_grad():
            cache(fn, x, [])  # eager
            cache(fn, x, [])  # captured: PyTorch, while the graph-replay spec is tuned
            cache(fn, x, [])  # replay
        assert FAKE_CALLS == [] and len(captures) == 1
    finally:
        fake.release.set()
    assert dispatch.wait_for_tuning(timeout=10)
    assert [c[1] for c in fake.calls] == [True]  # only what the replays run: the eager first call decided as they do
    with torch.no_grad():
        y = cache(fn, x, [])  # the generation moved: captured again at once, now with the fake kernel
    assert len(captures) == 2 and captures[1] == dispatch.generation() and FAKE_CALLS
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    FAKE_CALLS.clear()
    with torch.no_grad():
        cache(fn, x, [])
    assert len(captures) == 2 and FAKE_CALLS == [tuple(x.shape)]  # a replay of the new graph


def test_off_mode_never_times_but_uses_stored_timings(fake_kernel, monkeypatch):
    fake = _install(monkeypatch, FakeMeasure())
    x, w, b = _data(3)
    with dispatch.tuning("off"), torch.no_grad():
        y = _conv(x, w, b)
        assert torch.equal(y, torch.relu(F.conv2d(x, w, b, padding=1))) and FAKE_CALLS == []
        assert dispatch.tuning_status().pending == 0 and fake.calls == []
        (rec,) = [r for r in decide.state.decided.values()]
        assert rec.choice == "torch" and rec.why == "not timed (tuning off)"
        spec = rec.spec
        store.put(spec.key("cpu"), {"torch": 1.0, "fake": 0.5}, {})  # as a tuning run on this machine left them
        dispatch.clear_cache()
        _conv(x, w, b)
    assert FAKE_CALLS == [tuple(x.shape)] and fake.calls == []


def test_blocking_mode_times_in_the_calling_thread(fake_kernel, monkeypatch):
    fake = _install(monkeypatch, FakeMeasure())
    x, w, b = _data(4)
    generation = dispatch.generation()
    with dispatch.tuning("blocking"), torch.no_grad():
        y = _conv(x, w, b)
    assert [c[2] for c in fake.calls] == [threading.current_thread().name]
    assert FAKE_CALLS == [tuple(x.shape)] and dispatch.generation() == generation
    torch.testing.assert_close(y.double(), _reference(x, w, b), rtol=1e-6, atol=1e-6)
    ((_, rec),) = [(k, r) for k, r in decide.state.decided.items()]
    assert rec.why == "measured" and rec.ms == {"torch": 1.0, "fake": 0.5}


def _call_in_thread(fn, timeout=10.0):
    """Run fn in a thread; returns (finished in time, result)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("y", fn()), daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive(), out.get("y")


def test_no_decision_waits_behind_a_measurement(fake_kernel, monkeypatch):
    """While one call's candidates are being measured (blocked here on an Event), other calls decide: a stored
    spec, a spec in off mode, and a new spec queued to the background tuner. None waits for the measurement."""
    fake = _install(monkeypatch, FakeMeasure(block=True))
    a, b_, c = _data(5, (1, 4, 6, 6)), _data(5, (1, 4, 7, 7)), _data(5, (1, 4, 8, 8))
    probe = decide.Spec("conv2d", "cpu", (1, 4, 7, 7), (5, 4, 3, 3), torch.float32, 1, True, False, True, "nchw")
    store.put(probe.key("cpu"), {"torch": 1.0, "fake": 0.5}, {})

    def blocking_call():
        with dispatch.tuning("blocking"), torch.no_grad():
            return _conv(*a)

    t = threading.Thread(target=blocking_call, daemon=True)
    try:
        t.start()
        assert fake.started.wait(10)  # thread t is inside the measurement now
        with torch.no_grad():
            done, y = _call_in_thread(lambda: _conv(*b_))  # stored timings: decided without measuring
            assert done and FAKE_CALLS == [(1, 4, 7, 7)]
            with dispatch.tuning("background"):
                done, y = _call_in_thread(lambda: _conv(*c))  # queued to the tuner, runs PyTorch now
            assert done and torch.equal(y, torch.relu(F.conv2d(c[0], c[1], c[2], padding=1)))
    finally:
        fake.release.set()
    t.join(10)
    assert not t.is_alive()
    assert dispatch.wait_for_tuning(timeout=10)


def test_a_failing_tuner_warns_once_and_calls_keep_running_pytorch(fake_kernel, monkeypatch):
    _install(monkeypatch, FakeMeasure(fail=True))
    monkeypatch.setattr(tuner, "_warned", False)
    dispatch.set_tuning("background")
    x, w, b = _data(6)
    generation = dispatch.generation()
    with pytest.warns(RuntimeWarning, match="background tuning failed.*kernel build exploded"):
        with torch.no_grad():
            _conv(x, w, b)
        assert dispatch.wait_for_tuning(timeout=10)
    status = dispatch.tuning_status()
    assert "RuntimeError: kernel build exploded" in status.last_error and status.done == 1
    assert dispatch.generation() == generation  # nothing changed: graphs are not captured again
    with torch.no_grad():
        y = _conv(x, w, b)
    assert FAKE_CALLS == [] and torch.equal(y, torch.relu(F.conv2d(x, w, b, padding=1)))
    (rec,) = [r for r in decide.state.decided.values()]
    assert rec.choice == "torch" and "background tuning failed" in rec.why


def test_tuning_modes_from_env_and_switches(monkeypatch):
    monkeypatch.delenv("TAESD_FAST_TUNING")
    assert dispatch.get_tuning() == "background"
    monkeypatch.setenv("TAESD_FAST_TUNING", "off")
    assert dispatch.get_tuning() == "off"
    with dispatch.tuning("blocking"):
        assert dispatch.get_tuning() == "blocking"
    assert dispatch.get_tuning() == "off"
    monkeypatch.setenv("TAESD_FAST_TUNING", "sometimes")
    with pytest.raises(ValueError, match=r"TAESD_FAST_TUNING must be one of .*background.*got 'sometimes'"):
        dispatch.get_tuning()
    with pytest.raises(ValueError, match="tuning mode must be one of"):
        dispatch.set_tuning("eventually")


def test_cpu_models_start_no_tuner(monkeypatch):
    """Nothing on a CPU call can be tuned: background mode decides PyTorch in the calling thread, no job queued."""
    from taesd_fast import TAESD

    dispatch.set_tuning("background")
    with torch.no_grad():
        TAESD("taesd", encoder=False).decode(torch.randn(1, 4, 8, 8))
    assert dispatch.tuning_status().pending == 0 and dispatch.tuning_status().done == 0


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
    table_text = model.warmup([(2, 16, 24)], part="both")
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

    from taesd_fast import TAESD, tune_cli

    assert tune_cli.parse_shape("1x32x32x32") == (1, 32, 32, 32) and tune_cli.parse_shape("4X256x256") == (4, 256, 256)
    for bad in ("1x32", "ax2x3", "0x4x4"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a shape: expected latents BxCxhxw"):
            tune_cli.parse_shape(bad)

    calls = []

    class FakeModel(TAESD):
        def warmup(self, shapes, part="decoder"):
            calls.append((shapes, part))
            return "TABLE"

    from types import SimpleNamespace

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


def test_graph_cache_does_not_wait_for_a_tuning_step(monkeypatch):
    """In background tuning a capture that finds gpu_lock held by a tuning step runs the call eagerly at once and
    asks the tuner to pause; the next call captures. In blocking tuning the capture waits for the lock."""
    captures = []

    class Captured:
        def __init__(self, fn, example, wait=True):
            with measure.capture_turn(wait):
                self.generation, self.fn = dispatch.generation(), fn
                captures.append(tuple(example.shape))

        def __call__(self, x):
            return self.fn(x)

    monkeypatch.setattr(graphs, "CUDAGraphed", Captured)
    monkeypatch.setattr(graphs, "_replayable", lambda x, params: True)
    held, release = threading.Event(), threading.Event()

    def tuning_step():
        with measure.tuner_step():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=tuning_step, daemon=True)
    holder.start()
    assert held.wait(10)
    cache, x = graphs.GraphCache(), torch.randn(3, 2)
    dispatch.set_tuning("background")
    try:
        t0 = time.perf_counter()
        assert torch.equal(cache(lambda t: t + 1, x, []), x + 1)  # first call: eager anyway
        assert torch.equal(cache(lambda t: t + 1, x, []), x + 1)  # would capture: the lock is busy, so eager
        assert time.perf_counter() - t0 < 1.0 and captures == [] and len(cache) == 0
        assert measure._capture_wanted.is_set()  # the tuner will pause at its next step boundary
    finally:
        release.set()
    holder.join(10)
    cache(lambda t: t + 1, x, [])
    assert captures == [(3, 2)] and not measure._capture_wanted.is_set()

    # blocking tuning: a capture waits for the step to end
    held.clear(), release.clear()
    holder = threading.Thread(target=tuning_step, daemon=True)
    holder.start()
    assert held.wait(10)
    threading.Timer(0.3, release.set).start()
    dispatch.set_tuning("blocking")
    cache2 = graphs.GraphCache()
    cache2(lambda t: t, x, [])
    t0 = time.perf_counter()
    cache2(lambda t: t, x, [])
    assert time.perf_counter() - t0 >= 0.2 and captures == [(3, 2), (3, 2)]
    holder.join(10)


def test_the_tuner_pauses_for_a_capture_that_asked(monkeypatch):
    """A capture that found the GPU busy sets the request; the tuner's next step waits for it (up to
    CAPTURE_PAUSE_S), so the capture gets the lock on the caller's next call."""
    monkeypatch.setattr(measure, "CAPTURE_PAUSE_S", 5.0)
    entered = threading.Event()
    measure._capture_wanted.set()

    def step():
        with measure.tuner_step():
            entered.set()

    t = threading.Thread(target=step, daemon=True)
    t.start()
    assert not entered.wait(0.3)  # paused: the capture has not come yet
    with measure.capture_turn(wait=False):  # the lock is free for it
        pass
    assert entered.wait(5)  # the capture cleared the request: the tuner goes on
    t.join(5)
