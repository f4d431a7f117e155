"""Dispatch logic that runs without a GPU: CPU picks PyTorch, modes, the table, the op's twin, and the
timing-cache file staying whole under concurrent writers."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast.kernels import simt_conv


pytestmark = pytest.mark.usefixtures("isolated_dispatch")


class Conv(torch.nn.Conv2d):
    layer_name = "net.conv"

    def forward(self, x, residual=None, relu=False):
        return dispatch.conv2d(x, self.weight, self.bias, stride=self.stride[0], residual=residual, relu=relu, layer=self)


def _ref(x, w, b, stride, residual, relu):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=stride, padding=w.shape[-1] // 2)
    if residual is not None:
        y = y + residual.double()
    return torch.relu(y) if relu else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("stride", [1, 2])
def test_cpu_conv2d_matches_reference_and_picks_torch(dtype, stride):
    g = torch.Generator().manual_seed(stride)
    conv = Conv(5, 7, 3, stride=stride, padding=1).to(dtype)
    x = torch.randn(2, 5, 13, 11, generator=g).to(dtype)
    res = torch.randn(2, 7, (13 - 1) // stride + 1, (11 - 1) // stride + 1, generator=g).to(dtype)
    with torch.no_grad():
        y = conv(x, residual=res, relu=True)
    ref = _ref(x, conv.weight, conv.bias, stride, res, True)
    assert y.dtype == dtype and y.shape == ref.shape
    assert ((y.double() - ref).norm() / ref.norm()).item() < (1e-6 if dtype == torch.float32 else 5e-3)
    table = dispatch.dispatch_table(conv)
    (row,) = [line for line in table.splitlines() if line.startswith("net.conv")]
    assert row.split()[7] == "torch" and "triton_conv: CPU tensor" in row
    ((_, rec),) = dispatch.rows_of(conv)
    assert rec.choice == "torch" and rec.skipped["simt_f16_rb"] == "CPU tensor"


def test_conv2d_choice_looks_up_the_decision_for_another_batch():
    """dispatch.conv2d_choice: None before any call of that shape, then the row decided for conv2d on x's kind of
    input with `batch` images (here the torch row on the CPU), per epilogue; looking up decides nothing."""
    w, b = torch.randn(6, 4, 3, 3), torch.randn(6)
    x = torch.randn(1, 4, 5, 7).contiguous(memory_format=torch.channels_last)
    assert dispatch.conv2d_choice(x, w, b, batch=2, relu=True, upsample=2) is None
    with torch.no_grad():
        dispatch.conv2d(torch.randn(2, 4, 5, 7).contiguous(memory_format=torch.channels_last), w, b, relu=True,
                        upsample=2)
    assert dispatch.conv2d_choice(x, w, b, batch=2, relu=True, upsample=2) == "torch"
    assert dispatch.conv2d_choice(x, w, b, batch=3, relu=True, upsample=2) is None
    assert dispatch.conv2d_choice(x, w, b, batch=2, relu=False, upsample=2) is None


def test_kernels_mode_on_cpu_still_runs_torch():
    conv = Conv(4, 4, 3, padding=1)
    x = torch.randn(1, 4, 9, 9)
    with dispatch.backend("kernels"):
        assert dispatch.get_backend() == "kernels"
        y = conv(x)
    assert dispatch.get_backend() == "auto"
    torch.testing.assert_close(y, F.conv2d(x, conv.weight, conv.bias, padding=1))


def test_backend_rejects_unknown_mode():
    with pytest.raises(ValueError, match="auto"):
        dispatch.set_backend("fast")


def test_head_conv_cpu():
    x = torch.randn(1, 8, 5, 6, 7)
    w = torch.randn(3, 8, 3, 3, 3)
    b = torch.randn(3)
    y = dispatch.head_conv(x, w, b)
    assert y.shape == (1, 3, 3, 6, 7)
    torch.testing.assert_close(y, F.conv3d(x, w, b, padding=(0, 1, 1)).clamp(-1, 1))


def test_eligibility_reasons():
    """Each conv row's support rule, and the device check that keeps CPU calls from asking CUDA-only rows."""
    def spec(**kw):
        fields = dict(kind="conv2d", device="cuda:0", x_shape=(1, 64, 8, 8), w_shape=(64, 64, 3, 3),
                      dtype=torch.float16, stride=1, bias=True, residual=False, relu=True, layout="nchw")
        fields.update(kw)
        return dispatch.Spec(**fields)

    def reasons(**kw):
        # The PyTorch and SIMT rows' rules read the spec alone; the Hopper rows' ask the GPU (tests/gpu covers them).
        return {r.name: r.supports(spec(**kw)) for r in dispatch.ROWS
                if r.kind == "conv2d" and (r.name == "torch" or r.name.startswith("simt_"))}

    assert reasons()["simt_f16_rb"] is None and reasons()["torch"] is None
    assert "float16" in reasons(dtype=torch.float32)["simt_f16_tile"]
    assert "bfloat16" in reasons(dtype=torch.bfloat16)["simt_f16_ocb4"]
    assert "1..64" in reasons(x_shape=(1, 128, 8, 8), w_shape=(64, 128, 3, 3))["simt_f16_tile"]
    assert "1..64" in reasons(w_shape=(128, 64, 3, 3))["simt_f16_tile"]
    assert "3x3" in reasons(w_shape=(64, 64, 1, 1))["simt_f16_ocb4"]
    assert "stride 1 only" in reasons(stride=2)["simt_f16_rb"] and reasons(stride=2)["simt_f16_ocb4"] is None
    assert "upsample" in reasons(upsample=2)["simt_f16_rb"]
    assert "clamp" in reasons(pre_clamp=True)["simt_f16_ocb4"]
    rows, skipped = dispatch.decide.eligible(spec(device="cpu"))
    assert [r.name for r in rows] == ["torch"]
    assert skipped["simt_f16_rb"] == "CPU tensor" and skipped["triton_conv"] == "CPU tensor"
    assert not dispatch.decide.tunable(spec(device="cpu")) and dispatch.decide.tunable(spec())


