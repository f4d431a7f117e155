"""The CUDA upsample conv (row "cuda_conv_up", kernels/cuda_conv_up.py, csrc/conv_up_sm90.cu) on the GPU, as the
dispatcher's conv2d row (one weight group; its TGrow launch is in test_grow_fold_gpu): against float64 with
NaN-poisoned outputs and fresh random inputs per launch, the same bits when launched again, tiles that the TMA
clips, more tiles than programs and fewer, graph replay with programmatic dependent launch, and the refusals.

Bound (as test_conv_tiles_gpu): rel err vs float64 <= 2x cuDNN's own f16 error on the same inputs, and the worst
element within error_bounds' bound."""

from __future__ import annotations

import pytest
import torch
from conftest import record_launches
from error_bounds import assert_conv_within

from taesd_fast import graphs
from taesd_fast.dispatch import Spec
from taesd_fast.kernels import cuda_conv_up

CL = torch.channels_last


def _spec(x_shape) -> Spec:
    return Spec("conv2d", "cuda:0", tuple(x_shape), (64, 64, 3, 3), torch.float16, 1, True, False, True,
                "channels_last", 2, False)


_REASON = ("CUDA is not available" if not torch.cuda.is_available()
           else cuda_conv_up.spec_unsupported_reason(_spec((1, 64, 8, 8))))
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"the CUDA upsample conv is unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32", "poisoned_outputs"),
]


@pytest.fixture
def launches(monkeypatch):
    """The weight-group count of every cuda_conv_up launch in the test (the kernel under test really ran)."""
    return record_launches(monkeypatch, cuda_conv_up, lambda args: args[2])


def _make(B, H, W, bias, gen):
    x = torch.randn(B, 64, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b = (torch.randn(64, generator=gen, device="cuda") * 0.5).half() if bias else None
    return x, w, b


# (B, H, W, bias, relu): taew2_1's and taew2_2's full-resolution up conv (four frames), edges, one small image
CASES = [
    (4, 160, 256, True, True),
    (4, 176, 320, True, True),
    (3, 37, 50, False, False),  # partial tiles at the bottom and right
    (1, 5, 3, True, False),  # one tile, most of it outside the image; fewer tiles than programs
    (16, 44, 80, True, True),  # a decode chunk at latent x 2: many tiles per program
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:3])))
def test_upsample_conv_matches_float64(case, launches):
    """Three launches on fresh inputs, each within the bound with every element written, and a second launch on the
    same inputs giving the same bits."""
    B, H, W, bias, relu = case
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + H + W)
    for _ in range(3):
        x, w, b = _make(B, H, W, bias, gen)
        y = cuda_conv_up.run(x, w, b, 1, None, relu, 2)
        assert y.is_contiguous(memory_format=CL)
        assert_conv_within(y, (x, w, b, None, 1, relu, 2, False))
        assert torch.equal(y, cuda_conv_up.run(x, w, b, 1, None, relu, 2))
    assert launches == [1] * 6


def test_graph_replays_new_inputs(launches):
    """Two launches captured back to back with programmatic dependent launch (the second upsamples the first one's
    output): the replay on new inputs equals the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b = _make(2, 40, 64, True, gen)
    w2 = (torch.randn(64, 64, 3, 3, generator=gen, device="cuda") / 24).half()

    def run():
        y = cuda_conv_up.run(x, w, b, 1, None, True, 2)
        return cuda_conv_up.run(y, w2, b, 1, None, False, 2)

    replay, y = graphs.capture(run)  # the package's capture: two side-stream warm-ups, then the graph
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    replay()
    torch.cuda.synchronize()
    assert torch.equal(y, run())
    assert_conv_within(y, (cuda_conv_up.run(x, w, b, 1, None, True, 2), w2, b, None, 1, False, 2, False))


@pytest.mark.parametrize("c_in,c_out,upsample,residual,limit", [
    (128, 64, 2, False, "128->64 channels"), (64, 128, 2, False, "64->128 channels"),
    (64, 64, 1, False, "up 2 \\+ conv"), (64, 64, 2, True, "up 2 \\+ conv")])
def test_refuses_what_it_does_not_cover(c_in, c_out, upsample, residual, limit, launches):
    x = torch.randn(1, c_in, 16, 16, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(c_out, c_in, 3, 3, device="cuda").half()
    r = torch.randn(1, c_out, 32, 32, device="cuda").half().contiguous(memory_format=CL) if residual else None
    with pytest.raises(ValueError, match=limit):
        cuda_conv_up.run(x, w, None, 1, r, True, upsample)
    assert not launches
