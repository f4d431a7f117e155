"""--tile SIZE|auto on encode, decode and roundtrip: passed to the model as tile_size (image pixels), with the
same result as untiled."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image", reason="the CLI's image commands need Pillow (taesd_fast[media])")

from cli_helpers import run, small_image  # noqa: E402
from taesd_fast import TAESD  # noqa: E402
from taesd_fast.apps.cli import main  # noqa: E402
from taesd_fast.apps.latents_io import load_latents  # noqa: E402


@pytest.fixture
def image(tmp_path) -> Path:
    return small_image(tmp_path / "mona.png", 96, 128)


def ok(capsys, *argv) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 0, err


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im).astype(np.int16)


def test_tiled_encode_and_decode_match_untiled(capsys, image, tmp_path):
    ok(capsys, "encode", image, "-o", tmp_path / "whole.safetensors")
    ok(capsys, "encode", image, "-o", tmp_path / "tiled.safetensors", "--tile", "64")
    whole, tiled = load_latents(tmp_path / "whole.safetensors")[0], load_latents(tmp_path / "tiled.safetensors")[0]
    assert whole.shape == tiled.shape == (1, 32, 16, 12)
    assert (whole - tiled).abs().max().item() <= 1e-4 * whole.abs().max().item()

    ok(capsys, "decode", tmp_path / "whole.safetensors", "-o", tmp_path / "whole.png")
    ok(capsys, "decode", tmp_path / "whole.safetensors", "-o", tmp_path / "tiled.png", "--tile", "64")
    assert np.abs(pixels(tmp_path / "whole.png") - pixels(tmp_path / "tiled.png")).max() <= 1  # 8-bit rounding


def test_tile_auto_is_passed_through(capsys, image, tmp_path, monkeypatch):
    seen = []
    encode, decode = TAESD.encode, TAESD.decode

    def spy(original):
        def call(self, x, tile_size=None, progress=False):
            seen.append(tile_size)
            return original(self, x)  # untiled: this test is about the option, not the tiling

        return call

    monkeypatch.setattr(TAESD, "encode", spy(encode))
    monkeypatch.setattr(TAESD, "decode", spy(decode))
    ok(capsys, "roundtrip", image, "-o", tmp_path / "rt", "--tile", "auto")
    ok(capsys, "encode", image, "-o", tmp_path / "z.safetensors", "--tile", "AUTO")
    ok(capsys, "decode", tmp_path / "z.safetensors", "-o", tmp_path / "z.png", "--tile", "256")
    ok(capsys, "roundtrip", image, "-o", tmp_path / "rt2")  # auto is the default: tiles only when memory is short
    assert seen == ["auto", "auto", "auto", 256, "auto", "auto"]


def test_a_tile_too_small_is_raised_with_one_warning_per_command(capsys, image, tmp_path):
    """roundtrip warned twice (encode and decode each raised the tile)."""
    code, _, err = run(capsys, "roundtrip", image, "-o", tmp_path / "rt", "--tile", "64")
    assert code == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == ["taesd-fast: warning: --tile 64 is too small to tile efficiently: each tile runs with 72 extra "
                        "pixels on every side, so a tile under 144 px spends most of its time on that border; using "
                        "--tile 144"], err


@pytest.mark.parametrize("value", ["big", "0", "-32", "3.5"])
def test_bad_tile_values_are_usage_errors(capsys, image, tmp_path, value):
    with pytest.raises(SystemExit) as info:
        main(["encode", str(image), "-o", str(tmp_path / "z.safetensors"), "--tile", value])
    assert info.value.code == 2
    assert "--tile" in capsys.readouterr().err
    assert not (tmp_path / "z.safetensors").exists()


def test_tile_the_model_refuses_is_a_one_line_error(capsys, image, tmp_path):
    code = main(["encode", str(image), "-o", str(tmp_path / "z.safetensors"), "--tile", "30"])  # not a multiple of 8
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("taesd-fast: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "z.safetensors").exists()
