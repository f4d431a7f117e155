"""TAEHV against the independent float64 reference (tests/reference_taehv.py) on random weights in the published
key layout, for every variant family: base (patch 1, 2, 4; time 4x and 8x) and super. No TAEHV weights are reachable
from CI, so the weights are random; the files are written in the published layout and loaded by their keys.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from reference_taehv import ReferenceTAEHV, published_keys, random_state_dict
from safetensors.torch import save_file

from taesd_fast.models.taehv.model import TAEHV
from taesd_fast.models.taehv.hub import VARIANTS

# fp32 CPU convs against float64: ~1e-7 in practice; a wrong layer, index or stride gives O(1) errors.
REL_TOL = 1e-5

FAMILIES = {  # one representative per family, with the published description's parameters
    "taehv": dict(latent=16, patch=1),  # also taew2_1, taeos1_3, taecvx: identical tensors
    "taew2_2": dict(latent=48, patch=2),
    "taew2_2_super": dict(latent=48, patch=2, super_decoder=True),
    "taeltx_2": dict(latent=128, patch=4, encoder_time=(2, 2, 2), decoder_time=(2, 2, 2)),
}
# Every published variant's description: (latent channels, patch, super, encoder strides, decoder strides).
PUBLISHED = {
    "taehv": (16, 1, False, (2, 2, 1), (1, 2, 2)), "taew2_1": (16, 1, False, (2, 2, 1), (1, 2, 2)),
    "taeos1_3": (16, 1, False, (2, 2, 1), (1, 2, 2)), "taecvx": (16, 1, False, (2, 2, 1), (1, 2, 2)),
    "taew2_2": (48, 2, False, (2, 2, 1), (1, 2, 2)), "taew2_2_super": (48, 2, True, (2, 2, 1), (1, 2, 2)),
    "taehv1_5": (32, 2, False, (2, 2, 1), (1, 2, 2)), "taehv1_5_super": (32, 2, True, (2, 2, 1), (1, 2, 2)),
    "taeltx_2": (128, 4, False, (2, 2, 2), (2, 2, 2)), "taeltx2_3": (128, 4, False, (2, 2, 2), (2, 2, 2)),
}
LATENT_HW = (2, 3)  # tiny: the CPU suite shares 2 cores
LTX_HW = (1, 2)  # patch 4 and 8x time: the largest outputs per latent


def _keys(name: str) -> dict:
    latent, patch, sup, enc, dec = PUBLISHED[name]
    return published_keys(latent, patch, super_decoder=sup, encoder_time=enc, decoder_time=dec)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(variant name, random state dict in the published layout, model loaded from a .safetensors file of it)."""
    name = request.param
    state = random_state_dict(_keys(name), seed=len(name))
    path = tmp_path_factory.mktemp(name) / "weights.safetensors"  # a name that says nothing about the variant
    save_file(state, str(path))
    model = TAEHV.from_pretrained(path)
    return name, state, model


def _hw(model) -> tuple[int, int]:
    return LTX_HW if model.patch_size == 4 else LATENT_HW


def _latents(model, frames: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, frames, model.latent_channels, *_hw(model), generator=gen)


def test_every_variant_has_the_published_key_layout():
    """The key names and shapes listed from the published description equal the module's (so published files load)."""
    for name in PUBLISHED:
        with torch.device("meta"):
            model = TAEHV(name)
        got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert got == _keys(name), name
        assert VARIANTS[name].t_downscale == (8 if "ltx" in name else 4)


def test_variant_detected_from_the_tensors(family):
    name, _, model = family
    assert model.variant == name  # the file is called weights.safetensors: only the tensors tell
    assert not model.training and not any(p.requires_grad for p in model.parameters())


def test_decode_matches_float64_reference(family):
    name, state, model = family
    latents = _latents(model, 3)
    ref = ReferenceTAEHV(state)
    expected = ref.decode_video(latents)
    frames = model.decode_video(latents)
    assert ref.unused_keys("decoder") == []
    t_up = 8 if "ltx" in name else 4
    h, w = _hw(model)
    assert frames.shape == (1, 3 * t_up - (t_up - 1), 3, 8 * h * model.patch_size, 8 * w * model.patch_size)
    inside = ((expected > 0) & (expected < 1)).double().mean().item()
    assert inside > 0.5, f"only {inside:.0%} of reference pixels inside (0, 1): the comparison would be weak"
    assert rel_err(frames, expected) <= REL_TOL


