"""TAEHV's output-frames pass (kernels/triton_frames.py) on the GPU: bit-equal to PyTorch's pixel shuffle + clamp
(+ uint8) at the decoders' real output shapes, into a slice of a poisoned buffer; and the model's decode through it
equals the model's decode through the PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from taesd_fast import dispatch
from taesd_fast.kernels.triton_import import triton_unavailable_reason

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and triton_unavailable_reason("cuda") is not None,
                       reason=f"triton: {triton_unavailable_reason('cuda')}"),
    pytest.mark.usefixtures("isolated_dispatch"),
]

# (patch, dtype, samples, frames per sample, skip, h, w): taew2_2's step and a 121-frame chunk, taew2_1, odd sizes
SHAPES = [
    (2, torch.float16, 1, 4, 3, 352, 640),
    (2, torch.float16, 1, 24, 0, 352, 640),
    (1, torch.float16, 1, 4, 0, 320, 512),
    (2, torch.bfloat16, 2, 3, 1, 37, 211),
    (1, torch.float32, 2, 5, 2, 9, 129),
]


def _reference(y, patch, uint8, samples, skip):
    frames = F.pixel_shuffle(y, patch).clamp(0, 1)
    if uint8:
        frames = frames.mul(255).round().to(torch.uint8)
    return frames.view(samples, -1, *frames.shape[1:])[:, skip:]


@pytest.mark.parametrize("uint8", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[2:])) + f"_p{s[0]}_{str(s[1])[6:]}")
def test_frames_bit_equal_to_pytorch(shape, uint8):
    from taesd_fast.kernels.triton_frames import write_frames

    patch, dtype, samples, frames, skip, h, w = shape
    for seed in range(2):  # fresh inputs per launch
        gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + h)
        y = (torch.randn(samples * frames, 3 * patch * patch, h, w, device="cuda", generator=gen) * 0.6 + 0.5)
        y = y.to(dtype).contiguous(memory_format=torch.channels_last)
        k = frames - skip
        big = torch.full((samples, k + 2, 3, h * patch, w * patch), 77 if uint8 else float("nan"), device="cuda",
                         dtype=torch.uint8 if uint8 else dtype)
        into = big[:, 1:1 + k]
        write_frames(y, into, patch, skip)
        ref = _reference(y, patch, uint8, samples, skip)
        assert torch.equal(into, ref)
        edges = torch.cat([big[:, :1], big[:, 1 + k:]], 1)
        assert bool((edges == 77).all()) if uint8 else bool(edges.isnan().all())


@pytest.mark.parametrize("variant", ["taew2_2", "taew2_1"])
def test_model_decode_through_the_pass_equals_the_pytorch_path(variant, monkeypatch):
    """decode_video (a chunk slice, trimmed) and a decode_step stream, float and uint8: the Triton pass gives the
    same frames as the PyTorch ops (the convs run the same rows in both: the kernels backend, which never times,
    and deterministic cuDNN; a first run decides every call, so that both compared runs take the same fused forms,
    which a call takes only once its row is decided: TGrow's fold, the last conv's frames)."""
    from taesd_fast.apps.bench.taehv import random_decoder
    from taesd_fast.models.taehv import model as taehv_model

    model = random_decoder(variant).cuda().half()
    model.cuda_graphs = False
    z = torch.randn(1, 3, model.latent_channels, 12, 20, device="cuda", dtype=torch.float16)

    def run():
        out = {u: model.decode_video(z, uint8=u) for u in (False, True)}
        state, steps = None, []
        for t in range(z.shape[1]):
            frames, state = model.decode_step(z[:, t], state, uint8=True)
            steps.append(frames)
        out["step"] = torch.cat(steps, 1)
        return out

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    with torch.no_grad(), dispatch.backend("kernels"), dispatch.tuning("off"):
        run()
        fast = run()
        monkeypatch.setattr(taehv_model, "_frames_kernel_takes", lambda *a: False)
        plain = run()
    for key in fast:
        assert torch.equal(fast[key], plain[key]), key


def test_the_pass_waits_for_the_dispatcher_to_run_kernels():
    """In auto mode the pass is taken once a call was decided to a kernel row: before tuning has answered, a fresh
    process's first calls compile nothing (the pass's first compile and launcher build took ~0.6 s of the first
    call). The kernels backend takes it at once, the torch backend never; inside a capture only once loaded."""
    from taesd_fast.kernels import triton_frames
    from taesd_fast.models.taehv.model import _frames_kernel_takes

    y = torch.rand(2, 12, 8, 16, device="cuda", dtype=torch.float16)
    into = torch.empty(1, 2, 3, 16, 32, device="cuda", dtype=torch.float16)
    dispatch.clear_cache()
    assert not dispatch.kernel_chosen()
    with dispatch.backend("auto"):
        assert not _frames_kernel_takes(y, into, 2)
    with dispatch.backend("torch"):
        assert not _frames_kernel_takes(y, into, 2)
    with dispatch.backend("kernels"):
        assert _frames_kernel_takes(y, into, 2)
        x = torch.randn(1, 16, 8, 8, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        w = torch.randn(16, 16, 3, 3, device="cuda", dtype=torch.float16)
        dispatch.conv2d(x, w, None)  # decided to a kernel row (the kernels backend never times)
    assert dispatch.kernel_chosen()
    with dispatch.backend("auto"):
        assert _frames_kernel_takes(y, into, 2)
        y4 = torch.rand(2, 48, 8, 16, device="cuda", dtype=torch.float16)  # patch 4: a variant no test launches
        into4 = torch.empty(1, 2, 3, 32, 64, device="cuda", dtype=torch.uint8)
        assert not triton_frames.ready(y4, into4, 4) and _frames_kernel_takes(y4, into4, 4)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert not _frames_kernel_takes(y4, into4, 4)
