"""Errors a user can act on: every check asserts what the message says, not only the exception type."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from taesd_fast import TAEHV, TAESD, OutputHead
from taesd_fast.models.taesd import hub as hub_module
from taesd_fast.models.weights_io import WeightsError, to_diffusers


@pytest.fixture(scope="module")
def taef2() -> TAESD:
    return TAESD.from_pretrained()  # bundled weights, no network


@pytest.fixture(scope="module")
def head() -> OutputHead:
    return OutputHead(32, 12).eval()


def _images(*shape, dtype=torch.float32):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def _latents(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)


BUNDLED_ENCODER = hub_module.BUNDLED_DIR / "taef2_encoder.safetensors"
BUNDLED_DECODER = hub_module.BUNDLED_DIR / "taef2_decoder.safetensors"


# ------------------------------------------------------------------------------------------ tensor inputs


def test_encode_wrong_rank(taef2):
    with pytest.raises(ValueError, match=r"images must have 4 dims \[B, C, H, W\], got shape \(3, 64, 64\).*unsqueeze\(0\)"):
        taef2.encode(_images(3, 64, 64))
    with pytest.raises(ValueError, match=r"images must have 4 dims.*\(1, 1, 3, 64, 64\)"):
        taef2.encode(_images(1, 1, 3, 64, 64))


def test_decode_wrong_rank(taef2):
    with pytest.raises(ValueError, match=r"latents must have 4 dims.*\(32, 8, 8\).*unsqueeze\(0\)"):
        taef2.decode(_latents(32, 8, 8))


def test_encode_wrong_channels(taef2):
    with pytest.raises(ValueError, match=r"images must have 3 channels at dim 1, got shape \(1, 4, 64, 64\)"):
        taef2.encode(_images(1, 4, 64, 64))
    with pytest.raises(ValueError, match=r"3 channels.*\(1, 64, 64, 3\)"):  # channels-last numpy-style image
        taef2.encode(_images(1, 64, 64, 3))


def test_decode_wrong_channels(taef2):
    with pytest.raises(ValueError, match=r"latents must have 32 channels at dim 1, got shape \(1, 16, 8, 8\)"):
        taef2.decode(_latents(1, 16, 8, 8))


def test_encode_uint8(taef2):
    images = (_images(1, 3, 64, 64) * 255).to(torch.uint8)
    with pytest.raises(TypeError, match=r"images must be a floating point tensor \(torch\.float32.*torch\.uint8.*x\.float\(\) / 255"):
        taef2.encode(images)


def test_fp16_into_fp32_model(taef2):
    with pytest.raises(TypeError, match=r"images has dtype torch\.float16 but the model is torch\.float32.*\.to\(torch\.float32\)"):
        taef2.encode(_images(1, 3, 64, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"latents has dtype torch\.float16 but the model is torch\.float32"):
        taef2.decode(_latents(1, 32, 8, 8, dtype=torch.float16))


def test_not_a_tensor(taef2):
    with pytest.raises(TypeError, match=r"images must be a torch\.Tensor \[B, C, H, W\], got ndarray"):
        taef2.encode(_images(1, 3, 64, 64).numpy())


def test_wrong_device(taef2):
    # A meta tensor stands in for "another device" on a CPU-only machine.
    with pytest.raises(ValueError, match=r"images is on meta but the model is on cpu"):
        taef2.encode(torch.empty(1, 3, 64, 64, device="meta"))
    with pytest.raises(ValueError, match=r"latents is on meta but the model is on cpu"):
        taef2.decode(torch.empty(1, 32, 8, 8, device="meta"))


@pytest.mark.parametrize("size", [(60, 64), (64, 68), (7, 7)])
def test_encode_not_multiple_of_8(taef2, size):
    with pytest.raises(ValueError, match=rf"image size \({size[0]}, {size[1]}\) is not a multiple of 8.*pad or resize"):
        taef2.encode(_images(1, 3, *size))


def test_taesana_needs_multiple_of_32(taesana_encoder_pth):
    model = TAESD.from_pretrained(encoder_path=taesana_encoder_pth)
    with pytest.raises(ValueError, match=r"\(48, 64\) is not a multiple of 32 \(the taesana encoder downsamples 32x\)"):
        model.encode(_images(1, 3, 48, 64))


def test_head_wrong_inputs(head):
    good = _latents(1, 32, 2, 4, 4)
    with pytest.raises(ValueError, match=r"features must have 5 dims \[B, C, T, H, W\], got shape \(32, 2, 4, 4\).*unsqueeze\(0\)"):
        head(good[0])
    with pytest.raises(ValueError, match=r"features must have 32 channels at dim 1, got shape \(1, 16, 2, 4, 4\)"):
        head(_latents(1, 16, 2, 4, 4))
    with pytest.raises(TypeError, match=r"features has dtype torch\.float16 but the model is torch\.float32"):
        head(good.half())
    with pytest.raises(TypeError, match=r"features must be a floating point tensor.*torch\.int64"):
        head(good.long())
    with pytest.raises(ValueError, match=r"features is on meta but the model is on cpu"):
        head(torch.empty(1, 32, 2, 4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"activated features must have 32 channels"):
        head.forward_activated(_latents(1, 8, 2, 4, 4))


def test_head_input_missing_a_dimension_or_empty(head):
    frames = _latents(1, 32, 2, 4, 4)
    with pytest.raises(ValueError, match=r"got shape \(1, 32, 4, 4\) \(add a time dimension with \.unsqueeze\(2\)\)"):
        head(frames[:, :, 0])
    with pytest.raises(ValueError, match=r"features has an empty dimension: shape \(1, 32, 0, 4, 4\)"):
        head(frames[:, :, :0])
    with pytest.raises(TypeError, match=r"cache must be the tensor \[B, C, 2, H, W\].*got list"):
        head(frames, [frames])


def test_head_wrong_cache(head):
    x = _latents(1, 32, 4, 4, 4)
    with torch.no_grad():
        _, cache = head(x)
    with pytest.raises(ValueError, match=r"cache must be the \[B, C, 2, H, W\] tensor returned by the previous call.*\(1, 32, 1, 4, 4\)"):
        head(x, cache[:, :, :1])
    with pytest.raises(ValueError, match=r"cache must be.*torch\.float64"):
        head(x, cache.double())
    with pytest.raises(ValueError, match=r"cache must be.*\(1, 32, 2, 8, 8\)"):  # a cache from another resolution
        head(x, _latents(1, 32, 2, 8, 8))


def test_head_bad_construction():
    with pytest.raises(ValueError, match=r"out_channels=10 is not divisible by patch_size\*\*2=4"):
        OutputHead(32, 10, patch_size=2)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match=r"unknown TAESD variant 'taesd4'; expected one of taesd, taesdxl"):
        TAESD("taesd4")
    with pytest.raises(TypeError, match=r"dtype must be a floating point dtype.*torch\.int8"):
        TAESD.from_pretrained(dtype=torch.int8)
    with pytest.raises(TypeError, match=r"dtype must be a floating point dtype.*torch\.int8"):
        TAESD.from_pretrained(dtype="int8")
    with pytest.raises(ValueError, match=r"dtype='floaty' is not a torch dtype"):
        TAESD.from_pretrained(dtype="floaty")
    with pytest.raises(FileNotFoundError, match=r"only taef2 weights are bundled; for taesd, load "
                                                r"TAESD.from_pretrained\('madebyollin/taesd'\)"):
        TAESD.from_pretrained(variant="taesd")
    with pytest.raises(ValueError, match=r"unknown TAESD variant 'taef3'"):
        TAESD.from_pretrained(variant="taef3")


def test_bundled_only_suggestions_point_to_real_sources():
    """madebyollin/taesana is not a Hub repo: taesana (and taef2) weights are .pth files in the GitHub repo."""
    with pytest.raises(FileNotFoundError) as info:
        TAESD.from_pretrained(variant="taesana")
    message = str(info.value)
    assert "TAESD.from_pretrained(FOLDER, variant='taesana')" in message
    assert "taesana_decoder.pth from github.com/madebyollin/taesd" in message
    assert "madebyollin/taesana" not in message


@pytest.fixture
def cpu_only_torch(monkeypatch):
    """torch as a CPU-only build sees it, on any machine."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_on_a_cpu_only_torch_is_one_clear_error(cpu_only_torch):
    """Without the check, .to("cuda") fails deep in torch with AssertionError("Torch not compiled with CUDA")."""
    message = r"device='cuda' needs CUDA, but torch .* is a CPU-only build; install a CUDA build .* or use device='cpu'"
    with pytest.raises(RuntimeError, match=message):
        TAESD.from_pretrained(device="cuda")
    with pytest.raises(RuntimeError, match=message.replace("'cuda'", "'cuda:1'")):
        TAESD.from_pretrained(device=torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match=message):  # before the checkpoint is looked for
        OutputHead.from_pretrained("/nonexistent/wan_vae.safetensors", device="cuda")
    with pytest.raises(RuntimeError, match=message):  # before the file is looked for
        TAEHV.from_pretrained("/nonexistent/taew2_1.safetensors", device="cuda")