def test_encode_matches_float64_reference(family):
    name, state, model = family
    t_down = model.t_downscale
    gen = torch.Generator().manual_seed(2)
    video = torch.rand(1, t_down + 1, 3, 16 * model.patch_size, 16 * model.patch_size, generator=gen)  # padded
    ref = ReferenceTAEHV(state)
    expected = ref.encode_video(video)
    latents = model.encode_video(video)
    assert ref.unused_keys("encoder") == []
    assert latents.shape == (1, 2, model.latent_channels, 2, 2)
    assert expected.abs().max() > 0.1
    assert rel_err(latents, expected) <= REL_TOL


def test_streaming_decode_equals_parallel(family):
    name, _, model = family
    latents = _latents(model, 3, batch=2 if name == "taehv" else 1)
    whole = model.decode_video(latents)
    frames, state = [], None
    for t in range(3):
        out, state = model.decode_step(latents[:, t], state)
        frames.append(out)
    assert frames[0].shape[1] == 1 and all(f.shape[1] == model.t_upscale for f in frames[1:])  # the startup trim
    torch.testing.assert_close(torch.cat(frames, 1), whole, rtol=0, atol=1e-6)
    # A step of several latent frames, after a one-frame step, gives the same frames too.
    first, state = model.decode_step(latents[:, :1])
    rest, _ = model.decode_step(latents[:, 1:], state)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=0, atol=1e-6)
    if name == "taehv":  # decode_video(parallel=False) is the step loop; once is enough
        torch.testing.assert_close(model.decode_video(latents, parallel=False), whole, rtol=0, atol=1e-6)


def test_one_copy_of_the_memory_at_the_end_equals_a_copy_per_block(family):
    """run_sequence(batch_memory=True), the one-frame step's single multi-tensor copy, leaves the same output and the
    same memory as copying after each block, for one frame and for several."""
    from taesd_fast.models.taehv.sequence import memory_indices, run_sequence

    _, _, model = family
    for frames in (1, 3):
        z = _latents(model, frames)
        x = z.flatten(0, 1)
        start = [torch.randn(1, *m.shape[1:]) for m in _first_memory(model, x)]
        outs, mems = [], []
        for batched in (False, True):
            memory = [m.clone() for m in start]
            outs.append(run_sequence(model.decoder, x, 1, memory, batch_memory=batched))
            mems.append(memory)
        assert len(mems[0]) == len(memory_indices(model.decoder))
        assert torch.equal(outs[0], outs[1])
        assert all(torch.equal(a, b) for a, b in zip(*mems))
        assert not all(torch.equal(a, b) for a, b in zip(start, mems[1]))  # the memory was written


def test_memory_projections_equal_the_memory_block_conv(family, monkeypatch):
    """run_sequence(project=True) computes the memory half of each single-frame memory block's first conv ahead (on
    CUDA a step does this on a side stream): the output and the memory it leaves equal the single conv over
    [x, past] to fp32 rounding, and the blocks that skip that conv are exactly those seeing one frame per sample:
    stage s of the base decoder sees prod(decoder_time[:s]) frames of a one-latent step; the super decoder's blocks
    have no such conv."""
    import math

    from taesd_fast import dispatch
    from taesd_fast.models.taehv.sequence import run_sequence

    name, _, model = family
    params = FAMILIES[name]
    time = params.get("decoder_time", (1, 2, 2))
    single = 0 if params.get("super_decoder") else 3 * sum(math.prod(time[:s]) == 1 for s in range(3))
    x = _latents(model, 1).flatten(0, 1)
    start = [torch.randn(1, *m.shape[1:], generator=torch.Generator().manual_seed(i))
             for i, m in enumerate(_first_memory(model, x))]
    real, calls = dispatch.mem_conv, []
    monkeypatch.setattr(dispatch, "mem_conv", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs, mems, counts = [], [], []
    for project in (False, True):
        memory = [m.clone() for m in start]
        calls.clear()
        outs.append(run_sequence(model.decoder, x, 1, memory, batch_memory=True, project=project))
        mems.append(memory)
        counts.append(len(calls))
    blocks = 0 if params.get("super_decoder") else 9
    assert counts == [blocks, blocks - single]
    assert rel_err(outs[1], outs[0]) < REL_TOL
    assert all(rel_err(b, a) < REL_TOL for a, b in zip(*mems))


def test_memory_copies_beside_the_step_leave_the_batched_result(family, monkeypatch):
    """On CUDA a one-frame step's memory copies go on the side stream as soon as run_sequence issues them (before a
    block whose past half was projected, else after the block). Here each copy runs the moment it is issued, the
    earliest a side stream could run it: the output and the memory equal the batched copy's exactly, so no copy
    overwrites a memory that a block still reads."""
    from taesd_fast.models.taehv import sequence

    issued = []

    class Immediate(sequence.MemoryProjections):
        def __init__(self, seq, frames, cuda, memory, preview):
            super().__init__(seq, frames, False, memory, preview)  # the projections, computed here
            if self.ready:
                self.streams = ("main", "side")  # as on CUDA: run_sequence hands the copies over

        def take(self, j):
            hit = self.ready.get(j)
            return None if hit is None else hit[0]

        def copy(self, dst, src):
            dst.copy_(src)
            issued.append(dst)

        def join(self):
            self.kept = []

    x = _latents(family[2], 1).flatten(0, 1)
    start = [torch.randn(1, *m.shape[1:], generator=torch.Generator().manual_seed(i))
             for i, m in enumerate(_first_memory(family[2], x))]
    outs, mems = [], []
    for immediate in (False, True):
        if immediate:
            monkeypatch.setattr(sequence, "MemoryProjections", Immediate)
        memory = [m.clone() for m in start]
        outs.append(sequence.run_sequence(family[2].decoder, x, 1, memory, batch_memory=True, project=True))
        mems.append(memory)
    projected = not FAMILIES[family[0]].get("super_decoder")
    assert len(issued) == (len(start) if projected else 0)  # the super decoder has no projections: one batched copy
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*mems))
    assert not all(torch.equal(a, b) for a, b in zip(start, mems[1]))  # the memory was written


