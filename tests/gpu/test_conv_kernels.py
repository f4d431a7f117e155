"""taesd_fast::conv3x3_f16 on the GPU: every variant vs a float64 reference, with the error bound set by
PyTorch's own f16 error on the same inputs; poisoned outputs; odd shapes; channel limits; strides;
non-contiguous inputs; opcheck; torch.compile(fullgraph=True); CUDA-graph capture and replay.

Poisoning: the op has a test-only switch (simt_conv.POISON_OUTPUT) that NaN-fills its freshly allocated
output on the same stream right before the launch, so any element the kernel fails to write is NaN
and fails the error check. Inputs are fresh random normals for every case (never zeros).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_worst_element_within

from taesd_fast._backend import kernels_unavailable_reason
from taesd_fast.kernels import simt_conv

_REASON = kernels_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"taesd_fast kernels unavailable: {_REASON}")

OP = torch.ops.taesd_fast.conv3x3_f16


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(simt_conv, "POISON_OUTPUT", True)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a = a.double()
    return ((a - ref).norm() / ref.norm()).item()


def _make(B, cin, cout, H, W, stride, bias, residual, gen, noncontig=False):
    dev = "cuda"
    Ho, Wo = (H - 1) // stride + 1, (W - 1) // stride + 1
    if noncontig:  # a strided view (every other column of a wider tensor) and a channels_last weight
        x = torch.randn(B, cin, H, 2 * W, generator=gen, device=dev).half()[..., ::2]
        w = (torch.randn(cout, cin, 3, 3, generator=gen, device=dev) / (3 * cin**0.5)).half()
        w = w.to(memory_format=torch.channels_last)
    else:
        x = torch.randn(B, cin, H, W, generator=gen, device=dev).half()
        w = (torch.randn(cout, cin, 3, 3, generator=gen, device=dev) / (3 * cin**0.5)).half()
    b = torch.randn(cout, generator=gen, device=dev).half() * 0.5 if bias else None
    r = torch.randn(B, cout, Ho, Wo, generator=gen, device=dev).half() if residual else None
    if residual and noncontig:
        r = r.transpose(2, 3).contiguous().transpose(2, 3)
    return x, w, b, r


def _reference(x, w, b, r, stride, relu):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride=stride, padding=1)
    if r is not None:
        y = y + r.double()
    return torch.relu(y) if relu else y


def _torch_f16(x, w, b, r, stride, relu):
    y = F.conv2d(x, w, b, stride=stride, padding=1)
    if r is not None:
        y = y + r
    return torch.relu(y) if relu else y


def _check(variant, B, cin, cout, H, W, stride, bias, residual, relu, seed, noncontig=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, w, b, r = _make(B, cin, cout, H, W, stride, bias, residual, gen, noncontig)
    y = OP(x, w, b, r, stride, relu, variant)
    ref = _reference(x, w, b, r, stride, relu)
    assert y.shape == ref.shape and y.dtype == torch.float16
    assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
    low = _torch_f16(x, w, b, r, stride, relu)
    err, torch_err = _rel(y, ref), _rel(low, ref)
    assert err <= 2 * torch_err + 1e-7, f"{variant}: rel err {err:.3g} > 2 x PyTorch f16 error {torch_err:.3g}"
    assert_worst_element_within(y, low, ref, f"{variant}: ")
    return err, torch_err


# Fixed edge cases: channel limits (1, 3, 64), TAESD's channel counts, odd sizes below/above the tiles.
EDGE = [
    # B, cin, cout, H, W
    (1, 64, 64, 33, 47),
    (2, 3, 64, 17, 29),
    (2, 64, 3, 31, 15),
    (3, 1, 1, 5, 7),
    (1, 64, 64, 1, 1),
    (1, 1, 64, 2, 3),
    (4, 64, 1, 16, 16),
    (2, 32, 64, 19, 21),
    (1, 64, 32, 35, 9),
    (2, 4, 64, 23, 37),
    (1, 64, 16, 40, 24),
    (1, 16, 64, 9, 70),
]


# The register-blocked variant is stride 1 only (unsupported_reason refuses stride 2; test_op_validation covers it).
VARIANT_STRIDES = [(v, s) for v in simt_conv.VARIANTS for s in (1, 2) if not (v == "rb" and s == 2)]


@pytest.mark.parametrize("variant,stride", VARIANT_STRIDES)
@pytest.mark.parametrize("case", EDGE, ids=lambda c: "x".join(map(str, c)))
def test_edge_shapes(variant, stride, case):
    B, cin, cout, H, W = case
    seed = zlib.crc32(repr((variant, stride, case)).encode())
    flags = random.Random(seed).choice([(True, True, True), (True, False, True), (False, True, False), (True, False, False)])
    _check(variant, B, cin, cout, H, W, stride, *flags, seed=seed)


@pytest.mark.parametrize("variant", simt_conv.VARIANTS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes(variant, seed):
    rng = random.Random(1000 + seed)
    stride = 1 if variant == "rb" else rng.choice([1, 2])
    cin, cout = rng.choice([1, 3, 4, 16, 32, 64]), rng.choice([1, 3, 4, 16, 32, 64])
    B, H, W = rng.randint(1, 4), rng.randint(1, 80), rng.randint(1, 80)
    flags = (rng.random() < 0.7, rng.random() < 0.5, rng.random() < 0.7)
    _check(variant, B, cin, cout, H, W, stride, *flags, seed=seed, noncontig=rng.random() < 0.5)


@pytest.mark.parametrize("variant", simt_conv.VARIANTS)
def test_non_contiguous_inputs(variant):
    _check(variant, 2, 64, 64, 29, 31, 1, True, True, True, seed=7, noncontig=True)


def test_large_batch_grid_stride():
    """More images than one grid.z pass for ocb4 (B * groups > 65535) exercises the z loop."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x, w, b, r = _make(8200, 4, 64, 3, 3, 1, True, False, gen)  # ocb4: 8 groups of 8 channels -> 65600 z
    y = OP(x, w, b, None, 1, True, "ocb4")
    ref = _reference(x, w, b, None, 1, True)
    assert not y.isnan().any()
    assert _rel(y, ref) <= 2 * _rel(_torch_f16(x, w, b, None, 1, True), ref)