def test_op_validation_messages():
    x = torch.randn(1, 4, 8, 8, dtype=torch.float16)
    w = torch.randn(4, 4, 3, 3, dtype=torch.float16)
    op = torch.ops.taesd_fast.conv3x3_f16
    with pytest.raises(TypeError, match="float16"):
        op(x.float(), w, None, None, 1, False, "tile")
    with pytest.raises(ValueError, match="4-D"):
        op(x[0], w, None, None, 1, False, "tile")
    with pytest.raises(ValueError, match="stride 1 only"):
        op(x, w, None, None, 2, False, "rb")
    with pytest.raises(ValueError, match="residual must have the output shape"):
        op(x, w, None, torch.zeros(1, 4, 7, 8, dtype=torch.float16), 1, False, "tile")
    with pytest.raises(ValueError, match="1..64"):
        op(torch.randn(1, 65, 8, 8, dtype=torch.float16), torch.randn(4, 65, 3, 3, dtype=torch.float16), None, None, 1,
           False, "tile")


@pytest.mark.parametrize("variant", simt_conv.VARIANTS)
def test_op_cpu_twin_and_opcheck(variant):
    stride = 1 if variant == "rb" else 2
    x = torch.randn(2, 3, 11, 9, dtype=torch.float16)
    w = torch.randn(5, 3, 3, 3, dtype=torch.float16)
    b = torch.randn(5, dtype=torch.float16)
    res = torch.randn(2, 5, (11 - 1) // stride + 1, (9 - 1) // stride + 1, dtype=torch.float16)
    args = (x, w, b, res, stride, True, variant)
    y = torch.ops.taesd_fast.conv3x3_f16(*args)
    torch.testing.assert_close(y, simt_conv.conv3x3_f16_ref(*args))
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_f16.default, args)


def test_compile_fullgraph_cpu():
    conv = Conv(4, 6, 3, padding=1)
    x = torch.randn(1, 4, 10, 10)
    eager = conv(x, relu=True)
    compiled = torch.compile(lambda t: conv(t, relu=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), eager)


def _writer(path, start, n):
    for i in range(start, start + n):
        dispatch.store_timings({f"key{i}": {"ms": {"torch": float(i)}}}, path=path)


def test_timings_file_merges_concurrent_writers(tmp_path):
    path = tmp_path / "dispatch" / "timings.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, 100 * p, 25)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = json.loads(path.read_text())
    assert len(data) == 100 and data["key324"]["ms"]["torch"] == 324.0
    assert not list(path.parent.glob("*.tmp"))


