"""The lip-sync pipeline: real frames of the bundled talking-head clip examples/assets/sun_3s.mp4 on CPU (a few frames), tiny synthetic videos for
audio handling, and the input checks.

The pixel checks compare the output with the input video re-encoded by the same writer: losslessly (crf=0), the
pixels outside the mask's support must come back bit-exact, while the lower face must have changed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TALKING_HEAD_CLIP

av = pytest.importorskip("av", reason="the lip-sync pipeline needs PyAV (pip install 'taesd_fast[media]')")
np = pytest.importorskip("numpy")

from taesd_fast import TAESD  # noqa: E402
from taesd_fast.apps.lipsync import (  # noqa: E402
    SUN_FACE_BOX, Box, VideoWriter, lipsync_video, lower_face_mask, probe, read_frames,
)
from taesd_fast.apps.latents_io import save_latents  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FRAMES = 6


@pytest.fixture(scope="module")
def model() -> TAESD:
    return TAESD.from_pretrained()  # bundled TAEF2, offline


@pytest.fixture(scope="module")
def sun() -> Path:
    return TALKING_HEAD_CLIP  # 75 real frames, 576x768; its face box is SUN_FACE_BOX


def regions(info, box: Box) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, W] bool masks: `outside` = 2+ px away from the mask's support (4:2:0 chroma spreads a change over 2x2
    pixels), `core` = where the mask is fully on."""
    weights = torch.zeros(info.height, info.width)
    weights[box.y0:box.y1, box.x0:box.x1] = lower_face_mask(box.height, box.width)[0, 0]
    near = F.max_pool2d((weights > 0).float()[None, None], 5, stride=1, padding=2)[0, 0] > 0
    return ~near, weights > 0.99


def reencode(source: Path, path: Path, frames: int, crf: int) -> None:
    info = probe(source)
    with VideoWriter(path, info.fps, info.width, info.height, crf=crf) as writer:
        for frame in read_frames(source, frames):
            writer.write(frame)


def frame_diff(a: Path, b: Path) -> torch.Tensor:
    """[N, H, W] max-over-RGB absolute difference of two videos' frames."""
    first = np.stack(list(read_frames(a))).astype(np.int16)
    second = np.stack(list(read_frames(b))).astype(np.int16)
    assert first.shape == second.shape
    return torch.from_numpy(np.abs(first - second).max(-1))


def test_roundtrip_on_sun_replaces_only_the_lower_face(sun, model, tmp_path):
    out, ref = tmp_path / "out.mp4", tmp_path / "ref.mp4"
    stats = lipsync_video(sun, out, model, box=SUN_FACE_BOX, max_frames=FRAMES, batch_size=4, crf=0, progress=False)
    assert stats.frames == FRAMES
    assert stats.decode_fps > 0 and stats.encode_seconds > 0 and stats.end_to_end_fps > 0
    source, written = probe(sun), probe(out)
    assert (written.frames, written.width, written.height, written.fps) == (FRAMES, source.width, source.height, 25)

    reencode(sun, ref, FRAMES, crf=0)
    diff = frame_diff(out, ref)
    outside, core = regions(source, SUN_FACE_BOX)
    assert diff[:, outside].max().item() == 0, "pixels outside the mask changed"
    # Resizing the crop to 256² and back alone changes the lower face by ~2.2 on average; the TAEF2 round trip ~4.4.
    changed = diff[:, core].float().mean().item()
    assert changed > 3.2, f"the lower face barely changed (mean |diff| {changed:.2f}): was anything decoded?"


def test_latents_file_is_decoded_into_the_face(sun, model, tmp_path):
    # Zero latents decode to a flat grey-brown face, far from the real one: easy to see, easy to check.
    latents_path = tmp_path / "faces.safetensors"
    save_latents(torch.zeros(3, model.latent_channels, 32, 32), latents_path)
    decoder_only = TAESD.from_pretrained(encoder=False)
    out, ref = tmp_path / "out.mp4", tmp_path / "ref.mp4"
    stats = lipsync_video(sun, out, decoder_only, box=SUN_FACE_BOX, latents=latents_path, max_frames=3, crf=0,
                          progress=False)
    assert stats.frames == 3 and stats.encode_seconds == 0

    reencode(sun, ref, 3, crf=0)
    diff = frame_diff(out, ref)
    outside, core = regions(probe(sun), SUN_FACE_BOX)
    assert diff[:, outside].max().item() == 0
    assert diff[:, core].float().mean().item() > 10


def test_example_script_runs_as_a_subprocess(sun, tmp_path):
    out = tmp_path / "example.mp4"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "lipsync.py"), str(sun), "-o", str(out), "--max-frames", "3",
         "--batch-size", "3", "--device", "cpu", "--dtype", "float32", "--backend", "torch"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "decode:" in result.stdout and "end to end:" in result.stdout
    written, source = probe(out), probe(sun)
    assert (written.frames, written.width, written.height, written.fps) == (3, source.width, source.height, 25)

    # Lossy (crf 18) here: outside the mask only codec noise, inside it the round trip's change on top.
    ref = tmp_path / "ref.mp4"
    reencode(sun, ref, 3, crf=18)
    diff = frame_diff(out, ref).float()
    outside, core = regions(source, SUN_FACE_BOX)
    assert diff[:, outside].mean() < 1.0
    assert diff[:, core].mean() > 3 * diff[:, outside].mean()


# ----------------------------------------------------------------------------------------- synthetic videos


