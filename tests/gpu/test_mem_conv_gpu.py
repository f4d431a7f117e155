"""The memory-block conv rows ("triton_mem_conv", and "cuda_mem_conv" at 64 channels) on the GPU at TAEHV's shapes:
every launch on fresh random inputs with a NaN-poisoned output, against a float64 reference, within 2x of cuDNN's
fp16 error on the concatenation it replaces (worst element and relative). Several launches per shape: the TMA convs'
wrong-element bug of an earlier Triton config showed in some launches only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast._backend import kernels_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(kernels_unavailable_reason() is not None, reason=f"kernels: {kernels_unavailable_reason()}"),
    pytest.mark.usefixtures("isolated_dispatch"),
]

CL = torch.channels_last
# (samples, frames per sample, C, C_out, H, W, memory): the decoder's three stages, a streaming step, edges
SHAPES = [
    (1, 8, 64, 64, 176, 320, True),
    (1, 12, 128, 128, 88, 160, True),
    (1, 6, 256, 256, 44, 80, False),
    (1, 1, 64, 64, 176, 320, True),
    (2, 3, 64, 64, 33, 47, True),
    # one-frame steps whose grids fall short of the SMs (64-wide channel blocks; 8 x 8 tiles at 256 channels)
    (1, 1, 256, 256, 44, 80, True),
    (1, 1, 128, 128, 88, 160, True),
    (1, 1, 256, 256, 40, 64, True),
    (1, 1, 128, 128, 80, 128, True),
]


# cuda_mem_conv: 64 channels, W > 64 (the taew2_1 / taew2_2 step's last stage, decode_video's, odd sizes, no memory)
CUDA_SHAPES = [
    (1, 8, 64, 64, 176, 320, True),
    (1, 2, 64, 64, 160, 256, True),
    (1, 2, 64, 64, 176, 320, True),
    (1, 1, 64, 64, 176, 320, True),
    (1, 4, 64, 64, 40, 72, False),
    (2, 3, 64, 64, 33, 130, True),
    (3, 2, 64, 64, 17, 200, False),
]
CASES = [("triton_mem_conv", s) for s in SHAPES] + [("cuda_mem_conv", s) for s in CUDA_SHAPES]


def _past_cat(x, memory, frames):
    n, c, h, w = x.shape
    seq = x.reshape(n // frames, frames, c, h, w)
    first = torch.zeros_like(seq[:, :1]) if memory is None else memory.unsqueeze(1)
    return torch.cat([x, torch.cat([first, seq[:, :-1]], 1).reshape(n, c, h, w)], 1)


def _rel(a, ref) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("name,shape", CASES,
                         ids=lambda c: c if isinstance(c, str) else "x".join(map(str, c[:6])) + ("_mem" if c[6] else ""))
def test_mem_conv_within_2x_of_cudnn_fp16(name, shape, no_tf32, monkeypatch):
    import importlib

    from taesd_fast.kernels import conv_contract

    module = importlib.import_module(f"taesd_fast.kernels.{name}")
    samples, frames, c, c_out, h, w, has_memory = shape
    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)
    gen = torch.Generator(device="cuda").manual_seed(c * frames + w)
    for launch in range(12 if frames == 1 else 4):  # one frame: cheap, so more launches
        x = torch.randn(samples * frames, c, h, w, device="cuda", generator=gen).relu().half()
        x = x.contiguous(memory_format=CL)
        memory = torch.randn(samples, c, h, w, device="cuda", generator=gen).relu().half() if has_memory else None
        weight = (torch.randn(c_out, 2 * c, 3, 3, device="cuda", generator=gen) / (9 * c) ** 0.5).half()
        bias = (0.1 * torch.randn(c_out, device="cuda", generator=gen)).half()
        cat = _past_cat(x, memory, frames)
        expected = F.conv2d(cat.double(), weight.double(), bias.double(), padding=1).relu()
        cudnn = F.conv2d(cat, weight, bias, padding=1).relu()
        got = module.mem_conv_launch(x, memory, weight, bias, frames, True)
        assert got.shape == expected.shape and got.is_contiguous(memory_format=CL)
        assert not got.isnan().any(), (launch, "elements never written")
        worst, cudnn_worst = ((t.double() - expected).abs().max().item() for t in (got, cudnn))
        if launch == 0:
            print(f"\n{name} {shape}: worst {worst:.3g}, cuDNN fp16 {cudnn_worst:.3g}; rel {_rel(got, expected):.3g}, "
                  f"cuDNN {_rel(cudnn, expected):.3g}")
        assert worst <= 2 * cudnn_worst and _rel(got, expected) <= 2 * _rel(cudnn, expected), (launch, worst)
        again = module.mem_conv_launch(x, memory, weight, bias, frames, True)
        assert torch.equal(again, got), (launch, "a relaunch on the same inputs changed bits")


def test_cuda_mem_conv_weight_halves_follow_an_in_place_update():
    """The packed halves are cached per weight; an in-place update (load_state_dict) must repack them."""
    from taesd_fast.kernels import cuda_mem_conv

    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2, 64, 24, 136, device="cuda", generator=gen).half().contiguous(memory_format=CL)
    memory = torch.randn(1, 64, 24, 136, device="cuda", generator=gen).half().contiguous(memory_format=CL)
    weight = (torch.randn(64, 128, 3, 3, device="cuda", generator=gen) / 24).half()
    first = cuda_mem_conv.mem_conv_launch(x, memory, weight, None, 2, False)
    with torch.no_grad():
        weight.mul_(-1)
    second = cuda_mem_conv.mem_conv_launch(x, memory, weight, None, 2, False)
    torch.testing.assert_close(second, -first, rtol=0, atol=0)


def test_dispatched_mem_conv_runs_the_kernel_where_forced(monkeypatch):
    """backend("kernels") takes the row for a memory block's shape, and its output is the PyTorch row's within fp16
    rounding (the row's own accuracy is the test above)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(6, 64, 40, 72, device="cuda", generator=gen).half().contiguous(memory_format=CL)
    memory = torch.randn(2, 64, 40, 72, device="cuda", generator=gen).half().contiguous(memory_format=CL)
    weight = (torch.randn(64, 128, 3, 3, device="cuda", generator=gen) / 34).half()
    with dispatch.backend("torch"):
        expected = dispatch.mem_conv(x, memory, weight, None, frames=3, relu=True)
    with dispatch.backend("kernels"):
        got = dispatch.mem_conv(x, memory, weight, None, frames=3, relu=True)
        got = dispatch.mem_conv(x, memory, weight, None, frames=3, relu=True)
    records = [r for (mode, _, key), r in dispatch.decide.state.decided.items() if key[0] == "mem_conv"]
    assert records and all(r.choice == "triton_mem_conv" for r in records), [r.choice for r in records]
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
