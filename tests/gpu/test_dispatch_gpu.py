"""Dispatch on the GPU with blocking tuning (tests/conftest.py's isolated_dispatch): auto mode times candidates once
and persists the result; forced modes; what always goes to PyTorch; no timing while compiling or capturing; the
table. Background tuning: tests/gpu/test_tuning_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast.kernels import rows as kernel_rows
from taesd_fast._backend import kernels_unavailable_reason

_REASON = kernels_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"taesd_fast kernels unavailable: {_REASON}"),
    pytest.mark.usefixtures("isolated_dispatch"),
]


class Conv(torch.nn.Conv2d):
    def __init__(self, *a, name="c", **k):
        super().__init__(*a, **k)
        self.layer_name = name

    def forward(self, x, residual=None, relu=False):
        return dispatch.conv2d(x, self.weight, self.bias, stride=self.stride[0], residual=residual, relu=relu, layer=self)


KERNELS = tuple(r.name for r in kernel_rows.KERNEL_ROWS if r.kind == "conv2d")  # every custom conv row


def _conv(cin, cout, k=3, stride=1, dtype=torch.float16, name="c"):
    return Conv(cin, cout, k, stride=stride, padding=k // 2, name=name).cuda().to(dtype)


def _rec(layer):
    ((_, rec),) = dispatch.rows_of(layer)
    return rec


def test_auto_times_once_and_persists(tmp_path):
    conv = _conv(64, 64)
    x = torch.randn(1, 64, 96, 96, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        y = conv(x, relu=True)
    rec = _rec(conv)
    assert rec.why == "measured"
    assert set(rec.ms) == {"torch", "simt_f16_rb", "simt_f16_ocb4", "simt_f16_tile"}, rec
    best_kernel = min((t for n, t in rec.ms.items() if n != "torch"))
    assert (rec.choice != "torch") == (best_kernel < dispatch.MARGIN * rec.ms["torch"])
    torch.testing.assert_close(y, F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)), rtol=2e-3, atol=2e-3)
    data = json.loads((tmp_path / "dispatch" / "timings.json").read_text())
    assert len(data) == 1 and torch.cuda.get_device_name() in next(iter(data))
    dispatch.clear_cache()  # a new process would see only the file
    with torch.no_grad():
        conv(x, relu=True)
    assert _rec(conv).why == "cached timings" and _rec(conv).choice == rec.choice
    print("\n" + dispatch.dispatch_table(conv))


def test_first_timing_shows_a_progress_bar(monkeypatch, capsys):
    """Timing a new shape (compiling its kernels) shows a bar naming it; a decision from the timings does not."""
    monkeypatch.setattr(dispatch.measure, "PROGRESS_DELAY_S", 0)
    monkeypatch.setenv("TAESD_FAST_PROGRESS", "1")  # the bar is on unless this says 0
    conv = _conv(64, 64)
    x = torch.randn(1, 64, 40, 24, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        conv(x)
        assert "taesd_fast: timing kernels for conv2d 1x64x40x24" in capsys.readouterr().err
        dispatch.clear_cache(disk=False)  # the next decision reads the timings file
        conv(x)
    assert _rec(conv).why == "cached timings" and "taesd_fast" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "cin,cout,k,stride,dtype,why,choice",
    [
        (128, 64, 3, 1, torch.float16, "1..64", "tensor-core"),  # beyond the SIMT kernels, within the Triton ones
        (64, 128, 3, 1, torch.float16, "1..64", "tensor-core"),
        (64, 64, 1, 1, torch.float16, "3x3", "torch"),
        (64, 64, 3, 1, torch.float32, "float16", "torch"),
        (64, 64, 3, 1, torch.bfloat16, "float16", "torch"),
    ],
)
def test_unsupported_goes_to_torch(cin, cout, k, stride, dtype, why, choice):
    conv = _conv(cin, cout, k, stride, dtype)
    x = torch.randn(1, cin, 20, 20, device="cuda", dtype=dtype)
    with dispatch.backend("kernels"), torch.no_grad():
        y = conv(x)
    rec = _rec(conv)
    # forced mode takes the first row of its order that supports the call: for these shapes the TMA row on sm_90,
    # the pointer row elsewhere
    assert rec.choice in ({"triton_conv_tma", "triton_conv"} if choice == "tensor-core" else {choice}), rec
    assert why in rec.skipped["simt_f16_tile"], rec
    tol = {} if choice == "torch" else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(y, F.conv2d(x, conv.weight, conv.bias, stride=stride, padding=k // 2), **tol)


def test_stride2_never_register_blocked():
    conv = _conv(64, 64, stride=2)
    x = torch.randn(2, 64, 33, 31, device="cuda", dtype=torch.float16)
    with dispatch.backend("kernels"), torch.no_grad():
        conv(x, relu=True)
    rec = _rec(conv)
    assert rec.choice in ("triton_conv", "simt_f16_ocb4", "simt_f16_tile") and "stride 1 only" in rec.skipped["simt_f16_rb"]


def test_forced_modes_and_fused_epilogue():
    conv = _conv(32, 64)
    x = torch.randn(2, 32, 41, 23, device="cuda", dtype=torch.float16)
    res = torch.randn(2, 64, 41, 23, device="cuda", dtype=torch.float16)
    ref = F.relu(F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1) + res.double())
    with torch.no_grad():
        with dispatch.backend("kernels"):
            yk = conv(x, residual=res, relu=True)
        assert _rec(conv).choice in KERNELS
        with dispatch.backend("torch"):
            yt = conv(x, residual=res, relu=True)
    ek = ((yk.double() - ref).norm() / ref.norm()).item()
    et = ((yt.double() - ref).norm() / ref.norm()).item()
    assert ek <= 2 * et, (ek, et)


def test_kernels_mode_channels_last_input():
    conv = _conv(64, 64)
    x = torch.randn(1, 64, 30, 30, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    with dispatch.backend("kernels"), torch.no_grad():
        y = conv(x, relu=True)
    assert _rec(conv).spec.layout == "channels_last" and _rec(conv).choice in KERNELS
    torch.testing.assert_close(y, F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)), rtol=2e-3, atol=2e-3)


def test_disable_env_forces_torch(monkeypatch):
    monkeypatch.setenv("TAESD_FAST_DISABLE_KERNELS", "1")
    conv = _conv(64, 64)
    x = torch.randn(1, 64, 16, 16, device="cuda", dtype=torch.float16)
    with dispatch.backend("kernels"), torch.no_grad():
        conv(x)
    rec = _rec(conv)
    assert rec.choice == "torch" and all("TAESD_FAST_DISABLE_KERNELS" in rec.skipped[n] for n in ("simt_f16_rb", "triton_conv"))


def test_capture_without_decision_uses_torch_and_no_timing():
    """A shape first seen inside graph capture is not timed; auto falls back to cuDNN."""
    conv = _conv(16, 64)
    x = torch.randn(1, 16, 24, 24, device="cuda", dtype=torch.float16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        F.conv2d(x, conv.weight, conv.bias, padding=1)  # warm cuDNN outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        y = conv(x, relu=True)
    g.replay()
    torch.cuda.synchronize()
    assert _rec(conv).choice == "torch" and not _rec(conv).ms
    torch.testing.assert_close(y, F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)))


def test_forced_kernels_under_capture_and_compile():
    conv = _conv(64, 64, name="blk.conv")
    x = torch.randn(2, 64, 40, 36, device="cuda", dtype=torch.float16)
    with dispatch.backend("kernels"), torch.no_grad():
        eager = conv(x, relu=True)  # decides + loads the kernel eagerly
        choice = _rec(conv).choice
        assert choice in KERNELS
        compiled = torch.compile(lambda t: conv(t, relu=True), fullgraph=True)
        # Compiled code calls the custom op, whose launcher may pick another kernel than the eager call (the small-
        # tile kernel at this size: TMA launches cost eager calls CPU time), so not the same bits; both must be as
        # close to a float64 conv as cuDNN's f16 one is (within 2x).
        ref = F.relu(F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1))
        err = lambda y: ((y.double() - ref).norm() / ref.norm()).item()  # noqa: E731
        bound = 2 * err(F.relu(F.conv2d(x, conv.weight, conv.bias, padding=1)))
        assert err(compiled(x)) <= bound and err(eager) <= bound
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            conv(x, relu=True)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = conv(x, relu=True)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, conv(x, relu=True), rtol=0, atol=0)
    assert "blk.conv" in dispatch.dispatch_table(conv)
