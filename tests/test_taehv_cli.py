"""`taesd-fast video encode / decode / roundtrip` on a real clip (examples/assets/sun_3s.mp4, cut to a few frames at a
small size) with a random-weight TAEHV in the published layout."""

from __future__ import annotations

import argparse
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT
from reference_taehv import published_keys, random_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

from taesd_fast import TAEHV
from taesd_fast.apps.cli import run_command
from taesd_fast.apps.lipsync import VideoWriter, probe, read_frames
from taesd_fast.apps.video_cli import add_parser

CLIP = REPO_ROOT / "examples" / "assets" / "sun_3s.mp4"
FRAMES, HEIGHT, WIDTH = 7, 44, 60  # not multiples of 8: the commands pad and crop back; 7 = 4k + 3 frames


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="taesd-fast")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def _run(argv: list[str]) -> int:
    args = _parse(argv)
    return run_command(args.func, args)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "weights.safetensors"
    save_file(random_state_dict(published_keys(16, 1), seed=11), str(path))
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """The first frames of the repository's real clip, shrunk to WIDTH x HEIGHT (H.264, crf 0)."""
    path = tmp_path_factory.mktemp("clip") / "small.mp4"
    info = probe(CLIP)
    with VideoWriter(path, info.fps, WIDTH, HEIGHT, crf=0) as writer:
        for frame in read_frames(CLIP, FRAMES):
            x = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
            small = F.interpolate(x, size=(HEIGHT, WIDTH), mode="area").round().clamp(0, 255).byte()
            writer.write(small[0].permute(1, 2, 0).numpy())
    return path


def _read(path) -> np.ndarray:
    return np.stack(list(read_frames(path)))


def test_roundtrip_writes_every_frame_and_reports(clip, weights, tmp_path, capsys):
    out = tmp_path / "round.mp4"
    assert _run(["video", "roundtrip", str(clip), "-o", str(out), "--weights", str(weights), "--crf", "0"]) == 0
    printed = capsys.readouterr().out
    assert "PSNR" in printed and "fps" in printed and f"over {FRAMES} frames" in printed
    info = probe(out)
    assert (info.width, info.height, info.fps) == (WIDTH, HEIGHT, probe(clip).fps)
    written = _read(out)
    assert written.shape == (FRAMES, HEIGHT, WIDTH, 3)
    # The same model through the Python API: pad to 4k + 1 frames and to a multiple of 8 pixels, crop back.
    model = TAEHV.from_pretrained(weights)
    source = torch.from_numpy(_read(clip)).permute(0, 3, 1, 2).float().div(255)[None]
    padded = torch.cat([source, source[:, -1:].expand(-1, 2, -1, -1, -1)], 1)
    padded = F.pad(padded.flatten(0, 1), (0, 4, 0, 4), mode="replicate").unflatten(0, (1, FRAMES + 2))
    expected = model.decode_video(model.encode_video(padded), uint8=True)[0, :FRAMES, :, :HEIGHT, :WIDTH]
    expected = expected.permute(0, 2, 3, 1).float()
    # H.264 at crf 0 in yuv420p still subsamples chroma: compare loosely, far below what a wrong frame would give.
    assert (torch.from_numpy(written).float() - expected).abs().mean() < 4.0


def test_encode_then_decode(clip, weights, tmp_path, capsys):
    latents_path = tmp_path / "clip.safetensors"
    assert _run(["video", "encode", str(clip), "-o", str(latents_path), "--weights", str(weights)]) == 0
    with safe_open(str(latents_path), framework="pt") as f:
        latents, metadata = f.get_tensor("latents"), f.metadata()
    assert latents.shape == (1, 3, 16, 6, 8)  # 7 frames -> 9 (4k + 1) -> 12 (whole steps) -> 3 latents
    assert metadata == {"variant": "taehv", "fps": str(probe(clip).fps), "frames": str(FRAMES),
                        "height": str(HEIGHT), "width": str(WIDTH)}
    out = tmp_path / "decoded.mp4"
    assert _run(["video", "decode", str(latents_path), "-o", str(out), "--weights", str(weights)]) == 0
    assert "decoded 7 frames at 60x44" in capsys.readouterr().out
    assert _read(out).shape == (FRAMES, HEIGHT, WIDTH, 3)
    # diffusers' NCTHW latents in a .pt file, no metadata: every decoded frame, the default fps.
    pt = tmp_path / "ncthw.pt"
    torch.save(latents.transpose(1, 2).clone(), pt)
    out2 = tmp_path / "decoded2.mp4"
    assert _run(["video", "decode", str(pt), "-o", str(out2), "--weights", str(weights), "--ncthw"]) == 0
    info = probe(out2)
    assert (info.width, info.height, info.fps) == (64, 48, Fraction(16)) and len(_read(out2)) == 9