def test_cuda_build_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device='cuda' needs CUDA, but torch .* sees no CUDA device.*CUDA_VISIBLE"):
        TAESD.from_pretrained(device="cuda")


def test_device_that_is_not_a_device():
    with pytest.raises(ValueError, match=r"device='gpu' is not a torch device \(expected e.g. cpu, cuda, cuda:1\)"):
        TAESD.from_pretrained(device="gpu")


# ------------------------------------------------------------------------------------------ files and sources


def test_missing_files(tmp_path):
    missing = tmp_path / "taef2_encoder.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"weights file not found: {str(missing)}"):
        TAESD.from_pretrained(encoder_path=missing)
    with pytest.raises(FileNotFoundError, match=r"no TAESD weights in .*expected diffusion_pytorch_model\.safetensors"):
        TAESD.from_pretrained(tmp_path)  # an existing but empty folder
    with pytest.raises(FileNotFoundError, match=r"'\./nowhere/taesd' is neither an existing local (file or )?folder nor a Hub repo id"):
        TAESD.from_pretrained("./nowhere/taesd")
    with pytest.raises(FileNotFoundError, match=r"no diffusion_pytorch_model\.safetensors in"):
        OutputHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["/nonexistent/wan_vae.safetensors", "./Wan2.2_VAE.pth", "missing_folder/"])
