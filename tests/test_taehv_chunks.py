"""TAEHV's whole-video paths run in chunks of latent frames through the streaming state, writing into one output:
the chunked result equals the one-chunk result bitwise (fp32, CPU) for the base, super, 8x-time and untrimmed
(taecvx) decoders with odd frame counts, the step-by-step stream equals decode_video, and the memory a decode
holds beyond its output is one chunk's, whatever the video's length (live activation bytes counted on the CPU).

Bitwise comparisons run every conv one image at a time (`per_image_convs`): the CPU's convs (oneDNN's GEMM
blocking, the native path for a single image) change their summation order with the batch size, so a chunk's convs
would round differently (~1e-7) from a whole video's for reasons of the backend, not of the chunking. One image at a
time, each frame's arithmetic is the same however the video is cut, and any difference is the chunking's own.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from reference_taehv import published_keys, random_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from taesd_fast.models.taehv.model import CHUNK_BYTES, TAEHV, chunk_spans
from taesd_fast.models.taehv.hub import VARIANTS

VARIANTS_CHECKED = ["taew2_2", "taew2_1", "taehv1_5_super", "taeltx_2", "taecvx"]


def _model(name: str) -> TAEHV:
    a = VARIANTS[name]
    keys = published_keys(a.latent_channels, a.patch_size, super_decoder=a.super_decoder,
                          encoder_time=a.encoder_time, decoder_time=a.decoder_time)
    return TAEHV.from_state_dict(random_state_dict(keys, seed=len(name)), variant=name)


@pytest.fixture(scope="module", params=VARIANTS_CHECKED)
def model(request):
    return _model(request.param)


@pytest.fixture
def per_image_convs(monkeypatch):
    """F.conv2d (which the dispatcher's PyTorch path and the super decoder's depthwise conv call) applied to one
    image at a time, so its summation order does not depend on the batch: see the docstring."""
    conv2d = F.conv2d

    def one_at_a_time(x, *args, **kwargs):
        return torch.cat([conv2d(image, *args, **kwargs) for image in x.split(1)])

    monkeypatch.setattr(F, "conv2d", one_at_a_time)


def _hw(model) -> tuple[int, int]:
    return (1, 2) if model.patch_size == 4 else (2, 3)


def _latents(model, frames: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, frames, model.latent_channels, *_hw(model), generator=gen)


def _per_latent_bytes(model) -> int:
    return model._bytes_per_latent("decoder", *_hw(model), next(model.decoder.parameters()))


def _decode(model, latents, chunk: int | None, **kwargs) -> torch.Tensor:
    """decode_video with chunks of `chunk` latent frames at most (None: one chunk)."""
    model.chunk_bytes = math.inf if chunk is None else chunk * _per_latent_bytes(model)
    try:
        return model.decode_video(latents, **kwargs)
    finally:
        model.chunk_bytes = CHUNK_BYTES


def test_chunk_spans_cover_the_range_evenly():
    for total in range(1, 40):
        for most in range(1, 12):
            spans = chunk_spans(total, most)
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) <= most and max(sizes) - min(sizes) <= 1 and len(spans) == -(-total // most)


def test_chunked_decode_equals_whole_bitwise(model, per_image_convs):
    for frames, chunks in ((7, (1, 3)), (8, (3,))):  # odd, and even (taecvx keeps its startup frames then)
        latents = _latents(model, frames)
        whole = _decode(model, latents, None)
        trim = 0 if model.variant == "taecvx" and frames % 2 == 0 else model.t_upscale - 1
        assert whole.shape[1] == model.t_upscale * frames - trim
        for chunk in chunks:  # 7 chunks of 1; 3 of 2, 2, 3; 3 of 2, 3, 3
            got = _decode(model, latents, chunk)
            assert got.is_contiguous() and got.shape == whole.shape
            assert torch.equal(got, whole), (model.variant, frames, chunk, (got - whole).abs().max().item())
    as_bytes = _decode(model, latents, 3, uint8=True)
    assert as_bytes.dtype == torch.uint8 and torch.equal(as_bytes, whole.mul(255).round().to(torch.uint8))


def test_chunks_carry_the_memory(model):
    """Chunks that started afresh (no carried memory) would give other frames: the test above can fail."""
    latents = _latents(model, 6, seed=1)
    whole = _decode(model, latents, None)
    restarted = _decode(model, latents[:, 3:], None)
    assert (restarted[:, 1:] - whole[:, -restarted.shape[1] + 1:]).abs().max() > 1e-3


def test_one_frame_chunks_and_stream_equal_decode_video(model, per_image_convs):
    latents = _latents(model, 5, seed=2)
    whole = _decode(model, latents, None)
    one_by_one = model.decode_video(latents, parallel=False)
    assert one_by_one.shape == whole.shape
    assert torch.equal(one_by_one, whole)
    # A stream never drops taecvx's startup frames; decode_video does for an odd count (upstream's rule).
    startup = model.frames_to_trim if model.variant == "taecvx" else 0
    stream, state = [], None
    for t in range(5):
        frames, state = model.decode_step(latents[:, t], state)
        stream.append(frames)
    assert torch.equal(torch.cat(stream, 1)[:, startup:], whole)
    first, state = model.decode_step(latents[:, :2])  # steps of 2 and 3 latent frames
    rest, _ = model.decode_step(latents[:, 2:], state)
    assert torch.equal(torch.cat([first, rest], 1)[:, startup:], whole)


def _video(model, latent_frames: int, seed: int = 3) -> torch.Tensor:
    """Frames for `latent_frames` latent frames, the last one short by t_downscale - 1 (encode_video pads it)."""
    side = 8 * model.patch_size
    frames = (latent_frames - 1) * model.t_downscale + 1
    return torch.rand(1, frames, 3, 2 * side, 3 * side, generator=torch.Generator().manual_seed(seed))


def _per_latent_encode_bytes(model, video) -> int:
    return model._bytes_per_latent("encoder", *video.shape[-2:], next(model.encoder.parameters()))


def _encode(model, video, budget: float, **kwargs) -> torch.Tensor:
    """encode_video with chunk_bytes = budget x the whole encoder's activation bytes per latent frame."""
    model.chunk_bytes = budget * _per_latent_encode_bytes(model, video)
    try:
        return model.encode_video(video, **kwargs)
    finally:
        model.chunk_bytes = CHUNK_BYTES


