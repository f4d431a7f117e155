"""The taesd-fast command line: subcommands through main([...]), exit codes, messages, one real subprocess.

Images are the bundled examples/assets/monalisa.jpg shrunk to 64-96 px: these tests are about plumbing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

Image = pytest.importorskip("PIL.Image", reason="the CLI's image commands need Pillow (taesd_fast[media])")

from cli_helpers import REPO_ROOT, assert_user_error, random_weights_folder, run, small_image  # noqa: E402
from conftest import IMAGE_NAMES, PHOTOS  # noqa: E402
from taesd_fast.apps.cli import main  # noqa: E402
from taesd_fast.apps.latents_io import load_latents, save_latents  # noqa: E402
SUBCOMMANDS = ("encode", "decode", "roundtrip", "lipsync", "bench", "info")


@pytest.fixture
def image(tmp_path) -> Path:
    return small_image(tmp_path / "mona.png", 64, 96)


@pytest.fixture
def odd_image(tmp_path) -> Path:
    return small_image(tmp_path / "odd.png", 70, 90)  # neither side a multiple of 8


@pytest.fixture(scope="module")
def taesd4_weights(tmp_path_factory) -> Path:
    """A folder of 4-channel (SD1.5 taesd architecture) weights, randomly initialised: enough for the PNG path."""
    return random_weights_folder(tmp_path_factory.mktemp("taesd4"), "taesd")


def test_help_runs_as_a_module_in_a_subprocess():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "taesd_fast.apps.cli", "--help"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in SUBCOMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", [c for c in SUBCOMMANDS if c != "bench"])
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: taesd-fast {command}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["encode"], ["roundtrip", "x.png"], ["info", "--dtype", "int8"]])
def test_usage_errors_exit_with_2(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_roundtrip_writes_images_and_prints_psnr(capsys, image, tmp_path):
    code, out, _ = run(capsys, "roundtrip", image, "-o", tmp_path / "rt", "--device", "cpu")
    assert code == 0
    match = re.search(r"PSNR ([\d.]+) dB", out)
    assert match and float(match.group(1)) > 22, out  # TAEF2 reaches ~30 dB on this painting
    with Image.open(tmp_path / "rt" / "mona.png") as decoded:
        assert decoded.size == (64, 96)


def test_encode_then_decode_safetensors(capsys, image, tmp_path):
    latents_path = tmp_path / "mona.safetensors"
    code, _, _ = run(capsys, "encode", image, "-o", latents_path)
    assert code == 0
    latents, record = load_latents(latents_path)
    assert latents.shape == (1, 32, 12, 8)
    assert (record.variant, record.latent_channels, record.downscale, record.image_size, record.scale) == \
        ("taef2", 32, 8, (96, 64), "raw")

    code, out, _ = run(capsys, "decode", latents_path, "-o", tmp_path / "decoded.png")
    assert code == 0 and "64x96" in out
    with Image.open(tmp_path / "decoded.png") as decoded:
        assert decoded.size == (64, 96)


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_every_bundled_image_works_on_the_first_try(capsys, tmp_path, name):
    """None of the bundled images has sides that are multiples of 8: the first command a new user tries on one
    failed. They are padded by default, with a one-line note, and the decode is cropped back."""
    path = PHOTOS[name]
    with Image.open(path) as im:
        width, height = im.size
    assert width % 8 or height % 8
    code, out, err = run(capsys, "encode", path, "-o", tmp_path / "z.safetensors")
    assert code == 0, err
    note = (f"taesd-fast: note: {path} is {width}x{height}, not a multiple of 8 on each side: padded to "
            f"{-(-width // 8) * 8}x{-(-height // 8) * 8} by repeating its edge pixels, and cropped back to its size "
            "after decoding (--no-pad makes this an error)\n")
    assert err.startswith(note) and "taesd-fast:" not in err[len(note):], err  # a progress bar may follow
    latents, record = load_latents(tmp_path / "z.safetensors")
    assert latents.shape[-2:] == (-(-height // 8), -(-width // 8)) and record.image_size == (height, width)


def test_roundtrip_of_the_bundled_painting_keeps_its_size(capsys, tmp_path):
    code, out, err = run(capsys, "roundtrip", PHOTOS["monalisa"], "-o", tmp_path / "rt")
    assert code == 0 and "PSNR" in out and err.count("taesd-fast: note: ") == 1, err
    with Image.open(tmp_path / "rt" / "monalisa.png") as decoded:
        assert decoded.size == (300, 447)


def test_a_command_that_fails_prints_its_error_alone(capsys, odd_image, tmp_path):
    """The padding note comes only once every check has passed: a failed command prints one line."""
    (tmp_path / "rt").mkdir()
    (tmp_path / "rt" / "odd.png").write_bytes(b"an earlier result")
    code, _, err = run(capsys, "roundtrip", odd_image, "-o", tmp_path / "rt")
    assert_user_error(code, err, "already exists")


def test_no_pad_makes_an_image_not_a_multiple_of_8_an_error(capsys, odd_image, tmp_path):
    for command in ("encode", "roundtrip"):
        code, _, err = run(capsys, command, odd_image, "-o", tmp_path / "out", "--no-pad")
        assert_user_error(code, err, "70x90", "not a multiple of 8", "leave out --no-pad")
    assert not (tmp_path / "out").exists()


def test_pad_keeps_the_original_size_without_a_note(capsys, odd_image, tmp_path):
    code, out, err = run(capsys, "roundtrip", odd_image, "-o", tmp_path / "rt", "--pad")
    assert code == 0 and "PSNR" in out and "note" not in err  # asked for: nothing to point out
    with Image.open(tmp_path / "rt" / "odd.png") as decoded:
        assert decoded.size == (70, 90)

    # encode --pad stores the original size; decode crops back to it.
    assert run(capsys, "encode", odd_image, "-o", tmp_path / "odd.safetensors", "--pad")[0] == 0
    latents, record = load_latents(tmp_path / "odd.safetensors")
    assert latents.shape[-2:] == (12, 9) and record.image_size == (90, 70)
    assert run(capsys, "decode", tmp_path / "odd.safetensors", "-o", tmp_path / "decoded.png")[0] == 0
    with Image.open(tmp_path / "decoded.png") as decoded:
        assert decoded.size == (70, 90)


def test_missing_files_are_user_errors(capsys, tmp_path):
    missing = tmp_path / "missing.png"
    code, _, err = run(capsys, "roundtrip", missing, "-o", tmp_path / "out")
    assert_user_error(code, err, "not found", str(missing))
    code, _, err = run(capsys, "decode", tmp_path / "missing.safetensors", "-o", tmp_path / "out")
    assert_user_error(code, err, "latents file not found")
    code, _, err = run(capsys, "lipsync", tmp_path / "missing.mp4", "-o", tmp_path / "out.mp4")
    assert_user_error(code, err, "video not found")


def test_a_file_that_is_not_an_image_is_a_user_error(capsys, tmp_path):
    fake = tmp_path / "notes.png"
    fake.write_text("not an image")
    code, _, err = run(capsys, "encode", fake, "-o", tmp_path / "out")
    assert_user_error(code, err, "notes.png")


@pytest.fixture
def corrupt_latents(tmp_path) -> list[Path]:
    """A truncated .safetensors (the first 100 bytes of a good one) and a .pt whose bytes are no pickle."""
    good = tmp_path / "good.safetensors"
    save_latents(torch.randn(1, 32, 12, 8), good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:100])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x80\x02these bytes are no pickle")
    return [truncated, garbage]


def test_corrupt_latents_files_are_user_errors(capsys, corrupt_latents, tmp_path):
    for path in corrupt_latents:
        code, _, err = run(capsys, "decode", path, "-o", tmp_path / "out.png")
        assert_user_error(code, err, f"could not read latents file {path}", "corrupt or truncated")
    assert not (tmp_path / "out.png").exists()


def test_lipsync_with_corrupt_latents_is_a_user_error(capsys, corrupt_latents, tmp_path):
    pytest.importorskip("av")
    code, _, err = run(capsys, "lipsync", "-o", tmp_path / "out.mp4", "--latents", corrupt_latents[0])
    assert_user_error(code, err, f"could not read latents file {corrupt_latents[0]}", "corrupt or truncated")
    assert not (tmp_path / "out.mp4").exists()


def test_weights_errors_are_user_errors(capsys, image, tmp_path, hub_offline, no_network):
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--weights", tmp_path / "no" / "such")
    assert_user_error(code, err, "neither an existing local folder nor a Hub repo id")
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--weights", "madebyollin/taesd",
                       "--device", "cpu")
    assert_user_error(code, err, "could not find TAESD weights for repo 'madebyollin/taesd'")


def test_weights_folder_with_several_variants(capsys, image, tmp_path, taef2_encoder_pth, taef2_decoder_pth,
                                              taesana_encoder_pth):
    """A folder of downloads: the complete TAEF2 pair is taken over a lone taesana encoder; --variant picks one."""
    folder = tmp_path / "weights"
    folder.mkdir()
    for src in (taef2_encoder_pth, taef2_decoder_pth, taesana_encoder_pth):
        shutil.copyfile(src, folder / src.name)
    code, out, _ = run(capsys, "roundtrip", image, "-o", tmp_path / "rt", "--weights", folder, "--device", "cpu")
    assert code == 0 and "PSNR" in out
    code, _, _ = run(capsys, "encode", image, "-o", tmp_path / "z.safetensors", "--weights", folder,
                     "--variant", "taesana", "--device", "cpu")
    assert code == 0
    assert load_latents(tmp_path / "z.safetensors")[0].shape[1:] == (32, 3, 2)  # taesana: 96x64 / 32
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "rt2", "--weights", folder, "--variant", "taesd")
    assert_user_error(code, err, "no taesd weights in", "found: taef2, taesana")


def test_latents_png_needs_at_most_4_channels(capsys, image, tmp_path):
    code, _, err = run(capsys, "encode", image, "--png", "-o", tmp_path / "out")
    assert_user_error(code, err, "at most 4 latent channels", "taef2 has 32")


def test_latents_png_round_trip_with_4_channel_weights(capsys, image, odd_image, taesd4_weights, tmp_path):
    code, _, _ = run(capsys, "encode", image, odd_image, "--png", "--pad", "-o", tmp_path / "latents",
                     "--weights", taesd4_weights)
    assert code == 0
    with Image.open(tmp_path / "latents" / "mona.png") as png:
        assert png.mode == "RGBA" and png.size == (8, 12)
    code, _, _ = run(capsys, "decode", tmp_path / "latents" / "mona.png", tmp_path / "latents" / "odd.png",
                     "-o", tmp_path / "decoded", "--weights", taesd4_weights)
    assert code == 0
    for name, size in (("mona.png", (64, 96)), ("odd.png", (70, 90))):
        with Image.open(tmp_path / "decoded" / name) as decoded:
            assert decoded.size == size

    # The bundled 32-channel TAEF2 cannot decode taesd latents: the file says which model made them.
    code, _, err = run(capsys, "decode", tmp_path / "latents" / "mona.png", "-o", tmp_path / "x.png")
    assert_user_error(code, err, "made by taesd (4 latent channels", "loaded model is taef2",
                      "--weights madebyollin/taesd")


def test_decode_pt_with_several_latents_writes_numbered_images(capsys, tmp_path):
    torch.save({"latents": torch.randn(3, 32, 4, 4)}, tmp_path / "clip.pt")
    code, _, _ = run(capsys, "decode", tmp_path / "clip.pt", "-o", tmp_path / "frames")
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "frames").iterdir()) == [f"clip_000{i}.png" for i in range(3)]


def test_several_inputs_need_an_output_directory(capsys, image, tmp_path):
    code, _, err = run(capsys, "encode", image, image, "-o", tmp_path / "one.safetensors")
    assert_user_error(code, err, "2 inputs", "directory")


def test_lipsync_defaults_to_the_demo_clip(capsys, tmp_path):
    from taesd_fast.apps.facebox import DEMO_CLIP

    av = pytest.importorskip("av")
    code, out, _ = run(capsys, "lipsync", "-o", tmp_path / "demo.mp4", "--max-frames", "2", "--batch-size", "2")
    assert code == 0, out
    assert "decode:" in out and "end to end:" in out
    with av.open(str(DEMO_CLIP)) as clip, av.open(str(tmp_path / "demo.mp4")) as result:
        source, written = clip.streams.video[0], result.streams.video[0]
        assert (written.width, written.height, written.average_rate) == (source.width, source.height, 25)
        assert written.frames == 2


def _make_demo_argv() -> list[str]:
    """The arguments of the taesd-fast command that `make demo` runs, as make itself expands the recipe."""
    if shutil.which("make") is None:
        pytest.fail("`make` is needed: the README's two set-up commands are make targets")
    dry = subprocess.run(["make", "-n", "demo"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    (line,) = [line for line in dry.stdout.splitlines() if "taesd-fast lipsync" in line]
    return line.split()[1:]  # after the taesd-fast executable


def test_make_demo_succeeds_a_second_time(capsys, tmp_path, monkeypatch):
    """The second `make demo` stopped at 'output lipsync_demo.mp4 already exists'. The demo's output is its own: a
    second run replaces it (here with 2 frames, from a scratch folder, so the repository's file is not touched)."""
    av = pytest.importorskip("av")
    argv = _make_demo_argv()
    assert argv[0] == "lipsync" and "--latents" not in argv  # the round trip of the bundled clip (README)
    monkeypatch.chdir(tmp_path)
    for frames in ("2", "3"):
        code, out, err = run(capsys, *argv, "--max-frames", frames, "--batch-size", "2")
        assert code == 0, err
        with av.open(str(tmp_path / "lipsync_demo.mp4")) as result:
            assert result.streams.video[0].frames == int(frames)  # the second run's video, not the first's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lipsync_demo.mp4"]


@pytest.mark.parametrize("name", ["out.avi", "out.mkv", "out"])
def test_lipsync_output_must_be_mp4(capsys, tmp_path, name):
    pytest.importorskip("av")
    code, _, err = run(capsys, "lipsync", "-o", tmp_path / name, "--max-frames", "1")
    assert_user_error(code, err, f"-o {tmp_path / name}: expected an .mp4 file")
    assert not (tmp_path / name).exists()


def test_lipsync_box_outside_the_frame(capsys, tmp_path):
    from conftest import TALKING_HEAD_CLIP as video  # 576x768
    code, _, err = run(capsys, "lipsync", video, "-o", tmp_path / "out.mp4", "--box", "400,600,700,900")
    assert_user_error(code, err, "outside the 576x768 frame")
    code, _, err = run(capsys, "lipsync", video, "-o", tmp_path / "out.mp4", "--box", "1,2,3")
    assert_user_error(code, err, "four integers")


def test_info(capsys):
    code, out, _ = run(capsys, "info", "--device", "cpu")
    assert code == 0
    for line in ("taesd_fast ", "torch ", "device: cpu", "GPU: ", "kernels: ", "Triton kernels "):
        assert line in out
    assert re.search(r"^Triton kernels .*: unavailable \(.*cpu", out, re.M), out  # they run on CUDA only


def test_info_model_prints_the_dispatch_table(capsys):
    code, out, _ = run(capsys, "info", "--model", "--device", "cpu", "--backend", "auto")
    assert code == 0
    assert "model: taef2" in out and "dispatch mode=auto" in out
    # one row per conv layer that ran, with its choice (CPU: PyTorch)
    assert re.search(r"^decoder\.19\s+\S+\s+3x64x3x3\s+float32\s.*\storch\s", out, re.M), out


def test_bad_device_is_a_user_error(capsys):
    code, _, err = run(capsys, "info", "--device", "nonsense")
    assert_user_error(code, err, "--device nonsense is not a torch device")


def test_bench_forwards_its_arguments(capsys, monkeypatch):
    bench = pytest.importorskip("taesd_fast.apps.bench.cli")
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv=None, prog=None: seen.append((argv, prog)) or 0)
    assert main(["bench", "--sections", "conv", "--help"]) == 0
    assert seen == [(["--sections", "conv", "--help"], "taesd-fast bench")]


def test_bench_help_says_it_needs_a_cuda_gpu(capsys):
    pytest.importorskip("taesd_fast.apps.bench.cli")
    for argv in (["--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert "need a CUDA GPU" in " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


def test_bench_on_a_cpu_checks_its_arguments_first(capsys, monkeypatch):
    pytest.importorskip("taesd_fast.apps.bench.cli")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, even where a GPU is present
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--sections", "conv,bogus"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unknown sections ['bogus']" in err and "CUDA" not in err, err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--sections", "conv"])
    assert exit_info.value.code == 1
    assert "taesd-fast bench: error: needs a CUDA GPU" in capsys.readouterr().err
