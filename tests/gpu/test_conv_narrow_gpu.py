"""The CUDA narrow-output conv (row "cuda_conv_narrow", kernels/cuda_conv_narrow.py, csrc/conv_narrow_sm90.cu) on the
GPU: as the dispatcher's conv2d row against float64 with NaN-poisoned outputs and fresh random inputs per launch
(the same bits when launched again; strips the TMA clips, runs cut at frame and strip ends); its frames launch
bit-equal to the row's output passed through the Triton frames pass, into a poisoned slice; graph replay with
programmatic dependent launch; the refusals; and TAEHV's decode through it (models/taehv/layers.py narrow_frames).

Bound (as test_conv_tiles_gpu): rel err vs float64 <= 2x cuDNN's own f16 error on the same inputs, and the worst
element within error_bounds' bound."""

from __future__ import annotations

import pytest
import torch
from conftest import record_launches
from error_bounds import assert_conv_within

from taesd_fast import dispatch, graphs
from taesd_fast.dispatch import Spec
from taesd_fast.kernels import cuda_conv_narrow

CL = torch.channels_last


def _spec(c_out: int) -> Spec:
    return Spec("conv2d", "cuda:0", (1, 64, 8, 8), (c_out, 64, 3, 3), torch.float16, 1, True, False, False,
                "channels_last", 1, False)


_REASON = ("CUDA is not available" if not torch.cuda.is_available()
           else cuda_conv_narrow.spec_unsupported_reason(_spec(3)))
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"the CUDA narrow-output conv is unavailable: {_REASON}"),
    pytest.mark.usefixtures("no_tf32", "poisoned_outputs"),
]


@pytest.fixture
def launches(monkeypatch):
    """The pixel-shuffle factor of every cuda_conv_narrow launch in the test (the kernel under test really ran)."""
    return record_launches(monkeypatch, cuda_conv_narrow, lambda args: args[1].shape[0] // 64)


def _make(B, H, W, c_out, bias, gen):
    x = torch.randn(B, 64, H, W, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    w = (torch.randn(c_out, 64, 3, 3, generator=gen, device="cuda") / 24).half()
    b = (torch.randn(c_out, generator=gen, device="cuda") * 0.5).half() if bias else None
    return x, w, b


# (B, H, W, C_out, bias): taew2_1's and taew2_2's step (four frames), partial strips, one tiny image, many frames
CASES = [
    (4, 320, 512, 3, True),
    (4, 352, 640, 12, True),
    (3, 37, 50, 3, False),  # one partial strip
    (2, 24, 300, 12, True),  # three strips, the last partial
    (1, 5, 3, 12, True),  # fewer output rows than programs
    (16, 40, 64, 3, True),  # runs cut at frame ends
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:4])))
def test_narrow_conv_matches_float64(case, launches):
    """Three launches on fresh inputs, each within the bound with every element written, and a second launch on the
    same inputs giving the same bits."""
    B, H, W, c_out, bias = case
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + H + W + c_out)
    for _ in range(3):
        x, w, b = _make(B, H, W, c_out, bias, gen)
        y = cuda_conv_narrow.run(x, w, b, 1, None, False, 1)
        assert y.is_contiguous(memory_format=CL)
        assert_conv_within(y, (x, w, b, None, 1, False, 1, False))
        assert torch.equal(y, cuda_conv_narrow.run(x, w, b, 1, None, False, 1))
    assert launches == [cuda_conv_narrow.PATCHES[c_out]] * 6


# (samples, frames a sample, skip, H, W, C_out)
FRAMES = [(1, 4, 0, 320, 512, 3), (1, 4, 3, 352, 640, 12), (2, 3, 1, 37, 211, 12), (2, 5, 2, 9, 129, 3)]


@pytest.mark.parametrize("uint8", [False, True])
@pytest.mark.parametrize("case", FRAMES, ids=lambda c: "x".join(map(str, c)))
def test_frames_equal_the_row_then_the_frames_pass(case, uint8, launches):
    """frames_launch into a slice of a poisoned buffer (uint8: two poisons, so an unwritten element fails one of
    them) equals the plain row's output through kernels/triton_frames.py bit for bit, and leaves the rest alone."""
    from taesd_fast.kernels.triton_frames import write_frames

    samples, k, skip, H, W, c_out = case
    patch = cuda_conv_narrow.PATCHES[c_out]
    dtype = torch.uint8 if uint8 else torch.float16
    for seed in range(2):  # fresh inputs per launch
        gen = torch.Generator(device="cuda").manual_seed(seed * 100 + H + c_out)
        x, w, b = _make(samples * k, H, W, c_out, True, gen)
        b = b + 0.5  # most values inside (0, 1): the clamp hides little
        ref = write_frames(cuda_conv_narrow.run(x, w, b, 1, None, False, 1),
                           torch.empty(samples, k - skip, 3, H * patch, W * patch, device="cuda", dtype=dtype),
                           patch, skip)
        for poison in ((0, 255) if uint8 else (float("nan"),)):
            big = torch.full((samples, k - skip + 2, 3, H * patch, W * patch), poison, device="cuda", dtype=dtype)
            into = big[:, 1:-1]
            assert cuda_conv_narrow.frames_launch(x, w, b, into, skip) is into
            assert torch.equal(into, ref)
            edges = torch.cat([big[:, :1], big[:, -1:]], 1)
            assert bool((edges == poison).all()) if uint8 else bool(edges.isnan().all())


