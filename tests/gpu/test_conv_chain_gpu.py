"""The persistent Block-chain kernel (kernels/conv_chain.py) on a GPU: real grids meeting at the grid barrier.

Bound: rel err vs a float64 model <= 2x PyTorch's own f16 error (cuDNN convs, + skip and ReLU as f16 ops) on the same
inputs; outputs and scratch are NaN-poisoned before every launch; inputs are fresh random normals. A barrier that
opened early would let a program read a neighbour's rows before they were written: the NaN scratch and repeated
runs (bitwise equal) catch that.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast.kernels import conv_chain as cc
from taesd_fast.layers import Block, ReLUSequential, name_layers

CL = torch.channels_last

_REASON = "CUDA is not available" if not torch.cuda.is_available() else cc.unsupported_reason(
    (1, 64, 8, 8), torch.float16, 1, "cuda")
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=f"chain kernel unavailable: {_REASON}"),
              pytest.mark.usefixtures("no_tf32")]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(cc, "POISON_OUTPUT", True)


def _make(B, H, W, n_blocks, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, 64, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    ws = [(torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half() for _ in range(3 * n_blocks)]
    bs = [(torch.randn(64, generator=gen, device="cuda") * 0.2).half() for _ in range(3 * n_blocks)]
    return x, ws, bs


def _model(x, ws, bs, dtype):
    h = x.to(dtype)
    for i in range(0, len(ws), 3):
        t = F.conv2d(h, ws[i].to(dtype), bs[i].to(dtype), padding=1).relu()
        t = F.conv2d(t, ws[i + 1].to(dtype), bs[i + 1].to(dtype), padding=1).relu()
        h = (F.conv2d(t, ws[i + 2].to(dtype), bs[i + 2].to(dtype), padding=1) + h).relu()
    return h


def _check(y, x, ws, bs):
    ref = _model(x, ws, bs, torch.float64)
    rel = lambda a: ((a.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert y.is_contiguous(memory_format=CL)
    assert not y.isnan().any(), "unwritten (NaN-poisoned) elements, or a barrier that opened early"
    torch_err = rel(_model(x, ws, bs, torch.float16))
    assert rel(y) <= 2 * torch_err, f"rel err {rel(y):.3g} > 2 x PyTorch f16 error {torch_err:.3g}"


# B, H, W, n_blocks: TAESD's B=1 levels, odd sizes, a batch, a last tile partly outside the image
SHAPES = [(1, 32, 32, 3), (1, 64, 64, 3), (1, 128, 128, 3), (2, 17, 23, 2), (1, 7, 5, 1), (4, 32, 32, 3),
          (1, 256, 256, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chain_matches_the_blocks(shape):
    B, H, W, n = shape
    x, ws, bs = _make(B, H, W, n, seed=B * 1000 + H + n)
    _check(torch.ops.taesd_fast.block_chain(x, ws, bs), x, ws, bs)


@pytest.mark.parametrize("block_m,per_sm", [(64, 1), (128, 1), (64, 3), (32, 2)])
def test_launch_configs(block_m, per_sm):
    """Fewer programs than tiles (each loops over several), and more programs per SM."""
    x, ws, bs = _make(1, 128, 128, 3, seed=block_m + per_sm)
    _check(cc.launch(x, ws, bs, block_m=block_m, per_sm=per_sm), x, ws, bs)


def test_repeated_runs_are_bitwise_equal():
    x, ws, bs = _make(1, 128, 128, 3, seed=7)
    first = cc.launch(x, ws, bs)
    for _ in range(20):
        assert torch.equal(cc.launch(x, ws, bs), first)


def test_cuda_graph_replay_equals_eager():
    x, ws, bs = _make(1, 64, 64, 3, seed=11)
    eager = torch.ops.taesd_fast.block_chain(x, ws, bs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.taesd_fast.block_chain(x, ws, bs)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


def test_opcheck_gpu():
    x, ws, bs = _make(1, 16, 12, 2, seed=5)
    torch.library.opcheck(torch.ops.taesd_fast.block_chain.default, (x, ws, bs))


def test_dispatch_runs_the_chain_for_a_run_of_blocks():
    torch.manual_seed(0)
    seq = ReLUSequential(*(Block(64, 64) for _ in range(3))).cuda().half().eval().requires_grad_(False)
    name_layers(seq)
    x = torch.randn(1, 64, 32, 32, device="cuda").half().contiguous(memory_format=CL)
    with dispatch.backend("kernels"):
        y = seq(x)
    assert "chain" in dispatch.dispatch_table(seq)
    ws = [c.weight for blk in seq for c in (blk.conv[0], blk.conv[2], blk.conv[4])]
    bs = [c.bias for blk in seq for c in (blk.conv[0], blk.conv[2], blk.conv[4])]
    _check(y, x, ws, bs)