def test_cached_timings_drive_auto_choice():
    """Auto picks a kernel only when its cached time beats torch by the margin; forced mode picks the
    fastest kernel. Driven through decide.pick with synthetic timings (no GPU needed)."""
    spec = dispatch.Spec("conv2d", "cuda:0", (1, 64, 8, 8), (64, 64, 3, 3), torch.float16, 1, True, False, True, "nchw")
    rows = [r for r in dispatch.ROWS if r.kind == "conv2d"]
    slow = {"ms": {"torch": 1.0, "simt_f16_rb": 1.5, "simt_f16_ocb4": 2.0, "simt_f16_tile": 3.0}}
    fast = {"ms": {"torch": 1.0, "simt_f16_rb": 0.5, "simt_f16_ocb4": 2.0, "simt_f16_tile": 3.0}}
    tie = {"ms": {"torch": 1.0, "simt_f16_rb": 0.99, "simt_f16_ocb4": 2.0, "simt_f16_tile": 3.0}}
    pick = lambda mode, entry: dispatch.decide.pick(spec, mode, rows, {}, entry, "t", False).choice  # noqa: E731
    assert pick("auto", slow) == "torch"
    assert pick("auto", fast) == "simt_f16_rb"
    assert pick("auto", tie) == "torch"
    assert pick("kernels", slow) == "simt_f16_rb"
    failed = {"ms": {"torch": 1.0}, "failed": {n: "failed: x" for n in ("simt_f16_rb", "simt_f16_ocb4", "simt_f16_tile")}}
    assert pick("auto", failed) == "torch"
    assert pick("kernels", None) == "simt_f16_rb"  # no timings: the default order, NCHW-native rows first
    assert dispatch.decide.pick(spec, "auto", rows, {}, fast, "t", False).run is dispatch.table.row("conv2d", "simt_f16_rb").run


def test_graph_decisions_prefer_the_tile_kernel_within_its_slack():
    """In graph replays, cuda_conv_tiles is taken over triton_conv_tma where it times within 6% of it (decide's
    CHAIN_PREFERRED, measured in taew2_1's step); eager decisions, and a wider gap, keep the fastest row."""
    spec = dispatch.Spec("conv2d", "cuda:0", (1, 128, 80, 128), (128, 128, 3, 3), torch.float16, 1, True, False, True,
                         "channels_last")
    rows = [r for r in dispatch.ROWS if r.kind == "conv2d"]

    def pick(tiles: float, graph: bool, mode: str = "auto") -> str:
        entry = {"ms": {"torch": 16.0, "triton_conv_tma": 9.0, "cuda_conv_tiles": tiles, "triton_conv": 10.5}}
        return dispatch.decide.pick(spec, mode, rows, {}, entry, "t", graph).choice

    assert pick(9.5, graph=True) == "cuda_conv_tiles"  # 5.6% slower alone
    assert pick(9.5, graph=True, mode="kernels") == "cuda_conv_tiles"
    assert pick(9.6, graph=True) == "triton_conv_tma"  # 6.7%
    assert pick(9.5, graph=False) == "triton_conv_tma"
    assert pick(8.9, graph=False) == "cuda_conv_tiles"
    record = dispatch.decide.pick(spec, "auto", rows, {}, {"ms": {"torch": 16.0, "triton_conv_tma": 9.0,
                                                                  "cuda_conv_tiles": 9.5}}, "t", True)
    assert record.run is dispatch.table.row("conv2d", "cuda_conv_tiles").run and "faster in a chain" in record.why


