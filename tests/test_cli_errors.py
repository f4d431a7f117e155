"""Every CLI error is one line with exit status 1 (--debug shows the traceback), and every suggestion names
something that exists: the audit's raw tracebacks and misleading hints, one test each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("PIL.Image", reason="the CLI's image commands need Pillow (taesd_fast[media])")

from cli_helpers import REPO_ROOT, assert_user_error, random_weights_folder, run, small_image  # noqa: E402
from taesd_fast.apps.cli import main  # noqa: E402

DEMO_CLIP = REPO_ROOT / "examples" / "assets" / "sun_3s.mp4"


def cli_subprocess(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "taesd_fast.apps.cli", *args], env=env, **kwargs)


# ------------------------------------------------------------------------------------------------ --debug


def test_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.delenv("TAESD_FAST_DEBUG", raising=False)
    assert_user_error(*run(capsys, "info", "--device", "nonsense")[::2], "--device nonsense is not a torch device")
    for argv in (["--debug", "info", "--device", "nonsense"], ["info", "--device", "nonsense", "--debug"]):
        with pytest.raises(ValueError, match="is not a torch device"):
            main(argv)
    monkeypatch.setenv("TAESD_FAST_DEBUG", "1")
    with pytest.raises(ValueError, match="is not a torch device"):
        main(["info", "--device", "nonsense"])


# ------------------------------------------------------------------------------------------------ devices


def test_cuda_on_a_cpu_only_torch(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    image = small_image(tmp_path / "in.png")
    for argv in (["encode", image, "-o", tmp_path / "z.safetensors"], ["info"]):
        code, _, err = run(capsys, *argv, "--device", "cuda")
        assert_user_error(code, err, "--device cuda needs CUDA", "is a CPU-only build", "use --device cpu")
    assert not (tmp_path / "z.safetensors").exists()


# ------------------------------------------------------------------------------------------------ inputs


def test_a_folder_of_images_is_encoded_image_by_image_in_order(capsys, tmp_path):
    images = tmp_path / "images"
    for name in ("b.jpg", "a.png", "c.webp"):
        small_image(images / name)
    (images / "notes.txt").write_text("not an image")
    (images / "sub").mkdir()
    code, out, err = run(capsys, "encode", images, "-o", tmp_path / "latents")
    assert code == 0, err
    assert [line.split(" -> ")[0] for line in out.splitlines()] == [str(images / n) for n in ("a.png", "b.jpg", "c.webp")]
    assert sorted(p.name for p in (tmp_path / "latents").iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors"]
    code, out, err = run(capsys, "roundtrip", images, "-o", tmp_path / "rt")
    assert code == 0, err
    assert out.count("PSNR") == 3
    code, out, err = run(capsys, "decode", tmp_path / "latents", "-o", tmp_path / "decoded")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "decoded").iterdir()) == ["a.png", "b.png", "c.png"]


def test_a_folder_without_images_is_a_one_line_error(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "roundtrip", tmp_path / "empty", "-o", tmp_path / "out")
    assert_user_error(code, err, f"folder {tmp_path / 'empty'} holds no images", ".png")


def test_weights_given_as_a_file(capsys, tmp_path):
    from taesd_fast.models.taesd.hub import BUNDLED_DIR

    image = small_image(tmp_path / "in.png")
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--weights",
                       BUNDLED_DIR / "taef2_decoder.safetensors")
    assert_user_error(code, err, "is a file; pass the folder that holds it")
    assert "decoder_path=" not in err  # an API keyword, not a flag of this command


def test_cli_suggests_flags_and_real_sources(capsys, tmp_path):
    """The CLI says --variant, not variant=, and never suggests madebyollin/taesana (not a Hub repo)."""
    from taesd_fast.models.taesd.hub import BUNDLED_DIR

    image = small_image(tmp_path / "in.png")
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--variant", "taesana")
    assert_user_error(code, err, "only taef2 weights are bundled", "--weights FOLDER --variant taesana",
                          "github.com/madebyollin/taesd")
    assert "madebyollin/taesana" not in err and "variant=" not in err

    folder = tmp_path / "weights"  # two complete variants: ambiguous
    folder.mkdir()
    for name in ("taef2_encoder.safetensors", "taef2_decoder.safetensors"):
        (folder / name).write_bytes((BUNDLED_DIR / name).read_bytes())
    random_weights_folder(folder, "taesd")
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--weights", folder)
    assert_user_error(code, err, "several TAESD variants (taesd, taef2)", "pass --variant to choose one")
    assert "variant=" not in err


def test_help_texts(capsys):
    with pytest.raises(SystemExit):
        main(["encode", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "8; 32 for taesana" in text and "--tile SIZE|auto" in text and "--overwrite" in text
    with pytest.raises(SystemExit):
        main(["lipsync", "--help"])
    text = capsys.readouterr().out
    assert "shared/" not in text and "sun_3s.mp4" in text


# ------------------------------------------------------------------------------------------------ video


@pytest.fixture
def av():
    return pytest.importorskip("av", reason="lipsync needs PyAV (taesd_fast[media])")


def test_lipsync_on_files_that_are_not_videos(capsys, av, tmp_path):
    fake = tmp_path / "notes.mp4"
    fake.write_text("not a video at all")
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(DEMO_CLIP.read_bytes()[:20000])
    for video in (fake, truncated):
        code, _, err = run(capsys, "lipsync", video, "-o", tmp_path / "out.mp4", "--max-frames", "1")
        assert_user_error(code, err, f"cannot read video {video}: Invalid data found when processing input")
        assert "[Errno" not in err
    assert not (tmp_path / "out.mp4").exists()


@pytest.mark.parametrize("command", [["lipsync"], ["video", "roundtrip"], ["video", "encode"]])
def test_a_text_file_named_like_an_image_is_not_a_video(capsys, av, tmp_path, command):
    """FFmpeg opens a text file named fake.png as a 0x0 image stream; the command failed later in libx264 with
    'avcodec_open2(...) returned 22'."""
    fake = tmp_path / "fake.png"
    fake.write_text("not an image, not a video")
    suffix = ".safetensors" if command[-1] == "encode" else ".mp4"
    variant = ["--variant", "taew2_1"] if command[0] == "video" else []  # video's check comes before any load
    code, _, err = run(capsys, *command, fake, "-o", tmp_path / f"out{suffix}", *variant)
    assert_user_error(code, err, f"{fake} is not a video", "expected a video file")
    assert not (tmp_path / f"out{suffix}").exists()


def write_smooth_video(av, path: Path, width: int, height: int, frames: int) -> list:
    """A lossless (FFV1) video of smooth gradients, which 4:2:0 H.264 keeps close; returns the frames."""
    import numpy as np

    ys, xs = np.mgrid[0:height, 0:width]
    written = []
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=25)
        stream.width, stream.height, stream.pix_fmt = width, height, "bgr0"
        for i in range(frames):
            frame = np.stack([xs * 3 + i, ys * 4, (xs + ys) * 2], -1).clip(0, 255).astype(np.uint8)
            written.append(frame)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return written


def test_lipsync_pads_an_odd_sized_video_for_h264(capsys, av, tmp_path):
    import numpy as np

    from taesd_fast.apps.lipsync import read_frames

    source = tmp_path / "odd.mkv"
    frames = write_smooth_video(av, source, 67, 45, 3)
    code, out, err = run(capsys, "lipsync", source, "-o", tmp_path / "out.mp4", "--box", "20,2,60,42", "--crf", "0")
    assert code == 0, err
    assert "taesd-fast: warning: H.264 needs an even frame size: the 67x45 frames are written as 68x46" in err
    result = list(read_frames(tmp_path / "out.mp4"))
    assert len(result) == 3 and result[0].shape == (46, 68, 3)
    for original, written in zip(frames, result):
        outside_box = np.abs(written[:45, :20].astype(int) - original[:, :20]).max()
        assert outside_box <= 8, outside_box  # 4:2:0 chroma rounding only
        edge = np.abs(written[45, :67].astype(int) - written[44, :67]).max()
        assert edge <= 8, edge  # the padding row repeats the last one


# ------------------------------------------------------------------------------------------------ pipes


def test_a_closed_stdout_ends_quietly():
    """The audit: `taesd-fast info | head -1` printed a BrokenPipeError traceback."""
    proc = cli_subprocess("info", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert err == b"", err.decode()


def test_info_into_head_in_a_shell():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(f"'{sys.executable}' -m taesd_fast.apps.cli info | head -1", shell=True,
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.stdout.startswith("taesd_fast ") and result.stdout.count("\n") == 1
    assert result.stderr == "", result.stderr
