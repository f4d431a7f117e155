"""The CUDA tile conv (row "cuda_conv_tiles", kernels/cuda_conv_tiles.py, csrc/conv_tile_sm90.cu) on the GPU: every
build the row's rule can pick (one or two warpgroups, boxes 64, 32, 16 and 8 columns wide, one or two channel chunks
a K step; four chunks too) against float64, with
NaN-poisoned outputs and fresh random inputs per launch, the same bits when launched again, edge tiles that the TMA
clips, graph replay with programmatic dependent launch, and the refusals.

Bound (as test_conv_rows_gpu): rel err vs float64 <= 2x cuDNN's own f16 error on the same inputs, and the worst
element within error_bounds' bound."""

from __future__ import annotations

import pytest
import torch
from error_bounds import assert_conv_within

from taesd_fast.dispatch import Spec
from taesd_fast.kernels import conv_contract, cuda_conv_tiles

CL = torch.channels_last


def _spec(x_shape, c_out) -> Spec:
    return Spec("conv2d", "cuda:0", tuple(x_shape), (c_out, x_shape[1], 3, 3), torch.float16, 1, True, True, True,
                "channels_last", 1, False)


_REASON = ("CUDA is not available" if not torch.cuda.is_available()
           else cuda_conv_tiles.spec_unsupported_reason(_spec((1, 128, 8, 64), 128)))
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"the CUDA tile conv is unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32"),
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(conv_contract, "POISON_OUTPUT", True)


@pytest.fixture
def launches(monkeypatch):
    """The configs of every cuda_conv_tiles launch in the test (the kernel under test really ran)."""
    calls = []
    real = cuda_conv_tiles.launch

    def counting(*a, **k):
        calls.append(a[-1])
        return real(*a, **k)

    monkeypatch.setattr(cuda_conv_tiles, "launch", counting)
    return calls


def _make(B, c_in, c_out, H, W, bias, residual, gen):
    x = torch.randn(B, c_in, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w = (torch.randn(c_out, c_in, 3, 3, generator=gen, device="cuda") / (3 * c_in ** 0.5)).half()
    b = (torch.randn(c_out, generator=gen, device="cuda") * 0.5).half() if bias else None
    r = torch.randn(B, c_out, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL) if residual else None
    return x, w, b, r


# (B, C_in, C_out, H, W, bias, residual, relu, warpgroups): the step's shapes, decode chunks, and edges
CASES = [
    (1, 256, 256, 40, 64, True, True, True, 1),  # taew2_1's 256-channel stage at 320x512: 64-column boxes
    (1, 128, 128, 80, 128, True, True, True, 2),  # its 128-channel stage: more than a wave, two warpgroups
    (1, 256, 256, 44, 80, True, False, True, 1),  # taew2_2's at 704x1280: 16-column boxes of 4 rows
    (1, 128, 128, 88, 160, False, True, False, 2),  # 32-column boxes of 2 rows
    (8, 256, 256, 40, 64, True, True, True, 2),  # a decode chunk
    (3, 256, 128, 37, 50, True, True, False, 1),  # 8-column boxes; tiles past the bottom and right edges
    (2, 192, 256, 9, 20, False, False, True, 1),  # three channel chunks; most of each box outside the image
    (1, 64, 128, 5, 3, True, False, False, 2),  # one chunk; an image narrower than a box
    (2, 256, 128, 13, 24, False, True, True, 2),  # the second warpgroup's rows past the image
]


def _builds(case):
    """(case, stages, nc): each case with one channel chunk per K step, and with two and four where C_in allows (as
    many stages as fit the shared memory)."""
    c_in, wg = case[1], case[-1]
    yield case, 4, 1
    if c_in % 128 == 0:
        yield case, 4 if wg == 1 else 3, 2
    if c_in % 256 == 0 and wg == 1:
        yield case, 2, 4


@pytest.mark.parametrize("case,stages,nc", [b for case in CASES for b in _builds(case)])
def test_tile_conv_matches_float64(case, stages, nc, launches):
    """The build for each case, three launches on fresh inputs, each within the bound with every element written,
    and a second launch on the same inputs giving the same bits."""
    B, c_in, c_out, H, W, bias, residual, relu, wg = case
    cfg = cuda_conv_tiles.TileConfig(wg, stages, cuda_conv_tiles.box_width(W), nc)
    assert cfg.smem <= 227 * 1024
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + c_in + H + W)
    for _ in range(3):
        x, w, b, r = _make(B, c_in, c_out, H, W, bias, residual, gen)
        y = cuda_conv_tiles.launch_conv(x, w, b, r, 1, relu, cfg=cfg)
        assert_conv_within(y, (x, w, b, r, 1, relu, 1, False))
        assert torch.equal(y, cuda_conv_tiles.launch_conv(x, w, b, r, 1, relu, cfg=cfg))
    assert launches == [cfg] * 6


@pytest.mark.parametrize("W,bw", [(64, 64), (128, 64), (80, 16), (160, 32), (50, 8), (96, 32)])
def test_box_width_pads_rows_least(W, bw):
    assert cuda_conv_tiles.box_width(W) == bw


def test_the_rule_picks_one_warpgroup_within_a_wave(launches):
    """The row's run takes tile_config's build: one warpgroup where the programs fit the SMs, two past that."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(5)
    for B, H, W in ((1, 40, 64), (2, 80, 128)):
        x, w, b, r = _make(B, 256, 128, H, W, True, True, gen)
        y = cuda_conv_tiles.run(x, w, b, 1, r, True)
        assert_conv_within(y, (x, w, b, r, 1, True, 1, False))
    assert [c.wg for c in launches] == [1 if B * H * W // 64 <= sms else 2 for B, H, W in ((1, 40, 64), (2, 80, 128))]


def test_graph_replays_new_inputs(launches):
    """Two convs captured back to back with programmatic dependent launch (the second reads the first one's
    output): the replay on new inputs equals the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b, r = _make(1, 256, 256, 40, 64, True, True, gen)
    w2 = (torch.randn(256, 256, 3, 3, generator=gen, device="cuda") / 48).half()
    run = lambda: cuda_conv_tiles.run(cuda_conv_tiles.run(x, w, b, 1, None, True), w2, b, 1, r, True)  # noqa: E731
    run()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run()
        with torch.cuda.graph(graph, stream=stream):
            y = run()
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, run())
    assert_conv_within(y, (cuda_conv_tiles.run(x, w, b, 1, None, True), w2, b, r, 1, True, 1, False))


@pytest.mark.parametrize("c_in,c_out,stride,upsample,limit", [
    (64, 64, 1, 1, "64->64 channels"), (96, 128, 1, 1, "96->128 channels"),
    (128, 128, 2, 1, "plain stride-1"), (128, 128, 1, 2, "plain stride-1")])
def test_refuses_what_it_does_not_cover(c_in, c_out, stride, upsample, limit, launches):
    gen = torch.Generator(device="cuda").manual_seed(c_in)
    x, w, b, _ = _make(1, c_in, c_out, 16, 16, True, False, gen)
    with pytest.raises(ValueError, match=limit):
        cuda_conv_tiles.run(x, w, b, stride, None, True, upsample)
    assert not launches