def test_import_touches_no_cuda():
    code = (
        "import torch\n"
        "def boom(*a, **k): raise RuntimeError('CUDA touched at import')\n"
        "torch.cuda.current_device = boom; torch.cuda.init = boom; torch.cuda._lazy_init = boom\n"
        "torch.cuda.get_device_properties = boom; torch.cuda.is_available = boom\n"
        "import taesd_fast, taesd_fast.dispatch, taesd_fast.kernels.simt_conv, taesd_fast._backend\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_cpu_models_do_not_import_triton():
    """Triton candidates are skipped for CPU tensors before their module (and Triton, ~1 s) is imported."""
    code = (
        "import sys, torch, taesd_fast\n"
        "with torch.no_grad():\n"
        "    taesd_fast.TAESD('taesd').decode(torch.randn(1, 4, 8, 8))\n"
        "    taesd_fast.OutputHead(16, 12)(torch.randn(1, 16, 2, 4, 4))\n"
        "print('triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_disable_env_reason(monkeypatch):
    from taesd_fast import _backend

    monkeypatch.setenv("TAESD_FAST_DISABLE_KERNELS", "1")
    assert _backend.kernels_unavailable_reason() == "disabled by TAESD_FAST_DISABLE_KERNELS"
    assert not _backend.kernels_available()


def test_decoder_hands_upsample_and_clamp_to_the_conv_and_stays_exact():
    """ReLUSequential folds each nearest Upsample, and the Clamp, into the next conv's dispatch call (kernels may
    fold them into their loads); the PyTorch path must give exactly what the plain Sequential gives."""
    from taesd_fast import TAESD

    torch.manual_seed(0)
    model = TAESD("taesd", encoder=False)
    latents = torch.randn(2, 4, 6, 5)
    plain = torch.nn.Sequential(*model.decoder)  # same modules, plain forward: nn.Upsample runs on its own
    with torch.no_grad():
        ours = model.decoder(latents)
        expected = plain(latents)
    assert torch.equal(ours, expected)
    rows = [r for r in model.dispatch_table().splitlines() if " up2" in r]
    assert [r.split()[0] for r in rows] == ["decoder.7", "decoder.12", "decoder.17"]
    # each conv is given the low-resolution input
    assert [r.split()[1] for r in rows] == ["2x64x6x5", "2x64x12x10", "2x64x24x20"]
    clamped = [r.split()[0] for r in model.dispatch_table().splitlines() if "clamp" in r]
    assert clamped == ["decoder.1"]  # the raw latents go to the first conv


def test_graph_timing_keeps_its_own_timings_and_decisions(monkeypatch):
    """Inside graph_timing() the dispatcher reads and writes timings under a separate key (taken as graph replays)
    and caches its decision apart from eager calls of the same shape. Driven with synthetic timings, no GPU."""
    from taesd_fast.dispatch import calls, decide, store

    spec = dispatch.Spec("conv2d", "cuda:0", (1, 64, 8, 8), (64, 64, 3, 3), torch.float16, 1, True, False, True,
                         "channels_last")
    rows = [r for r in dispatch.ROWS if r.kind == "conv2d" and r.name in ("torch", "triton_conv")]
    monkeypatch.setattr(decide, "eligible", lambda s, mode="auto", in_capture=False: (list(rows), {}))
    monkeypatch.setattr(decide, "device_name", lambda device: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA runtime
    eager_key, graph_key = spec.key("FakeGPU"), spec.key("FakeGPU", graph=True)
    assert eager_key != graph_key and graph_key.endswith("|graph")
    store.put(eager_key, {"torch": 0.010, "triton_conv": 0.020}, {})  # eager: Triton's launch cost shows
    store.put(graph_key, {"torch": 0.010, "triton_conv": 0.004}, {})  # replayed: the kernel is faster
    key = tuple(getattr(spec, f) for f in spec.__dataclass_fields__)
    assert dispatch.spec.spec_of(key) == spec
    assert calls._miss(key, "auto", False, ()).choice == "torch"
    with dispatch.graph_timing():
        rec = calls._miss(key, "auto", True, ())
        assert rec.choice == "triton_conv" and "graph replays" in rec.why
    assert decide.state.decided[("auto", False, key)].choice == "torch"
    assert decide.state.decided[("auto", True, key)].choice == "triton_conv"
    assert not decide.state.graph  # the context restores the flag
    assert json.loads(store.timings_path().read_text())[graph_key] == {"ms": {"torch": 0.010, "triton_conv": 0.004}}


def test_a_kernel_first_decided_inside_a_capture_runs_pytorch_and_the_graph_goes_stale(monkeypatch):
    """graphs.capture's warm-up decides and runs every call before the capture. A call first decided inside the
    capture (its warm-up was deferred while the kernel modules were imported, or tuning replaced the decision) would
    load a module or pack a weight mid-capture (the upsample fold copies from the host, which fails the capture):
    it runs PyTorch in the graph, is not remembered, and the next dispatch.poll makes the graph stale."""
    import dataclasses

    from taesd_fast.dispatch import calls, decide, store, table
    from taesd_fast.kernels import rows as kernel_rows

    spec = dispatch.Spec("conv2d", "cuda:0", (1, 64, 8, 8), (64, 64, 3, 3), torch.float16, 1, True, False, True,
                         "channels_last", 2)
    rows = [r for r in dispatch.ROWS if r.kind == "conv2d" and r.name in ("torch", "triton_conv")]
    rows[1] = dataclasses.replace(rows[1], ready=lambda s: True)  # the module is loaded: only the warm-up is missing
    real_row = table.row
    monkeypatch.setattr(table, "row", lambda kind, name: rows[1] if name == "triton_conv" else real_row(kind, name))
    monkeypatch.setattr(decide, "eligible", lambda s, mode="auto", in_capture=False: (list(rows), {}))
    monkeypatch.setattr(decide, "device_name", lambda device: "FakeGPU")
    monkeypatch.setattr(kernel_rows, "importing", lambda: False)
    store.put(spec.key("FakeGPU", graph=True), {"torch": 0.010, "triton_conv": 0.004}, {})
    key = tuple(getattr(spec, f) for f in spec.__dataclass_fields__)
    generation = dispatch.generation()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with dispatch.graph_timing():
        rec = calls._miss(key, "auto", True, ())
    assert rec.choice == "torch" and "kernel not run before capture" in rec.why
    assert ("auto", True, key) not in decide.state.decided
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    dispatch.poll()
    assert dispatch.generation() == generation + 1  # the graph captured with PyTorch there is captured again
    with dispatch.graph_timing():  # ... after a warm-up, which decides the kernel
        assert calls._miss(key, "auto", True, ()).choice == "triton_conv"


def test_table_is_pytorch_rows_plus_every_kernel_row():
    """The dispatcher runs nothing but its PyTorch rows and the kernel modules' rows (kernels/rows.py), the very
    objects, and each kernel row runs the same function for eager calls and graph replays: which kernel suits which
    is measured."""
    from taesd_fast.kernels import rows as kernel_rows

    assert [(r.kind, r.name) for r in dispatch.ROWS if not r.kernel] == [
        ("conv2d", "torch"), ("mem_conv", "torch"), ("head", "torch"), ("head_full", "torch")]
    assert [r for r in dispatch.ROWS if r.kernel] == kernel_rows.KERNEL_ROWS
    for k in kernel_rows.KERNEL_ROWS:
        assert dispatch.table.row(k.kind, k.name) is k and isinstance(k, dispatch.Row) and k.module


def test_tuning_bar_names_the_call_and_can_be_hidden(monkeypatch, capsys):
    """The bar blocking tuning shows while a new shape's kernels compile and are timed; the tuning process (which
    times with show=False) and TAESD_FAST_PROGRESS=0 show none."""
    from taesd_fast.dispatch import measure

    monkeypatch.setattr(measure, "PROGRESS_DELAY_S", 0)
    monkeypatch.setenv("TAESD_FAST_PROGRESS", "1")  # the bar is on unless this says 0
    spec = dispatch.Spec("conv2d", "cuda:0", (2, 64, 8, 12), (64, 64, 3, 3), torch.float16, 1, True, False, True,
                         "nchw")
    with measure.progress_bar(spec, 3, show=True) as bar:
        bar.update(3)
    assert "taesd_fast: timing kernels for conv2d 2x64x8x12 (once per GPU)" in capsys.readouterr().err
    with measure.progress_bar(spec, 3, show=False) as bar:
        bar.update(3)
    assert bar.disable and capsys.readouterr().err == ""
    monkeypatch.setenv("TAESD_FAST_PROGRESS", "0")
    with measure.progress_bar(spec, 3, show=True) as bar:
        bar.update(3)
    assert bar.disable and capsys.readouterr().err == ""


def test_import_graph_has_no_circles():
    """timing is a leaf; dispatch imports timing, graphs imports dispatch, and neither the dispatch package nor
    timing imports graphs."""
    import ast
    import pathlib

    import taesd_fast

    root = pathlib.Path(taesd_fast.__file__).parent

    def imports(path):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                names.add((node.module or "").split(".")[0] or node.names[0].name)
        return names

    assert imports(root / "timing.py") == set()
    for path in (root / "dispatch").glob("*.py"):
        assert "graphs" not in imports(path), path