def test_graph_replays_new_inputs(launches):
    """The plain row and a frames launch on its output captured back to back with programmatic dependent launch:
    the replay on new inputs equals the same launches run eagerly."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    x, w, b = _make(4, 40, 64, 3, True, gen)
    h = torch.randn(4, 64, 40, 64, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    into = torch.empty(1, 4, 3, 40, 64, device="cuda", dtype=torch.uint8)

    def run():
        y = cuda_conv_narrow.run(x, w, b, 1, None, False, 1)
        cuda_conv_narrow.frames_launch(h, w, b, into)
        return y

    replay, y = graphs.capture(run)  # the package's capture: two side-stream warm-ups, then the graph
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda").half())
    h.copy_(torch.randn(h.shape, generator=gen, device="cuda").half())
    replay()
    torch.cuda.synchronize()
    frames = into.clone()
    assert torch.equal(y, run())
    assert torch.equal(frames, into)
    assert_conv_within(y, (x, w, b, None, 1, False, 1, False))


@pytest.mark.parametrize("c_in,c_out,stride,relu,limit", [
    (128, 3, 1, False, "128->3 channels"), (64, 4, 1, False, "64->4 channels"),
    (64, 48, 1, False, "64->48 channels"), (64, 3, 2, False, "conv \\+ bias"), (64, 12, 1, True, "conv \\+ bias")])
def test_refuses_what_it_does_not_cover(c_in, c_out, stride, relu, limit, launches):
    x = torch.randn(1, c_in, 16, 16, device="cuda").half().contiguous(memory_format=CL)
    w = torch.randn(c_out, c_in, 3, 3, device="cuda").half()
    with pytest.raises(ValueError, match=limit):
        cuda_conv_narrow.run(x, w, None, stride, None, relu, 1)
    with pytest.raises(ValueError, match="do not hold input"):
        cuda_conv_narrow.frames_launch(torch.randn(2, 64, 8, 8, device="cuda").half(),
                                       torch.randn(3, 64, 3, 3, device="cuda").half(), None,
                                       torch.empty(1, 3, 3, 8, 8, device="cuda", dtype=torch.uint8))
    assert not launches


@pytest.mark.usefixtures("isolated_dispatch")
@pytest.mark.parametrize("variant", ["taew2_1", "taew2_2"])
def test_decode_writes_frames_from_the_narrow_conv(variant, monkeypatch, launches):
    """A TAEHV whose last conv was decided to this row (the choice forced): decode_video and a decode_step stream
    (graph replays) write their frames through frames_launch; the stream equals decode_video within f16 steps, and
    both equal the same model with the fused path off (the last conv, then the frames pass) within one uint8 step."""
    from taesd_fast.apps.bench.taehv import random_decoder
    from taesd_fast.models.taehv import model as taehv_model

    model = random_decoder(variant).cuda().half()
    z = torch.randn(1, 4, model.latent_channels, 12, 20, device="cuda", dtype=torch.float16)
    real_choice = dispatch.conv2d_choice

    def choice(x, w, b, **kw):
        return "cuda_conv_narrow" if w.shape[0] in (3, 12) and w.shape[1] == 64 else real_choice(x, w, b, **kw)

    monkeypatch.setattr(dispatch, "conv2d_choice", choice)
    frame_calls, real_frames = [], cuda_conv_narrow.frames_launch
    monkeypatch.setattr(cuda_conv_narrow, "frames_launch",
                        lambda *a, **k: frame_calls.append(a[3].dtype) or real_frames(*a, **k))

    def run():
        video = model.decode_video(z, uint8=True)
        state, steps = None, []
        for t in range(z.shape[1]):
            frames, state = model.decode_step(z[:, t], state, uint8=True)
            steps.append(frames)
        return video, torch.cat(steps, 1)

    with torch.no_grad(), dispatch.backend("kernels"), dispatch.tuning("off"):
        video, stream = run()
        assert frame_calls and set(frame_calls) == {torch.uint8}, frame_calls
        monkeypatch.setattr(taehv_model, "narrow_frames", lambda *a: False)
        plain_video, plain_stream = run()
    assert video.shape == stream.shape == plain_video.shape
    assert (video.int() - stream.int()).abs().max() <= 1
    assert (video.int() - plain_video.int()).abs().max() <= 1
    assert (stream.int() - plain_stream.int()).abs().max() <= 1


@pytest.mark.usefixtures("isolated_dispatch")
def test_a_frames_launch_first_met_inside_a_capture_is_left_to_the_next_capture(monkeypatch, launches):
    """narrow_frames inside a CUDA-graph capture, where the launch has not run for this weight (its weight unpacked):
    it returns False (the caller runs the conv and the frames pass) and marks the graph to be captured again."""
    from taesd_fast.models.layers import conv3x3
    from taesd_fast.models.taehv import layers

    conv = conv3x3(64, 3).cuda().half()
    x = torch.randn(2, 64, 16, 24, device="cuda").half().contiguous(memory_format=CL)
    into = torch.empty(1, 2, 3, 16, 24, device="cuda", dtype=torch.uint8)
    monkeypatch.setattr(dispatch, "conv2d_choice", lambda *a, **k: "cuda_conv_narrow")
    monkeypatch.setattr(dispatch.decide.state, "deferred", False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        taken = layers.narrow_frames(conv, x, into, 0)
    torch.cuda.current_stream().wait_stream(stream)
    assert not taken and dispatch.decide.state.deferred and not launches
    with torch.no_grad():
        assert layers.narrow_frames(conv, x, into, 0)  # eager: loads, packs and launches
    assert launches == [1]
