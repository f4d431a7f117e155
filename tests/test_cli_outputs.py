"""The CLI never writes over a file it reads, never over an existing file without --overwrite, checks every output
before writing any, and writes each output whole or not at all (taesd_fast.apps.output_files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

Image = pytest.importorskip("PIL.Image", reason="the CLI's image commands need Pillow (taesd_fast[media])")

from cli_helpers import assert_user_error, run, small_image  # noqa: E402
from taesd_fast.apps.output_files import atomic_write, check_outputs  # noqa: E402


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def folder(tmp_path) -> Path:
    small_image(tmp_path / "d" / "x.png", 70, 90)  # not a multiple of 8: --pad
    return tmp_path / "d"


@pytest.mark.parametrize("spelling", ["d", "d/", "./d", "d/.", "absolute", "symlink"])
def test_roundtrip_into_the_input_folder_refuses_to_replace_the_input(capsys, folder, monkeypatch, spelling):
    """The audit: `roundtrip d/x.png --pad -o d` replaced d/x.png by its lossy reconstruction."""
    monkeypatch.chdir(folder.parent)
    out = {"absolute": str(folder.resolve()), "symlink": "link"}.get(spelling, spelling)
    if spelling == "symlink":
        os.symlink(folder, "link")
    before = files_in(folder)
    for extra in ([], ["--overwrite"]):  # --overwrite allows replacing outputs, never inputs
        code, _, err = run(capsys, "roundtrip", "d/x.png", "--pad", "-o", out, *extra)
        assert_user_error(code, err, "is the input d/x.png", "refusing to overwrite an input")
    assert files_in(folder) == before


def test_encode_then_decode_into_the_same_folder_keeps_the_image(capsys, folder):
    """The audit: `encode d/x.png -o d/` then `decode d/x.safetensors -o d/` replaced d/x.png."""
    image_bytes = (folder / "x.png").read_bytes()
    assert run(capsys, "encode", folder / "x.png", "--pad", "-o", f"{folder}/")[0] == 0
    assert (folder / "x.safetensors").is_file()
    # decode does not read x.png, so only the existing-output rule protects it: --overwrite must be asked for.
    code, _, err = run(capsys, "decode", folder / "x.safetensors", "-o", f"{folder}/")
    assert_user_error(code, err, f"output {folder}/x.png already exists; pass --overwrite")
    assert (folder / "x.png").read_bytes() == image_bytes


@pytest.mark.parametrize("link", [os.link, os.symlink], ids=["hard link", "symlink"])
def test_an_output_that_is_a_link_to_the_input_is_refused(capsys, tmp_path, link):
    image = small_image(tmp_path / "in.png")
    link(image, tmp_path / "alias.png")
    before = image.read_bytes()
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "alias.png", "--overwrite")
    assert_user_error(code, err, "alias.png is the input", "refusing to overwrite an input")
    assert image.read_bytes() == before


def test_an_existing_output_needs_overwrite(capsys, tmp_path):
    image = small_image(tmp_path / "in.png")
    out = tmp_path / "out" / "in.png"
    out.parent.mkdir()
    out.write_bytes(b"an earlier result")
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "out")
    assert_user_error(code, err, f"output {out} already exists", "--overwrite")
    assert out.read_bytes() == b"an earlier result"
    code, _, _ = run(capsys, "roundtrip", image, "-o", tmp_path / "out", "--overwrite")
    assert code == 0
    with Image.open(out) as written:
        assert written.size == (64, 96)
    assert sorted(p.name for p in out.parent.iterdir()) == ["in.png"]  # no temporary file left behind


def test_every_output_is_checked_before_any_is_written(capsys, tmp_path):
    first, second = small_image(tmp_path / "a.png"), small_image(tmp_path / "b.png")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "b.safetensors").write_bytes(b"keep me")
    code, _, err = run(capsys, "encode", first, second, "-o", tmp_path / "out")
    assert_user_error(code, err, "b.safetensors already exists")
    assert files_in(tmp_path / "out") == {"b.safetensors": b"keep me"}  # a.safetensors was not written either


def test_a_failed_write_leaves_the_previous_output_intact(capsys, tmp_path, monkeypatch):
    import taesd_fast.apps.media as media

    image = small_image(tmp_path / "in.png")
    out = tmp_path / "out.png"
    out.write_bytes(b"the good earlier result")

    def crash_half_way(images, path):
        Path(path).write_bytes(b"\x89PNG truncated")
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(media, "save_image", crash_half_way)
    code, _, err = run(capsys, "roundtrip", image, "-o", out, "--overwrite")
    assert_user_error(code, err, f"cannot write {out}: No space left on device")
    assert out.read_bytes() == b"the good earlier result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.png", "out.png"]  # the partial file is gone


def test_an_unwritable_output_is_a_one_line_error(capsys, tmp_path):
    """The audit: `encode x.png -o /sys/x.safetensors` printed a traceback."""
    image = small_image(tmp_path / "in.png")
    if not Path("/sys").is_dir():
        pytest.skip("no /sys on this system")
    code, out, err = run(capsys, "encode", image, "-o", "/sys/x.safetensors")
    assert_user_error(code, err, "cannot write /sys/x.safetensors: ")
    assert out == ""  # refused before encoding anything
    assert not Path("/sys/x.safetensors").exists()


@pytest.mark.skipif(os.name != "posix", reason="POSIX file permissions")
def test_a_read_only_folder_is_a_one_line_error(capsys, tmp_path):
    """A folder the user cannot write into. Root ignores permission bits, so as root the folder is made immutable
    (chattr +i) instead, which binds root too."""
    import shutil
    import subprocess

    image = small_image(tmp_path / "in.png")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    root = os.geteuid() == 0
    if root and (shutil.which("chattr") is None
                 or subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0):
        pytest.skip("running as root, where permission bits do not bind, and chattr +i is unavailable here")
    try:
        code, _, err = run(capsys, "encode", image, "-o", locked / "x.safetensors")
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        locked.chmod(0o700)
    reason = "Operation not permitted" if root else "Permission denied"
    assert_user_error(code, err, f"cannot write {locked / 'x.safetensors'}: {reason}")
    assert not (locked / "x.safetensors").exists()


def test_an_output_under_a_file_is_a_one_line_error(capsys, tmp_path):
    image = small_image(tmp_path / "in.png")
    code, _, err = run(capsys, "encode", image, "-o", tmp_path / "in.png" / "x.safetensors")
    assert_user_error(code, err, "is a file, not a folder")


def test_lipsync_never_writes_over_its_video(capsys, tmp_path):
    pytest.importorskip("av")
    from taesd_fast.apps.facebox import DEMO_CLIP

    video = tmp_path / "clip.mp4"
    video.write_bytes(DEMO_CLIP.read_bytes())
    os.symlink(video, tmp_path / "alias.mp4")
    for out in (video, tmp_path / "alias.mp4", tmp_path / "." / "clip.mp4"):
        code, _, err = run(capsys, "lipsync", video, "-o", out, "--overwrite", "--max-frames", "1")
        assert_user_error(code, err, "refusing to overwrite an input")
    assert video.read_bytes() == DEMO_CLIP.read_bytes()


def test_the_weights_the_command_reads_are_inputs_too(capsys, tmp_path, monkeypatch):
    """`encode -o DIR/taef2_encoder.safetensors --weights DIR --overwrite` replaced the weights it was reading; the
    bundled weights (no --weights) are as safe."""
    from taesd_fast.models.taesd import hub

    image = small_image(tmp_path / "in.png")
    folder = tmp_path / "w"
    folder.mkdir()
    for name in ("taef2_encoder.safetensors", "taef2_decoder.safetensors"):
        (folder / name).write_bytes((hub.BUNDLED_DIR / name).read_bytes())
    before = files_in(folder)
    for part in ("encoder", "decoder"):  # roundtrip reads both
        out = folder / f"taef2_{part}.safetensors"
        for extra in ([], ["--overwrite"]):
            code, _, err = run(capsys, "encode", image, "-o", out, "--weights", folder, *extra)
            assert_user_error(code, err, f"output {out} is the weights file {out}", "even with --overwrite")
    code, _, err = run(capsys, "roundtrip", image, "-o", folder / "taef2_decoder.png", "--weights", folder)
    assert code == 0, err  # a new file beside the weights is fine
    monkeypatch.setattr(hub, "BUNDLED_DIR", folder)  # the default weights, without touching the repository's copy
    code, _, err = run(capsys, "encode", image, "-o", folder / "taef2_encoder.safetensors", "--overwrite")
    assert_user_error(code, err, "is the weights file")
    assert {k: v for k, v in files_in(folder).items() if k in before} == before


def test_check_outputs_directly(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x")
    with pytest.raises(ValueError, match="two outputs would both be written"):
        check_outputs([], [tmp_path / "o.png", tmp_path / "sub" / ".." / "o.png"], overwrite=True)
    with pytest.raises(IsADirectoryError, match="is an existing folder"):
        check_outputs([], [tmp_path], overwrite=True)
    with pytest.raises(ValueError, match="is the input"):
        check_outputs([data, None], [tmp_path / "." / "data.bin"], overwrite=True)
    check_outputs([data], [tmp_path / "new" / "deeper" / "o.png"], overwrite=False)
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_atomic_write_replaces_in_one_step_with_a_normal_mode(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    with atomic_write(target) as partial:
        assert partial.parent == target.parent and partial.name.endswith(".txt") and partial != target
        partial.write_text("done")
    assert target.read_text() == "done"
    mask = os.umask(0)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask
    with pytest.raises(RuntimeError), atomic_write(target) as partial:
        partial.write_text("half")
        raise RuntimeError("writer failed")
    assert target.read_text() == "done" and [p.name for p in target.parent.iterdir()] == ["out.txt"]