def test_chunked_encode_equals_whole_bitwise(model, per_image_convs):
    """Both levels of encode_video's chunks (short chunks of the full-resolution layers gathered into long chunks
    of the rest) and the padded last chunk give the whole-clip encode's latents, at budgets from one latent frame
    per chunk to the whole clip."""
    video = _video(model, 7)
    whole = _encode(model, video, math.inf)
    assert whole.shape[:2] == (1, 7) and whole.abs().max() > 0.1
    param = next(model.encoder.parameters())
    seen = set()
    for budget in (0.05, 0.2, 1, 3, 5):
        model.chunk_bytes = budget * _per_latent_encode_bytes(model, video)
        long, short, _ = model._encode_chunks(7, *video.shape[-2:], param)
        seen.add((long, short))
        got = _encode(model, video, budget)
        assert torch.equal(got, whole), (model.variant, budget, long, short, (got - whole).abs().max().item())
    # one latent frame per chunk; long chunks of short ones, several long chunks; the whole clip in long chunks
    assert (1, 1) in seen and any(1 < long < 7 for long, _ in seen), seen
    assert any(long == 7 and 1 < short < 7 for long, short in seen), seen
    assert torch.equal(model.encode_video(video, parallel=False), whole)


def test_chunked_encode_carries_the_memory(model):
    """Latents of a clip encoded from its middle differ from the whole clip's (the memory carries the past), so
    the test above can fail."""
    video = _video(model, 6, seed=4)
    whole = _encode(model, video, math.inf)
    restarted = _encode(model, video[:, 3 * model.t_downscale:], math.inf)
    assert (restarted[:, 1:] - whole[:, 4:]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ memory


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors that ops allocate while active and that are still alive, and their peak. A tensor
    whose storage is an input's (a view, an in-place op) is no new allocation; weights and inputs made before
    are not counted. Allocations inside one op (a conv's workspace) are not seen."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, list] = {}  # storage address -> [tensors alive on it, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.refs:
                    self.refs[ptr][0] += 1
                elif ptr not in inputs and ptr:
                    self.refs[ptr] = [1, t.untyped_storage().nbytes()]
                    self.live += self.refs[ptr][1]
                    self.peak = max(self.peak, self.live)
                else:
                    continue
                weakref.finalize(t, self._drop, ptr)
        return out

    def _drop(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]


def _peak_beyond_output(model, latents, chunk) -> int:
    """Peak live activation bytes of decode_video beyond its output and the stream's memory (one frame of each
    memory block's input: a constant per video, not per chunk)."""
    with LiveBytes() as live:
        out = _decode(model, latents, chunk)
    _, state = model.decode_step(latents[:, :1])
    memory = sum(m.untyped_storage().nbytes() for m in state.memory)
    return live.peak - out.untyped_storage().nbytes() - memory


@pytest.mark.parametrize("name", ["taew2_2", "taehv1_5_super", "taeltx_2"])
def test_memory_beyond_the_output_is_one_chunks(name):
    """The activations alive beyond the output stay within chunk_bytes (and use at least a third of it: the estimate
    is not wildly pessimistic), and a video 3x longer stays within it too: the bound on GPU memory at any length
    (tests/gpu measures it there)."""
    model = _model(name)
    budget = 2 * _per_latent_bytes(model)  # what _decode(..., 2) sets chunk_bytes to
    short = _peak_beyond_output(model, _latents(model, 4), 2)
    long = _peak_beyond_output(model, _latents(model, 12), 2)
    assert budget / 3 <= short <= budget and budget / 3 <= long <= budget, (short, long, budget)
    whole = _peak_beyond_output(model, _latents(model, 12), None)
    assert whole > 3 * long  # the measurement sees a whole-video decode's activations


def _encode_peak_beyond_state(model, video, budget) -> int:
    """Peak live activation bytes of encode_video beyond its latents and the stream's memory."""
    with LiveBytes() as live:
        out = _encode(model, video, budget)
    _, state = model.encode_step(video[:, :model.t_downscale])
    memory = sum(m.untyped_storage().nbytes() for m in state.memory)
    return live.peak - out.untyped_storage().nbytes() - memory


@pytest.mark.parametrize("name", ["taew2_2", "taeltx_2"])
def test_encode_memory_is_one_chunks(name):
    """encode_video's activations (the gathered long chunk and a short chunk's, with the chunk's frames) stay within
    chunk_bytes and use at least a third of it, for a video 3x longer too; a whole-clip encode holds much more."""
    model = _model(name)
    for budget in (1, 2.5):  # short chunks of 1 and 2 latent frames
        short = _encode_peak_beyond_state(model, _video(model, 4), budget)
        long = _encode_peak_beyond_state(model, _video(model, 12), budget)
        limit = budget * _per_latent_encode_bytes(model, _video(model, 4))
        assert limit / 3 <= short <= limit and limit / 3 <= long <= limit, (budget, short, long, limit)
    whole = _encode_peak_beyond_state(model, _video(model, 12), math.inf)
    assert whole > 3 * long
