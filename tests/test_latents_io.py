"""Latents files record the model and image behind them; decode refuses another model and crops the padding.

The always-running cases build a taesana-architecture model with random weights (the architecture, not the
values, decides the latents' layout); the real taesana encoder from ../shared adds one case when present.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

Image = pytest.importorskip("PIL.Image", reason="the CLI's image commands need Pillow (taesd_fast[media])")

from cli_helpers import random_weights_folder, run, small_image  # noqa: E402
from taesd_fast import TAESD, __version__  # noqa: E402
from taesd_fast.apps.latents_io import LatentsRecord, load_latents, save_latents, save_latents_png  # noqa: E402


@pytest.fixture(scope="module")
def taesana_folder(tmp_path_factory) -> Path:
    """taesana_encoder/_decoder.safetensors with random weights."""
    return random_weights_folder(tmp_path_factory.mktemp("taesana"), "taesana")


def test_taesana_latents_decoded_with_taef2_are_refused(capsys, tmp_path, taesana_folder):
    """The audit: latents encoded with taesana and decoded with the default TAEF2 gave a 120x176 garbage image."""
    image = small_image(tmp_path / "photo.png", 675, 450)  # the audit's size: not a multiple of 32
    latents_file = tmp_path / "photo.safetensors"
    code, _, err = run(capsys, "encode", image, "--pad", "-o", latents_file, "--weights", taesana_folder,
                       "--variant", "taesana")
    assert code == 0, err
    latents, record = load_latents(latents_file)
    assert latents.shape == (1, 32, 15, 22)  # ceil(450 / 32), ceil(675 / 32)
    assert record == LatentsRecord("taesana", 32, 32, (450, 675), "raw", __version__)

    code, _, err = run(capsys, "decode", latents_file, "-o", tmp_path / "decoded.png")  # the bundled TAEF2
    assert code == 1 and err.count("\n") == 1, err
    for fragment in ("made by taesana (32 latent channels, 32x downscale)", "the loaded model is taef2",
                     "--weights FOLDER --variant taesana", "github.com/madebyollin/taesd"):
        assert fragment in err, err
    assert "madebyollin/taesana" not in err  # not a Hub repo
    assert not (tmp_path / "decoded.png").exists()

    # With the model that made them: decoded and cropped back to the recorded 675x450.
    code, out, err = run(capsys, "decode", latents_file, "-o", tmp_path / "decoded.png", "--weights", taesana_folder,
                         "--variant", "taesana")
    assert code == 0, err
    assert "warning" not in err
    with Image.open(tmp_path / "decoded.png") as decoded:
        assert decoded.size == (675, 450)


def test_real_taesana_encoder_latents_refused_by_taef2(capsys, tmp_path, taesana_encoder_pth):
    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copyfile(taesana_encoder_pth, folder / taesana_encoder_pth.name)
    image = small_image(tmp_path / "photo.png", 96, 64)
    assert run(capsys, "encode", image, "-o", tmp_path / "z.safetensors", "--weights", folder)[0] == 0
    code, _, err = run(capsys, "decode", tmp_path / "z.safetensors", "-o", tmp_path / "z.png")
    assert code == 1 and "made by taesana" in err and "--variant taesana" in err, err


def test_files_without_a_record_decode_with_a_warning(capsys, tmp_path):
    z = torch.randn(1, 32, 4, 6)
    torch.save({"latents": z}, tmp_path / "plain.pt")
    from safetensors.torch import save_file

    save_file({"latents": z}, str(tmp_path / "plain.safetensors"))
    for name in ("plain.pt", "plain.safetensors"):
        assert load_latents(tmp_path / name)[1] is None
        code, out, err = run(capsys, "decode", tmp_path / name, "-o", tmp_path / f"{name}.png")
        assert code == 0, err
        assert err.count("\n") == 1 and err.startswith("taesd-fast: warning: "), err
        assert "does not record which model made it" in err and "decoding it as taef2 latents" in err
        with Image.open(tmp_path / f"{name}.png") as decoded:
            assert decoded.size == (48, 32)


def test_record_round_trips_through_safetensors_and_png(tmp_path):
    model = TAESD("taesd", encoder=False)
    record = LatentsRecord.for_model(model, (90, 70))
    z = torch.randn(1, 4, 12, 9) * 2  # within +-3 mostly; a PNG clips beyond
    save_latents(z, tmp_path / "z.safetensors", record)
    loaded, got = load_latents(tmp_path / "z.safetensors")
    assert torch.equal(loaded, z) and got == record

    save_latents_png(z, tmp_path / "z.png", record)
    loaded, got = load_latents(tmp_path / "z.png")
    assert got.scale == "scaled" and (got.variant, got.image_size, got.downscale) == ("taesd", (90, 70), 8)
    step = 6 / 255  # 8 bits over [-3, 3]
    assert (loaded - z.clamp(-3, 3)).abs().max().item() <= step / 2 + 1e-6


def test_a_record_that_contradicts_the_tensor_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"latents": torch.randn(1, 32, 4, 4)}, str(tmp_path / "a.safetensors"),
              metadata={"variant": "taef2", "latent_channels": "32", "downscale": "8", "image_height": "90",
                        "image_width": "70", "scale": "raw"})
    with pytest.raises(ValueError, match=r"metadata says a 70x90 image \(12x9 latents at 8x\) but the latents are 4x4"):
        load_latents(tmp_path / "a.safetensors")
    save_file({"latents": torch.randn(1, 32, 4, 4)}, str(tmp_path / "b.safetensors"),
              metadata={"variant": "taef2", "latent_channels": "many"})
    with pytest.raises(ValueError, match="metadata is damaged"):
        load_latents(tmp_path / "b.safetensors")


def test_lipsync_api_refuses_latents_of_another_model(tmp_path):
    pytest.importorskip("av")
    from taesd_fast.apps.facebox import DEMO_CLIP, SUN_FACE_BOX
    from taesd_fast.apps.lipsync import lipsync_video

    path = tmp_path / "faces.safetensors"
    save_latents(torch.randn(2, 32, 8, 8), path, LatentsRecord("taesana", 32, 32, (256, 256)))
    model = TAESD.from_pretrained(encoder=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the file has a record
        with pytest.raises(ValueError, match=r"made by taesana .* decode them with TAESD.from_pretrained\(FOLDER, "
                                             r"variant='taesana'\)"):
            lipsync_video(DEMO_CLIP, tmp_path / "out.mp4", model, box=SUN_FACE_BOX, latents=path, max_frames=2,
                          progress=False)
    assert not (tmp_path / "out.mp4").exists()