def test_head_missing_local_path_is_reported_as_missing(name, no_network):
    """A path that does not exist must not be sent to the Hub as a repo id (HFValidationError about repo names)."""
    with pytest.raises(FileNotFoundError, match=re.escape(repr(name)) + r" is neither an existing local folder nor a Hub repo id.*no file or folder exists"):
        OutputHead.from_pretrained(name, local_files_only=True)


def test_single_file_as_name_or_path():
    with pytest.raises(ValueError, match=r"is a single file: pass encoder_path= and/or decoder_path= instead"):
        TAESD.from_pretrained(BUNDLED_ENCODER)
    with pytest.raises(ValueError, match=r"either name_or_path or encoder_path/decoder_path, not both"):
        TAESD.from_pretrained("madebyollin/taef2", encoder_path=BUNDLED_ENCODER)


def _truncated(src: Path, dst: Path, fraction: float) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: int(len(data) * fraction)])
    return dst


CORRUPT_MESSAGE = r"(?s)could not read weights file .*{name}.*corrupt, truncated or not a weights file"


@pytest.mark.parametrize("fraction", [0.5, 0.999])
def test_truncated_safetensors(tmp_path, fraction):
    bad = _truncated(BUNDLED_ENCODER, tmp_path / "taef2_encoder.safetensors", fraction)
    with pytest.raises(WeightsError, match=CORRUPT_MESSAGE.format(name="taef2_encoder.safetensors")):
        TAESD.from_pretrained(encoder_path=bad)


@pytest.mark.parametrize("fraction", [0.5, 0.999])
def test_truncated_pth(tmp_path, taef2_decoder_pth, fraction):
    bad = _truncated(taef2_decoder_pth, tmp_path / "taef2_decoder.pth", fraction)
    with pytest.raises(WeightsError, match=CORRUPT_MESSAGE.format(name="taef2_decoder.pth")):
        TAESD.from_pretrained(decoder_path=bad)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_random_bytes(tmp_path, suffix):
    bad = tmp_path / f"taef2_encoder{suffix}"
    # A leading pickle GLOBAL opcode ('c' or 0x93) would make the bytes read as a refused Python object instead.
    data = os.urandom(4096)
    bad.write_bytes((b"\x00" + data[1:]) if data[:1] in (b"c", b"\x93") else data)
    with pytest.raises(WeightsError, match=CORRUPT_MESSAGE.format(name=f"taef2_encoder\\{suffix}")) as err:
        TAESD.from_pretrained(encoder_path=bad)
    assert "weights_only" not in str(err.value)  # torch.load's advice to unpickle anyway is wrong for a damaged file


def test_truncated_file_in_hub_cache_and_folder(tmp_path):
    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copyfile(BUNDLED_ENCODER, folder / "taef2_encoder.safetensors")
    _truncated(BUNDLED_DECODER, folder / "taef2_decoder.safetensors", 0.3)
    with pytest.raises(WeightsError, match=CORRUPT_MESSAGE.format(name="taef2_decoder.safetensors")):
        TAESD.from_pretrained(folder)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (str(self.marker),))


