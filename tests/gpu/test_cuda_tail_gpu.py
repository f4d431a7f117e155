"""The fused decoder tail (kernels/cuda_tail.py, csrc/tail_sm90.cu) against a float64 TGrow + upsample + conv +
ReLU + last conv + pixel shuffle + clamp, on fresh random inputs, each output written twice into differently
poisoned buffers (0 and 255 for uint8, NaN and -7 for f16): both must agree, so no element is left unwritten.

f16 frames: the worst element and the relative error within 2x those of PyTorch's own f16 run of the same ops
(what the model runs without the kernel). uint8 frames: every pixel within 1 of round(255 * the float64 frame),
and no more pixels off by one than 2x PyTorch's f16 run has (plus a floor of 0.1%)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from error_bounds import assert_worst_element_within, rel_err

from taesd_fast.kernels import cuda_tail

_OK = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.skipif(not _OK, reason="needs an sm_90 GPU"), pytest.mark.usefixtures("no_tf32")]
CL = torch.channels_last

# (N input frames, TGrow groups, H, W, batch, skip, rows): taew2_1's step, partial strips and row runs, one frame per
# input frame, a batch of two samples, skipped first frames, one-row and whole-frame runs.
SHAPES = [
    (2, 2, 160, 256, 1, 0, None),
    (1, 2, 9, 70, 1, 0, None),
    (3, 1, 12, 130, 1, 0, None),
    (4, 2, 8, 64, 2, 1, None),
    (1, 2, 7, 63, 1, 0, 1),
    (1, 1, 7, 63, 1, 0, 14),
]


def _where(bad: torch.Tensor) -> str:
    """Where the bad elements of [B, k, 3, H, W] are: the first few coordinates and the rows and columns hit."""
    if not bad.any():
        return "none"
    rows = bad.any(-1).flatten(0, 2).any(0).nonzero().flatten().tolist()
    cols = bad.any(-2).flatten(0, 2).any(0).nonzero().flatten().tolist()
    return f"{int(bad.sum())} elements, first {bad.nonzero()[:4].tolist()}, rows {rows[:24]}, columns {cols[:24]}"


def _tail(x, gw, w, b, w2, b2, dtype):
    n, c, h, wd = x.shape
    g = gw.shape[0] // c
    x, gw, w, b, w2, b2 = (t.to(dtype) for t in (x, gw, w, b, w2, b2))
    grown = F.conv2d(x, gw).view(n, g, c, h, wd).reshape(n * g, c, h, wd)
    hid = F.relu(F.conv2d(F.interpolate(grown, scale_factor=2, mode="nearest"), w, b, padding=1))
    return F.conv2d(hid, w2, b2, padding=1).clamp(0, 1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + f"_b{s[4]}_s{s[5]}_r{s[6]}")
@pytest.mark.parametrize("uint8", [False, True], ids=["f16", "uint8"])
def test_tail_matches_float64_within_torch_f16(shape, uint8):
    n, g, h, wd, batch, skip, rows = shape
    c = 64
    gen = torch.Generator(device="cuda").manual_seed(sum(shape[:4]) + uint8)
    x = torch.randn(n, c, h, wd, generator=gen, device="cuda").half().contiguous(memory_format=CL)
    gw = (torch.randn(g * c, c, 1, 1, generator=gen, device="cuda") / c**0.5).half()
    w = (torch.randn(c, c, 3, 3, generator=gen, device="cuda") / (3 * c**0.5)).half()
    b = (torch.randn(c, generator=gen, device="cuda") * 0.3).half()
    w2 = (torch.randn(3, c, 3, 3, generator=gen, device="cuda") / (3 * c**0.5)).half()
    b2 = (torch.randn(3, generator=gen, device="cuda") * 0.3 + 0.5).half()
    ref = _tail(x, gw, w, b, w2, b2, torch.float64)
    low = _tail(x, gw, w, b, w2, b2, torch.float16)
    k = n * g // batch

    def frames(t):  # [n*g, 3, H, W] -> the samples' frames after `skip`
        return t.view(batch, k, *t.shape[1:])[:, skip:]

    ref, low = frames(ref), frames(low)
    outs = []
    for poison in ((0, 255) if uint8 else (float("nan"), -7.0)):
        into = torch.full(ref.shape, poison, device="cuda", dtype=torch.uint8 if uint8 else torch.float16)
        cuda_tail.launch(x, gw, w, b, w2, b2, into, skip=skip, rows=rows)
        outs.append(into)
    torch.cuda.synchronize()
    _check(outs, ref, low, uint8)


def _check(outs, ref, low, uint8):
    unwritten = (outs[0] != outs[1]) if uint8 else ~((outs[0] == outs[1]) | (outs[0].isnan() & outs[1].isnan()))
    assert not unwritten.any(), f"elements left unwritten: {_where(unwritten)}"
    out = outs[0]
    if not uint8:
        assert not out.isnan().any(), f"NaN: {_where(out.isnan())}"
        err, torch_err = rel_err(out, ref), rel_err(low, ref)
        far = (out.double() - ref).abs() > 4 * (low.double() - ref).abs().max() + 1e-3
        assert err <= 2 * torch_err + 1e-7, \
            f"rel err {err:.3g} > 2 x PyTorch f16's {torch_err:.3g}; {_where(far)}"
        assert_worst_element_within(out, low, ref)
    else:
        want = (ref * 255).round()
        diff = (out.double() - want).abs()
        assert diff.max().item() <= 1, \
            f"a pixel is {diff.max().item():.0f} off round(255 v): {_where(diff > 1)}"
        off = (diff > 0).double().mean().item()
        torch_off = ((low.double() * 255).round() != want).double().mean().item()
        assert off <= 2 * torch_off + 1e-3, f"{off:.2%} of pixels off by one, PyTorch f16 {torch_off:.2%}"


def test_tail_refuses_a_wrong_output_shape():
    x = torch.zeros(1, 64, 8, 64, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.zeros(64, 64, 3, 3, device="cuda", dtype=torch.float16)
    into = torch.zeros(1, 2, 3, 16, 100, device="cuda", dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not hold"):
        cuda_tail.launch(x, torch.zeros(128, 64, 1, 1, device="cuda", dtype=torch.float16), w, None,
                         torch.zeros(3, 64, 3, 3, device="cuda", dtype=torch.float16), None, into, 1)


def test_tail_refuses_patch_2():
    x = torch.zeros(1, 64, 8, 64, device="cuda", dtype=torch.float16).contiguous(memory_format=CL)
    w = torch.zeros(64, 64, 3, 3, device="cuda", dtype=torch.float16)
    into = torch.zeros(1, 2, 3, 32, 256, device="cuda", dtype=torch.uint8)
    with pytest.raises(ValueError, match="patch 1"):
        cuda_tail.launch(x, torch.zeros(128, 64, 1, 1, device="cuda", dtype=torch.float16), w, None,
                         torch.zeros(12, 64, 3, 3, device="cuda", dtype=torch.float16), None, into, 2)


@pytest.mark.parametrize("name,latent,patch", [("taew2_1", 16, 1), ("taew2_2", 48, 2)])
def test_fused_tail_in_the_model(name, latent, patch, no_tf32):
    """TAEHV with fused_tail: decode_video within 2x PyTorch f16's error of the float64 reference; the graphed
    step stream equals it (f16 and uint8). With patch 1 the fused tail ran (the last conv never did); with patch 2
    (which the kernel does not cover) the model ran its layers."""
    from reference_taehv import ReferenceTAEHV, published_keys, random_state_dict

    from taesd_fast import TAEHV, dispatch

    state = random_state_dict(published_keys(latent, patch, decoder_time=(1, 2, 2)), seed=len(name))
    model = TAEHV.from_state_dict(state, device="cuda", dtype=torch.float16)
    latents = torch.randn(1, 4, latent, 6, 10, generator=torch.Generator().manual_seed(3))
    expected = ReferenceTAEHV(state).decode_video(latents)
    z = latents.cuda().half()
    calls = []
    last = model.decoder[-1]
    last.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad(), dispatch.backend("kernels"):
        with dispatch.backend("torch"):
            torch_frames = model.decode_video(z)
        before = len(calls)
        assert before > 0, "the hook never saw the last conv"
        model.fused_tail = True
        video = model.decode_video(z)
        steps, stream = [], None
        for t in range(4):
            out, stream = model.decode_step(z[:, t], stream)
            steps.append(out)
        frames8, stream = [], None
        for t in range(4):
            out, stream = model.decode_step(z[:, t], stream, uint8=True)
            frames8.append(out)
    assert stream._graph is not None, "the stream never replayed a graph"
    e_fast = ((video.double().cpu() - expected).norm() / expected.norm()).item()
    e_torch = ((torch_frames.double().cpu() - expected).norm() / expected.norm()).item()
    assert e_fast <= 2 * e_torch + 1e-6, (e_fast, e_torch)
    torch.testing.assert_close(torch.cat(steps, 1), video, rtol=0, atol=2e-3)
    assert (torch.cat(frames8, 1).float() - video.float().mul(255)).abs().max() <= 2
    if patch == 1:
        assert len(calls) == before, "the last conv ran with fused_tail on"
    else:
        assert len(calls) > before, "the last conv never ran, though the kernel does not take patch 2"