def make_video(path: Path, frames: int = 6, fps: int = 10, audio_codec: str | None = None) -> None:
    """A 64x64 moving gradient, with one second of a 440 Hz tone when audio_codec is given."""
    rate = 16000
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width = video.height = 64
        video.pix_fmt = "yuv420p"
        audio = container.add_stream(audio_codec, rate=rate, layout="mono") if audio_codec else None
        ramp = np.linspace(0, 200, 64, dtype=np.float32)
        for i in range(frames):
            gray = np.tile(ramp + 5 * i, (64, 1)).astype(np.uint8)  # [64, 64]
            frame = av.VideoFrame.from_ndarray(np.stack([gray] * 3, -1), format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if audio is None:
            return
        tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate).astype(np.float32)
        fmt = "u8" if audio_codec == "pcm_u8" else "fltp"
        samples = ((tone + 1) * 127).astype(np.uint8) if fmt == "u8" else tone
        for start in range(0, rate, 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None, start:start + 1024]), format=fmt,
                                               layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
            container.mux(audio.encode(frame))
        container.mux(audio.encode(None))


@pytest.mark.parametrize("source_name, audio_codec, expected_codec", [
    ("talk.mp4", "aac", "aac"),  # mp4 holds AAC: packets are copied
    ("talk.mkv", "pcm_u8", "aac"),  # mp4 cannot hold 8-bit PCM: re-encoded to AAC
])
def test_audio_is_carried_over_and_trimmed(model, tmp_path, source_name, audio_codec, expected_codec):
    source, out = tmp_path / source_name, tmp_path / "out.mp4"
    make_video(source, audio_codec=audio_codec)
    lipsync_video(source, out, model, box=Box(8, 8, 56, 56), size=64, max_frames=5, progress=False)
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 5
        assert len(container.streams.audio) == 1
        assert container.streams.audio[0].codec_context.name == expected_codec
        seconds = sum(frame.samples for frame in container.decode(audio=0)) / 16000
    # The source has 1 s of sound; 5 frames at 10 fps are 0.5 s (AAC frames round it up a little).
    assert 0.45 <= seconds <= 0.65


def test_no_audio_stream_when_the_source_has_none(model, tmp_path):
    source, out = tmp_path / "silent.mp4", tmp_path / "out.mp4"
    make_video(source)
    lipsync_video(source, out, model, box=Box(8, 8, 56, 56), size=64, progress=False)
    with av.open(str(out)) as container:
        assert not container.streams.audio
        assert container.streams.video[0].frames == 6


# ----------------------------------------------------------------------------------------- input checks


@pytest.fixture(scope="module")
def small_video(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("video") / "small.mp4"
    make_video(path)
    return path


@pytest.mark.parametrize("box, message", [
    (Box(8, 8, 80, 56), "outside the 64x64 frame"),
    (Box(-1, 8, 40, 56), "outside the 64x64 frame"),
    (Box(40, 8, 8, 56), "is empty"),
])
def test_box_must_lie_inside_the_frame(model, small_video, tmp_path, box, message):
    with pytest.raises(ValueError, match=message):
        lipsync_video(small_video, tmp_path / "out.mp4", model, box=box, size=64, progress=False)
    assert not (tmp_path / "out.mp4").exists()


@pytest.mark.parametrize("text", ["1,2,3", "a,b,c,d", "1,2,3,4,5", ""])
def test_box_parse_rejects_malformed_text(text):
    with pytest.raises(ValueError, match="four integers x0,y0,x1,y1"):
        Box.parse(text)


def test_box_parse_round_trips():
    assert Box.parse(" 192, 152,368,328") == SUN_FACE_BOX
    assert Box.parse(str(SUN_FACE_BOX)) == SUN_FACE_BOX


@pytest.mark.parametrize("shape, message", [
    ((5, 32, 8, 8), "latents hold 5 frames but the video has 6"),
    ((7, 32, 8, 8), "latents hold 7 frames but the video has 6"),
    ((6, 16, 8, 8), "latents have 16 channels but the taef2 model expects 32"),
    ((6, 32, 16, 16), "latents are 16x16 but 64² face crops need 8x8"),
    ((6, 32, 8), "must be \\[N, C, h, w\\]"),
])
def test_latents_must_fit_model_crop_and_video(model, small_video, tmp_path, shape, message):
    with pytest.raises(ValueError, match=message):
        lipsync_video(small_video, tmp_path / "out.mp4", model, box=Box(8, 8, 56, 56), size=64,
                      latents=torch.zeros(shape), progress=False)


def test_max_frames_uses_the_first_latents(model, small_video, tmp_path):
    # 6 latents for a 6-frame video, but only 4 frames asked for: fine, the first 4 are used.
    latents = tmp_path / "faces.pt"
    torch.save({"latents": torch.zeros(6, 32, 8, 8)}, latents)
    stats = lipsync_video(small_video, tmp_path / "out.mp4", model, box=Box(8, 8, 56, 56), size=64, latents=latents,
                          max_frames=4, progress=False)
    assert stats.frames == 4 and probe(tmp_path / "out.mp4").frames == 4


def test_missing_video_is_a_clear_error(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="video not found"):
        lipsync_video(tmp_path / "nope.mp4", tmp_path / "out.mp4", model, box=SUN_FACE_BOX, progress=False)


def test_mask_covers_only_the_lower_half_and_fades_to_the_edges():
    mask = lower_face_mask(100, 80)[0, 0]
    assert mask.shape == (100, 80)
    assert mask[:50].max() == 0  # the eyes stay original
    assert mask[75, 40] == 1  # the mouth is replaced
    assert mask[-1].max() < 0.05 and mask[:, 0].max() < 0.05 and mask[:, -1].max() < 0.05  # no hard seam
    assert (mask[80:, 40].diff() <= 0).all()  # fades monotonically towards the chin