def test_errors_are_one_line_and_outputs_are_safe(clip, weights, tmp_path, capsys):
    assert _run(["video", "roundtrip", str(clip), "-o", str(clip), "--weights", str(weights)]) == 1
    assert "is the input" in capsys.readouterr().err
    existing = tmp_path / "existing.mp4"
    existing.write_bytes(b"keep me")
    assert _run(["video", "roundtrip", str(clip), "-o", str(existing), "--weights", str(weights)]) == 1
    err = capsys.readouterr().err
    assert "exists; pass --overwrite" in err and err.count("\n") == 1
    assert existing.read_bytes() == b"keep me"
    assert _run(["video", "roundtrip", str(clip), "-o", str(existing), "--weights", str(weights), "--overwrite"]) == 0
    assert probe(existing).frames == FRAMES
    capsys.readouterr()
    wrong = tmp_path / "wrong.safetensors"
    save_file({"latents": torch.randn(1, 2, 48, 3, 4)}, str(wrong))
    assert _run(["video", "decode", str(wrong), "-o", str(tmp_path / "x.mp4"), "--weights", str(weights)]) == 1
    err = capsys.readouterr().err
    assert "expects 16 channels at dim 2" in err and err.count("\n") == 1
    assert not (tmp_path / "x.mp4").exists() and not (tmp_path / "x.partial.mp4").exists()
    assert _run(["video", "roundtrip", str(clip), "-o", str(tmp_path / "y.mp4")]) == 1
    assert "pass --variant" in capsys.readouterr().err
    assert _run(["video", "decode", str(tmp_path / "missing.safetensors"), "-o", str(tmp_path / "z.mp4"),
                 "--weights", str(weights)]) == 1
    assert "latents file not found" in capsys.readouterr().err


def test_unreadable_latents_files_read_as_image_latents_files_do(weights, tmp_path, capsys):
    """video decode reads latents through latents_io's reader: the same one-line errors as the image commands."""
    truncated = tmp_path / "cut.safetensors"
    save_file({"latents": torch.randn(1, 2, 16, 3, 4)}, str(truncated))
    truncated.write_bytes(truncated.read_bytes()[:40])
    assert _run(["video", "decode", str(truncated), "-o", str(tmp_path / "a.mp4"), "--weights", str(weights)]) == 1
    err = capsys.readouterr().err
    assert f"could not read latents file {truncated}" in err and "corrupt or truncated" in err
    assert err.count("\n") == 1
    wrapped = tmp_path / "wrapped.pt"
    torch.save({"frames": torch.randn(1, 2, 16, 3, 4)}, wrapped)
    assert _run(["video", "decode", str(wrapped), "-o", str(tmp_path / "b.mp4"), "--weights", str(weights)]) == 1
    err = capsys.readouterr().err
    assert "should hold a latents tensor or a dict with key 'latents', got dict" in err and err.count("\n") == 1
    assert not (tmp_path / "a.mp4").exists() and not (tmp_path / "b.mp4").exists()


def test_the_weights_file_is_an_input_that_no_output_replaces(clip, weights, tmp_path, capsys):
    """`video encode ... -o W --weights W --overwrite` replaced the weights it was reading; so would a folder's file."""
    own = tmp_path / "taehv.safetensors"
    own.write_bytes(weights.read_bytes())
    before = own.read_bytes()
    for source in (own, tmp_path):  # the file itself, or the folder that holds it
        for extra in ([], ["--overwrite"]):
            assert _run(["video", "encode", str(clip), "-o", str(own), "--weights", str(source), *extra]) == 1
            err = capsys.readouterr().err
            assert f"output {own} is the weights file {own}" in err and "even with --overwrite" in err, err
            assert err.count("\n") == 1
    assert own.read_bytes() == before
