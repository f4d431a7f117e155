"""The fused conv pair (kernels/conv_tail.py): a 64->64 conv with its epilogue and the small 3x3 conv after it, as
the row-streaming kernel with a tail plus the taps' sum kernel.

Bound: rel err vs float64 of the two convs <= 2x that of PyTorch f16 running them one by one; NaN-poisoned outputs
(P and the result) and fresh random inputs; every case asserts the fused kernels ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from taesd_fast import TAESD, dispatch
from taesd_fast.kernels import conv_halo, conv_tail
from taesd_fast.kernels import conv_tc as tc

CL = torch.channels_last

_REASON = "CUDA is not available" if not torch.cuda.is_available() else conv_tail.unsupported_reason(
    (1, 64, 8, 64), (64, 64, 3, 3), (3, 64, 3, 3), torch.float16, "cuda", True)
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"fused conv pair unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32"),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(tc, "POISON_OUTPUT", True)


@pytest.fixture
def tail_launches(monkeypatch):
    calls = []
    real = conv_halo.launch

    def counting(*a, **k):
        if k.get("tail") is not None:
            calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(conv_halo, "launch", counting)
    return calls


def _make(B, H, W, c2, bias, residual, bias2, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).half()  # noqa: E731
    x = rnd(B, 64, H, W).contiguous(memory_format=CL)
    w = rnd(64, 64, 3, 3, scale=1 / 24)
    b = rnd(64, scale=0.5) if bias else None
    r = rnd(B, 64, H, W).contiguous(memory_format=CL) if residual else None
    w2 = rnd(c2, 64, 3, 3, scale=1 / 24)
    b2 = rnd(c2, scale=0.5) if bias2 else None
    return x, w, b, r, w2, b2


def _two_convs(x, w, b, r, relu, w2, b2, dtype):
    h = tc.conv3x3_math(x, w, b, r, 1, relu, dtype=dtype)
    if dtype == torch.float16:
        h = h.half()
    return tc.conv3x3_math(h, w2, b2, None, 1, False, dtype=dtype)


def _check(y, args):
    ref = _two_convs(*args, dtype=torch.float64)
    torch_y = _two_convs(*args, dtype=torch.float16)
    assert not y.isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = ((y.double() - ref).norm() / ref.norm()).item()
    torch_err = ((torch_y.double() - ref).norm() / ref.norm()).item()
    assert err <= 2 * torch_err + 1e-7, f"rel err {err:.3g} > 2 x PyTorch f16 error {torch_err:.3g}"


@pytest.mark.parametrize("bias,residual,relu", list(itertools.product([False, True], repeat=3)))
def test_epilogues(bias, residual, relu, tail_launches):
    x, w, b, r, w2, b2 = _make(2, 21, 150, 3, bias, residual, True, seed=int(bias) + 2 * residual + 4 * relu)
    y = conv_tail.launch(x, w, b, r, relu, w2, b2)
    assert tail_launches
    _check(y, (x, w, b, r, relu, w2, b2))


@pytest.mark.parametrize("B,H,W,c2,bias2", [(1, 256, 256, 3, True), (1, 1, 64, 3, True), (3, 37, 77, 1, False),
                                            (2, 9, 200, 2, True), (1, 130, 70, 3, False), (4, 64, 64, 3, True)])
def test_shapes(B, H, W, c2, bias2, tail_launches):
    """The decoder's shape, one row, partial strips (W = 70, 77, 200), several programs per column, fewer output
    channels, no second bias."""
    x, w, b, r, w2, b2 = _make(B, H, W, c2, True, True, bias2, seed=B * 1000 + H + W)
    y = conv_tail.launch(x, w, b, r, True, w2, b2)
    assert tail_launches and y.shape == (B, c2, H, W) and y.is_contiguous(memory_format=CL)
    _check(y, (x, w, b, r, True, w2, b2))


def test_op_contract():
    x, w, b, r, w2, b2 = _make(1, 8, 64, 3, True, True, True, seed=5)
    torch.library.opcheck(torch.ops.taesd_fast.conv3x3_tail.default, (x, w, b, r, True, w2, b2))


def test_graph_replays_new_inputs(tail_launches):
    x, w, b, r, w2, b2 = _make(1, 64, 128, 3, True, True, True, seed=6)
    conv_tail.launch(x, w, b, r, True, w2, b2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = conv_tail.launch(x, w, b, r, True, w2, b2)
    x.copy_(torch.randn(x.shape, device="cuda").half())
    graph.replay()
    _check(y, (x, w, b, r, True, w2, b2))


def test_decoder_takes_the_pair_and_keeps_fidelity(tail_launches, isolated_dispatch):
    """TAESD decode with the kernels forced: the last Block and the output conv run as the fused pair, and the image
    stays within 2x PyTorch f16's error of an fp32 decode."""
    torch.manual_seed(7)
    model = TAESD("taesd").cuda().eval()
    z = torch.randn(1, 4, 32, 32, device="cuda")
    with torch.no_grad():
        ref = model.decoder(z.double().float())  # fp32 model, PyTorch
        half = model.half()
        with dispatch.backend("torch"):
            torch_y = half.decoder(z.half())
        with dispatch.backend("kernels"):
            y = half.decoder(z.half().contiguous(memory_format=CL))
    assert tail_launches == [torch.Size([1, 64, 256, 256])]
    err = ((y.float() - ref).norm() / ref.norm()).item()
    torch_err = ((torch_y.float() - ref).norm() / ref.norm()).item()
    assert err <= 2 * torch_err, f"decode rel err {err:.3g} > 2 x PyTorch f16's {torch_err:.3g}"