def _first_memory(model, x):
    """The decoder's memory after one run from zeros: tensors of each block's input shape."""
    from taesd_fast.models.taehv.sequence import memory_indices, run_sequence

    memory = [None] * len(memory_indices(model.decoder))
    run_sequence(model.decoder, x[:1], 1, memory)
    return memory


def test_streaming_encode_equals_parallel(family):
    name, _, model = family
    td = model.t_downscale
    side = 16 * model.patch_size
    batch = 2 if name == "taehv" else 1
    video = torch.rand(batch, 2 * td, 3, side, side, generator=torch.Generator().manual_seed(3))
    whole = model.encode_video(video)
    one, state = model.encode_step(video[:, :td])
    two, _ = model.encode_step(video[:, td:], state)
    torch.testing.assert_close(torch.cat([one, two], 1), whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.encode_video(video, parallel=False), whole, rtol=0, atol=1e-6)
    if batch == 2:  # samples stay apart (TPool folds frames of one sample only)
        torch.testing.assert_close(model.encode_video(video[1:]), whole[1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("time,space", [((False, False, False), (True, False, True)),
                                        ((False, True, True), (False, False, False))])
def test_preview_knobs_match_reference(family, time, space):
    name, state, model = family
    stage_has_time = [s == 2 for s in FAMILIES[name].get("decoder_time", (1, 2, 2))]
    time = tuple(t and has for t, has in zip(time, stage_has_time))
    latents = _latents(model, 2)
    try:
        model.set_preview(time, space)
        expected = ReferenceTAEHV(state, time_upscale=time, space_upscale=space).decode_video(latents)
        frames = model.decode_video(latents)
        t_up = 1
        for on, has in zip(time, stage_has_time):
            t_up *= 2 if on and has else 1
        side = model.patch_size * 2 ** sum(space)
        assert model.t_upscale == t_up and model.space_upscale == side
        h, w = _hw(model)
        assert frames.shape == (1, 2 * t_up - (t_up - 1), 3, h * side, w * side)
        assert rel_err(frames, expected) <= REL_TOL
        streamed, state_ = [], None
        for t in range(2):
            out, state_ = model.decode_step(latents[:, t], state_)
            streamed.append(out)
        torch.testing.assert_close(torch.cat(streamed, 1), frames, rtol=0, atol=1e-6)
    finally:
        model.set_preview()


def test_uint8_output(family):
    _, _, model = family
    latents = _latents(model, 2)
    frames = model.decode_video(latents)
    as_bytes = model.decode_video(latents, uint8=True)
    assert as_bytes.dtype == torch.uint8
    assert torch.equal(as_bytes, frames.mul(255).round().to(torch.uint8))


@pytest.mark.parametrize("stride", [1, 2, 4])
@pytest.mark.parametrize("channels_last", [False, True])
def test_time_folds_equal_upstream_reshape_and_keep_the_layout(stride, channels_last):
    """TPool's frames -> channels and TGrow's channels -> frames: the same values as upstream's reshape, and a
    channels_last input stays channels_last (the conv after it then reads its native layout on the GPU)."""
    from taesd_fast.models.taehv.layers import channels_to_frames, frames_to_channels

    gen = torch.Generator().manual_seed(stride)
    x = torch.randn(3 * stride, 5, 4, 6, generator=gen)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    folded = frames_to_channels(x.contiguous(memory_format=fmt), stride)
    assert torch.equal(folded, x.reshape(3, 5 * stride, 4, 6))
    grown = channels_to_frames(folded, stride)
    assert torch.equal(grown, x)
    for t in (folded, grown):
        assert t.is_contiguous(memory_format=fmt)


def test_channels_last_run_equals_contiguous(family, monkeypatch):
    """The whole decode and encode with every activation channels_last (as on CUDA) equal the contiguous run."""
    import taesd_fast.models.taehv.model as taehv_module

    _, _, model = family
    latents = _latents(model, 3, seed=7)
    video = torch.rand(1, 5, 3, *(8 * s * model.patch_size for s in _hw(model)),
                       generator=torch.Generator().manual_seed(8))
    plain = model.decode_video(latents), model.encode_video(video)
    monkeypatch.setattr(taehv_module, "preferred_layout", lambda x: x.contiguous(memory_format=torch.channels_last))
    last = model.decode_video(latents), model.encode_video(video)
    for a, b in zip(plain, last):
        assert rel_err(a, b) <= REL_TOL


def test_pooled_frames_equal_the_fold_and_conv():
    """TPool's CUDA path (GEMMs over the unfolded frames of a channels_last input), run here on the CPU in float64:
    equal to the fold and 1x1 conv it replaces, for time strides 2 and 4."""
    from taesd_fast.models.taehv.layers import _pooled_frames, frames_to_channels

    gen = torch.Generator().manual_seed(11)
    for stride in (2, 4):
        x = torch.randn(3 * stride, 8, 5, 7, generator=gen, dtype=torch.float64)
        weight = torch.randn(6, 8 * stride, 1, 1, generator=gen, dtype=torch.float64)
        expected = torch.nn.functional.conv2d(frames_to_channels(x, stride), weight)
        got = _pooled_frames(x.contiguous(memory_format=torch.channels_last), weight, stride)
        assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_grown_frames_equal_the_conv_and_unfold():
    """TGrow's CUDA path (a GEMM per output frame, written where the frame lies), run here on the CPU in float64:
    equal to the 1x1 conv and unfold into frames it replaces, for time strides 2 and 4, over a poisoned output."""
    from taesd_fast.models.taehv.layers import _grown_frames, channels_to_frames

    gen = torch.Generator().manual_seed(12)
    for stride in (2, 4):
        x = torch.randn(3, 8, 5, 7, generator=gen, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        weight = torch.randn(6 * stride, 8, 1, 1, generator=gen, dtype=torch.float64)
        expected = channels_to_frames(torch.nn.functional.conv2d(x, weight), stride)
        real_empty = torch.empty
        poisoned = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # noqa: E731
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "empty", poisoned)
            got = _grown_frames(x, weight, stride)
        assert got.shape == expected.shape and got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("stride, upscale", [(1, True), (2, False), (4, False)])
def test_composed_weight_is_tgrow_then_the_conv(stride, upscale):
    """The composed weight that folds TGrow into the conv after it (CUDA, one output frame per input frame): in
    float64, the conv with it on the upsampled input equals TGrow (all of its rows at stride 1, the last frame's with
    time upscaling off), then the upsample and the conv; and it is cached until a weight changes in place."""
    from taesd_fast.models.layers import conv3x3
    from taesd_fast.models.taehv.layers import TGrow, composed_weight

    torch.manual_seed(13)
    grow, conv = TGrow(8, stride).double(), conv3x3(8, 6).double()
    x = torch.randn(2, 8, 5, 7, dtype=torch.float64)
    up = lambda t: torch.nn.functional.interpolate(t, scale_factor=2, mode="nearest")  # noqa: E731
    with torch.no_grad():
        expected = torch.nn.functional.conv2d(up(grow(x, upscale)), conv.weight, conv.bias, padding=1)
        w = composed_weight(grow, conv)
        got = torch.nn.functional.conv2d(up(x), w, conv.bias, padding=1)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        assert composed_weight(grow, conv) is w
        grow.conv.weight.mul_(2)
        assert composed_weight(grow, conv) is not w