def test_pth_with_pickled_code_is_refused_not_run(tmp_path):
    """weights_only loading: a .pth whose unpickling would call arbitrary code is rejected, and the code never runs."""
    marker = tmp_path / "code_ran"
    bad = tmp_path / "taef2_encoder.pth"
    torch.save({"0.weight": torch.zeros(1), "payload": _RunsCodeWhenUnpickled(marker)}, bad)
    assert not marker.exists()
    with pytest.raises(WeightsError, match=r"taef2_encoder\.pth holds Python objects other than tensors; they were not unpickled"):
        TAESD.from_pretrained(encoder_path=bad)
    assert not marker.exists()


def test_pth_that_is_not_a_state_dict(tmp_path):
    bad = tmp_path / "taef2_encoder.pth"
    torch.save({"0.weight": torch.ones(2), "step": 3}, bad)
    with pytest.raises(WeightsError, match=r"does not hold a flat state_dict of tensors"):
        TAESD.from_pretrained(encoder_path=bad)


def test_diffusers_config_of_another_class(tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    save_file(to_diffusers({"0.weight": torch.ones(1)}, None), str(folder / "diffusion_pytorch_model.safetensors"))
    (folder / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    with pytest.raises(WeightsError, match=r"config\.json describes a AutoencoderKL, not an AutoencoderTiny"):
        TAESD.from_pretrained(folder)


def test_diffusers_file_with_foreign_keys(tmp_path):
    folder = tmp_path / "vae"
    folder.mkdir()
    save_file({"decoder.conv_in.weight": torch.ones(2)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(WeightsError, match=r"unexpected key 'decoder\.conv_in\.weight' in a diffusers AutoencoderTiny"):
        TAESD.from_pretrained(folder)


# ------------------------------------------------------------------------------------------ wrong variants


def test_taesana_encoder_requested_as_taef2(taesana_encoder_pth):
    with pytest.raises(WeightsError, match=r"requested variant 'taef2' \(32 latent channels, midblock GN\) disagrees with "
                       r"the weights in .*taesana_encoder\.pth, which are 32 latent channels, f32 layout"):
        TAESD.from_pretrained(encoder_path=taesana_encoder_pth, variant="taef2")


def test_taef2_weights_into_a_taesd_model(taef2_encoder_pth, taef2_decoder_pth):
    model = TAESD("taesd")
    enc = torch.load(taef2_encoder_pth, weights_only=True)
    dec = torch.load(taef2_decoder_pth, weights_only=True)
    with pytest.raises(WeightsError, match=r"encoder weights from my.pth do not fit a TAESD encoder with 4 latent channels: "
                       r".*unexpected keys \(e\.g\. 11\.pool\.0\.weight.*shape mismatches \(e\.g\. 14\.bias: \(32,\) vs \(4,\)"):
        model.load_weights(enc, None, source="my.pth")
    with pytest.raises(WeightsError, match=r"decoder weights from state dict do not fit a TAESD decoder.*1\.weight: \(64, 32, 3, 3\) vs \(64, 4, 3, 3\)"):
        model.load_weights(None, dec)


def test_file_named_for_another_variant(tmp_path):
    """TAEF2 tensors in files named taesd_*: the name and the tensors disagree, and the message says both."""
    folder = tmp_path / "weights"
    folder.mkdir()
    shutil.copyfile(BUNDLED_ENCODER, folder / "taesd_encoder.safetensors")
    with pytest.raises(WeightsError, match=r"name 'taesd' \(4 latent channels\) disagrees with the weights in .*taesd_encoder\.safetensors, which are 32 latent channels, midblock GN"):
        TAESD.from_pretrained(folder)


def test_encoder_and_decoder_files_swapped(taef2_encoder_pth, taef2_decoder_pth):
    with pytest.raises(WeightsError, match=r"the encoder weights from .*taef2_decoder\.pth are decoder weights \(they "
                       r"fit a TAESD decoder with 32 latent channels, midblock GN\); were the encoder and decoder files swapped"):
        TAESD.from_pretrained(encoder_path=taef2_decoder_pth, decoder_path=taef2_encoder_pth)


def test_encoder_and_decoder_of_different_variants(taesana_encoder_pth, taef2_decoder_pth):
    with pytest.raises(WeightsError, match=r"encoder weights from .*taesana_encoder\.pth fit 32 latent channels, f32 "
                       r"layout but the decoder weights from .*taef2_decoder\.pth fit 32 latent channels, midblock GN: "
                       r"the encoder and decoder come from different TAESD variants"):
        TAESD.from_pretrained(encoder_path=taesana_encoder_pth, decoder_path=taef2_decoder_pth)


def test_weights_of_no_published_architecture(tmp_path):
    path = tmp_path / "half_encoder.safetensors"
    state = load_file(str(BUNDLED_ENCODER))
    del state["13.pool.3.weight"]
    save_file(state, str(path))
    with pytest.raises(WeightsError, match=r"the encoder weights from .*half_encoder\.safetensors match no published TAESD "
                       r"architecture.*against the closest, 32 latent channels, midblock GN: 1 missing keys \(e\.g\. "
                       r"13\.pool\.3\.weight\)"):
        TAESD.from_pretrained(encoder_path=path)


def test_loading_into_a_model_without_that_part():
    model = TAESD("taef2", decoder=False)
    with pytest.raises(ValueError, match=r"this TAESD was built without a decoder; cannot load decoder weights"):
        model.load_weights(None, load_file(str(BUNDLED_DECODER)))


# ------------------------------------------------------------------------------------------ hub cache misses


def test_offline_cache_miss_names_repo_and_files(tmp_path, no_network):
    with pytest.raises(FileNotFoundError) as info:
        TAESD.from_pretrained("madebyollin/taesd", cache_dir=tmp_path / "empty", local_files_only=True)
    message = str(info.value)
    assert "'madebyollin/taesd'" in message and "offline" in message
    for name in ("diffusion_pytorch_model.safetensors", "taesd_encoder.safetensors", "taesd_decoder.safetensors",
                 "taesd_encoder.pth", "taesd_decoder.pth"):
        assert name in message, (name, message)
    assert "pass local paths" in message


def test_offline_env_cache_miss(tmp_path, no_network, hub_offline):
    with pytest.raises(FileNotFoundError, match=r"'madebyollin/taesdxl'.*offline.*taesdxl_encoder\.safetensors"):
        TAESD.from_pretrained("madebyollin/taesdxl", cache_dir=tmp_path / "empty")


def test_offline_cache_miss_with_revision_and_subfolder(tmp_path, no_network):
    with pytest.raises(FileNotFoundError, match=r"'org/pipeline' \(subfolder 'vae'\) at revision 'v2'.*tried: diffusion_pytorch_model"):
        TAESD.from_pretrained("org/pipeline", subfolder="vae", revision="v2", cache_dir=tmp_path, local_files_only=True)


# ------------------------------------------------------------------------------------------ one-sided models


def test_decode_on_encoder_only_model():
    model = TAESD.from_pretrained(decoder=False)
    with pytest.raises(RuntimeError, match=r"this TAESD model has no decoder \(it was loaded encoder-only\), so it cannot decode"):
        model.decode(_latents(1, 32, 8, 8))


def test_encode_on_decoder_only_model():
    model = TAESD.from_pretrained(encoder=False)
    with pytest.raises(RuntimeError, match=r"this TAESD model has no encoder \(it was loaded decoder-only\), so it cannot encode"):
        model.encode(_images(1, 3, 64, 64))


# ------------------------------------------------------------------------------------------ NaN propagation


def test_nan_latents_give_nan_images_not_clamped_values(taef2):
    latents = _latents(1, 32, 8, 8)
    latents[0, 5, 3, 4] = float("nan")
    with torch.no_grad():
        images = taef2.decode(latents)
        raw = taef2.decoder(latents)
    assert images.isnan().any(), "decode() hid a NaN latent behind the [0, 1] clamp"
    assert torch.equal(images.isnan(), raw.isnan())
    # The NaN reaches the pixels above the bad latent (TAEF2's GroupNorm then spreads it through the whole image).
    assert images[0, :, 24:40, 32:40].isnan().all()


def test_nan_images_give_nan_latents(taef2):
    images = _images(1, 3, 64, 64)
    images[0, 1, 10, 10] = float("nan")
    with torch.no_grad():
        latents = taef2.encode(images)
    assert latents[0, :, 1, 1].isnan().all()


def test_nan_features_propagate_through_head(head):
    x = _latents(1, 32, 2, 4, 4)
    x[0, 3, 1, 2, 2] = float("nan")
    with torch.no_grad():
        out, _ = head(x)
    assert out[0, :, 1, 2:6, 2:6].isnan().all()  # clamp(-1, 1) does not turn NaN into a number
    assert not out[0, :, 0].isnan().any()  # causal: the earlier frame is untouched
