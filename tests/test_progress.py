"""Progress bars for long encodes and decodes (taesd_fast.models.taesd.progress): a 3072² CPU roundtrip ran 145 s
with no output. Each call counts its layers, tile by tile, and the CLI counts the images of a folder; bars appear
only after progress.DELAY seconds, which these tests set to 0."""

from __future__ import annotations

import pytest
import torch

from taesd_fast import TAESD
from taesd_fast.models.taesd import progress


@pytest.fixture(scope="module")
def taef2():
    return TAESD.from_pretrained()


@pytest.fixture
def no_delay(monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 0)


def _hook_count(layers) -> tuple[list, list]:
    calls = []
    return calls, [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in progress.counted_layers(layers)]


@pytest.mark.parametrize("tile", [None, 144], ids=["untiled", "tiled"])
@pytest.mark.parametrize("part", ["encoder", "decoder"])
def test_the_planned_count_is_the_count_of_layers_run(taef2, part, tile):
    """The bar's total (layer_calls) equals the layers actually run, so a finished call reads N/N."""
    x = torch.rand(1, 3, 320, 160) if part == "encoder" else torch.randn(1, 32, 40, 20)
    overlap = 72 if tile else 0  # TAEF2's receptive field, in image pixels, for either part
    total, windows = progress.layer_calls(taef2, part, x, tile, overlap)
    calls, handles = _hook_count(getattr(taef2, part))
    try:
        with torch.inference_mode():
            (taef2.encode if part == "encoder" else taef2.decode)(x, tile_size=tile)
    finally:
        for handle in handles:
            handle.remove()
    assert len(calls) == total
    assert windows == (1 if tile is None else 3 * 2)  # 40 x 20 latent cells in cores of 18


def test_a_bar_is_shown_only_when_asked(taef2, capsys, no_delay):
    x = torch.rand(1, 3, 64, 64)
    with torch.inference_mode():
        taef2.encode(x)
        assert capsys.readouterr().err == ""
        taef2.decode(taef2.encode(x, tile_size=256, progress=True), progress=True)
    err = capsys.readouterr().err
    assert "encode:" in err and "/15 " in err and "layer" in err and "decode:" in err, err
    assert not any(layer._forward_hooks for layer in taef2.encoder)  # the hooks are gone


def test_the_cli_shows_tiles_and_the_images_of_a_folder(capsys, tmp_path, no_delay):
    pytest.importorskip("PIL")
    from cli_helpers import run, small_image

    for name in ("a", "b"):
        small_image(tmp_path / "in" / f"{name}.png", 160, 160)
    code, out, err = run(capsys, "roundtrip", tmp_path / "in", "-o", tmp_path / "out", "--tile", "144")
    assert code == 0, err
    assert "roundtrip:" in err and "/2 " in err and "image" in err, err  # the folder
    assert "encode (4 tiles):" in err and "decode (4 tiles):" in err, err  # the tiles of each image
    assert out.count("PSNR") == 2  # the per-image lines still print, above the bars