def test_error_summary(capsys):
    """Prints the kernel vs PyTorch f16 errors on a TAESD-like 64->64 layer (for the log)."""
    lines = []
    for variant in simt_conv.VARIANTS:
        for stride in (1, 2) if variant != "rb" else (1,):
            e, t = _check(variant, 2, 64, 64, 64, 64, stride, True, True, True, seed=11)
            lines.append(f"{variant} s{stride}: kernel {e:.3e}  torch-f16 {t:.3e}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.parametrize("variant", simt_conv.VARIANTS)
def test_opcheck(variant):
    gen = torch.Generator(device="cuda").manual_seed(5)
    stride = 1 if variant == "rb" else 2
    x, w, b, r = _make(2, 16, 32, 13, 11, stride, True, True, gen)
    torch.library.opcheck(OP.default, (x, w, b, r, stride, True, variant))
    torch.library.opcheck(OP.default, (x, w, None, None, stride, False, variant))


def test_compile_fullgraph():
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, r = _make(2, 64, 64, 24, 40, 1, True, True, gen)

    def f(x, r):
        h = OP(x, w, b, None, 1, True, "rb")
        h = OP(h, w, b, r, 1, True, "tile")
        return OP(h, w, None, None, 2, False, "ocb4")

    eager = f(x, r)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x, r), eager, rtol=0, atol=0)
    x2, _, _, r2 = _make(2, 64, 64, 24, 40, 1, True, True, gen)
    torch.testing.assert_close(compiled(x2, r2), f(x2, r2), rtol=0, atol=0)


@pytest.mark.parametrize("variant", simt_conv.VARIANTS)
def test_cuda_graph_capture_replay(variant):
    gen = torch.Generator(device="cuda").manual_seed(13)
    x, w, b, r = _make(2, 32, 64, 21, 27, 1, True, True, gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles and loads the kernel outside capture
        OP(x, w, b, r, 1, True, variant)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = OP(x, w, b, r, 1, True, variant)
    for _ in range(2):  # replay with new inputs copied into the captured buffers
        x2, _, _, r2 = _make(2, 32, 64, 21, 27, 1, True, True, gen)
        x.copy_(x2)
        r.copy_(r2)
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(x, w, b, r, 1, True)
        assert _rel(y, ref) <= 2 * _rel(_torch_f16(x, w, b, r, 1, True), ref)


def test_other_stream_and_device_guard():
    """Launches go to the current stream: results on a side stream match after a join."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    x, w, b, _ = _make(1, 64, 64, 48, 48, 1, True, False, gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = OP(x, w, b, None, 1, True, "rb")
    torch.cuda.current_stream().wait_stream(s)
    ref = _reference(x, w, b, None, 1, True)
    assert _rel(y, ref) <= 2 * _rel(_torch_f16(x, w, b, None, 1, True), ref)
