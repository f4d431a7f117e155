"""Real TAEF2 / TAESANA weights on real photos, against the independent float64 reference (tests/reference_taesd.py).

Everything here runs from the repository alone: the TAEF2 weights are the bundled ones (written back into upstream's
.pth form by tests/conftest.py), the TAESANA encoder and three photos are in tests/data/. The reference reads the .pth
files with plain torch.load, so the package's own loading code is under test too.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import torch
from conftest import DATA_DIR, IMAGE_NAMES, psnr, rel_err
from reference_taesd import reference_decoder, reference_encoder
from safetensors.torch import load_file

from taesd_fast import TAESD

# fp32 CPU convolutions against float64: measured rel errors are ~1e-7 (encoder) to ~1e-6 (decoder); 1e-5 still
# catches any wrong layer, index, stride, padding or missing ReLU, which give O(1) errors.
REL_TOL_F32 = 1e-5

# (image, height, width): squares and non-squares, small enough for a 2-core CPU.
SIZES = [("monalisa", 128, 128), ("musk", 128, 192), ("sit", 96, 160), ("yongen", 64, 128)]


def _raw(path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def taef2(taef2_encoder_pth, taef2_decoder_pth) -> TAESD:
    model = TAESD.from_pretrained(encoder_path=taef2_encoder_pth, decoder_path=taef2_decoder_pth)
    assert model.variant == "taef2"
    assert model.latent_channels == 32 and model.downscale == 8
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not model.training
    return model


@pytest.fixture(scope="module")
def ref_encoder(taef2_encoder_pth):
    return reference_encoder(_raw(taef2_encoder_pth))


@pytest.fixture(scope="module")
def ref_decoder(taef2_decoder_pth):
    return reference_decoder(_raw(taef2_decoder_pth))


@pytest.mark.parametrize("name,height,width", SIZES)
def test_encode_decode_match_float64_reference(taef2, ref_encoder, ref_decoder, load_photo, name, height, width):
    image = load_photo(name, height, width)
    with torch.no_grad():
        latents = taef2.encode(image)
        raw = taef2.decoder(latents)  # before the [0, 1] clamp
        decoded = taef2.decode(latents)
    assert latents.shape == (1, 32, height // 8, width // 8) and latents.dtype == torch.float32
    assert raw.shape == decoded.shape == (1, 3, height, width)

    ref_latents = ref_encoder(image)
    ref_raw = ref_decoder(latents)  # decode the model's own latents, so decoder error is measured alone
    assert latents.std() > 0.3, "latents are degenerate; the comparison below would be meaningless"
    err_enc, err_dec = rel_err(latents, ref_latents), rel_err(raw, ref_raw)
    print(f"{name} {height}x{width}: encoder rel err {err_enc:.2e}, decoder rel err {err_dec:.2e}")
    assert err_enc < REL_TOL_F32
    assert err_dec < REL_TOL_F32
    assert (latents.double() - ref_latents).abs().max() < 1e-4
    assert (raw.double() - ref_raw).abs().max() < 1e-4
    # decode() is the raw decoder output clamped to [0, 1].
    torch.testing.assert_close(decoded, raw.clamp(0, 1), rtol=0, atol=0)


def test_batch_of_different_photos_matches_per_image_reference(taef2, ref_encoder, ref_decoder, load_photo):
    """GroupNorm in the TAEF2 pool branch must normalise per image, not across the batch."""
    batch = torch.cat([load_photo(n, 64, 96) for n in IMAGE_NAMES])
    with torch.no_grad():
        latents = taef2.encode(batch)
        raw = taef2.decoder(latents)
    for i in range(len(IMAGE_NAMES)):
        assert rel_err(latents[i : i + 1], ref_encoder(batch[i : i + 1])) < REL_TOL_F32
        assert rel_err(raw[i : i + 1], ref_decoder(latents[i : i + 1])) < REL_TOL_F32


def test_decoder_on_random_latents_beyond_the_soft_clamp(taef2, ref_decoder):
    """Latents of magnitude > 3 exercise the tanh(x/3)*3 soft clamp at decoder index 0."""
    gen = torch.Generator().manual_seed(1234)
    latents = torch.randn(2, 32, 8, 12, generator=gen) * 4
    assert latents.abs().max() > 6
    with torch.no_grad():
        raw = taef2.decoder(latents)
        decoded = taef2.decode(latents)
    assert rel_err(raw, ref_decoder(latents)) < REL_TOL_F32
    # Such latents decode partly outside [0, 1]; decode() clamps exactly those values.
    assert raw.min() < 0 and raw.max() > 1
    torch.testing.assert_close(decoded, raw.clamp(0, 1), rtol=0, atol=0)


def test_channels_last_input_matches_reference(taef2, ref_encoder, load_photo):
    image = torch.cat([load_photo("musk", 64, 64), load_photo("sit", 64, 64)])
    with torch.no_grad():
        latents = taef2.encode(image.contiguous(memory_format=torch.channels_last))
    assert rel_err(latents, ref_encoder(image)) < REL_TOL_F32


def test_gradients_match_reference(taef2, ref_encoder, ref_decoder, load_photo):
    """Autograd through encode and decode (e.g. a latent-space loss) gives the reference's gradients."""
    gen = torch.Generator().manual_seed(99)
    latents = (torch.randn(1, 32, 4, 6, generator=gen) * 2).requires_grad_()
    weights = torch.rand(1, 3, 32, 48, generator=gen)
    (taef2.decoder(latents) * weights).sum().backward()
    latents64 = latents.detach().double().requires_grad_()
    (ref_decoder(latents64) * weights.double()).sum().backward()
    assert latents.grad.abs().max() > 0
    assert rel_err(latents.grad, latents64.grad) < 1e-4

    image = load_photo("yongen", 32, 32).requires_grad_()
    taef2.encode(image).pow(2).sum().backward()
    image64 = image.detach().double().requires_grad_()
    ref_encoder(image64).pow(2).sum().backward()
    assert rel_err(image.grad, image64.grad) < 1e-4


def test_round_trip_psnr_on_real_photos(taef2, ref_decoder, load_photo):
    """The model really reconstructs: decode(encode(photo)) is close to the photo, and not to another photo."""
    photos = {name: load_photo(name, 256, 256) for name in IMAGE_NAMES}
    results = {}
    with torch.no_grad():
        for name, image in photos.items():
            results[name] = taef2.decode(taef2.encode(image))
    scores = {name: psnr(results[name], photos[name]) for name in IMAGE_NAMES}
    names = list(IMAGE_NAMES)
    mismatched = {f"{a} vs {b}": psnr(results[a], photos[b]) for a, b in zip(names, names[1:] + names[:1])}
    print("round-trip PSNR at 256x256 (dB):", {k: round(v, 2) for k, v in scores.items()})
    print("PSNR of a reconstruction against a different photo (dB):", {k: round(v, 2) for k, v in mismatched.items()})
    for name, score in scores.items():
        # A tiny autoencoder on real faces and a painting: well above 20 dB, and far from a lossless copy.
        assert 24 < score < 50, (name, score)
    assert max(mismatched.values()) < 16, mismatched


def test_taesana_encoder_matches_f32_reference(taesana_encoder_pth, load_photo):
    model = TAESD.from_pretrained(encoder_path=taesana_encoder_pth)
    assert model.variant == "taesana" and model.downscale == 32
    assert model.decoder is None
    ref = reference_encoder(_raw(taesana_encoder_pth))
    assert ref.layout[1] == "relu", "reference picked the f32 layout from the keys"
    image = torch.cat([load_photo("sit", 128, 192), load_photo("monalisa", 128, 192)])
    with torch.no_grad():
        latents = model.encode(image)
    assert latents.shape == (2, 32, 4, 6)
    assert latents.std() > 0.3
    err = rel_err(latents, ref(image))
    print(f"taesana encoder rel err {err:.2e}")
    assert err < REL_TOL_F32


def test_bundled_default_weights_load_exactly(taef2, taef2_encoder_pth, taef2_decoder_pth):
    """TAESD.from_pretrained() (offline, bundled safetensors) holds the file's tensors, widened to float32, and
    equals the model loaded from the same weights in upstream's .pth form."""
    default = TAESD.from_pretrained()
    assert default.variant == "taef2"
    for part, pth in (("encoder", taef2_encoder_pth), ("decoder", taef2_decoder_pth)):
        original = _raw(pth)
        loaded = getattr(default, part).state_dict()
        from_pth = getattr(taef2, part).state_dict()
        assert set(loaded) == set(original) == set(from_pth)
        for key, tensor in original.items():
            assert tensor.dtype == torch.float16 and loaded[key].dtype == torch.float32
            assert torch.equal(loaded[key], tensor.float()), key
            assert torch.equal(loaded[key], from_pth[key]), key


def _sha256_table(readme) -> dict[str, str]:
    """{relative path: sha256} from the sha256sum-style lines of a README."""
    lines = re.findall(r"^([0-9a-f]{64})  (\S+)$", readme.read_text(), re.MULTILINE)
    return {path: digest for digest, path in lines}


def test_bundled_test_data_checksums():
    """tests/data/README.md lists every real file the tests read, with the sha256 of the published copy."""
    table = _sha256_table(DATA_DIR / "README.md")
    names = {"musk.png", "sit.jpeg", "yongen.jpeg", "taesana_encoder.pth", "../../weights/taef2_encoder.safetensors",
             "../../weights/taef2_decoder.safetensors", "../../examples/assets/monalisa.jpg",
             "../../examples/assets/sun_3s.mp4"}
    assert set(table) == names
    for name, digest in table.items():
        assert hashlib.sha256((DATA_DIR / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.shared_extra
def test_bundled_safetensors_hold_the_published_pth_tensors_bit_for_bit(shared_dir):
    """The bundled weights/ files against the published upstream .pth files (in ../shared)."""
    from taesd_fast.models.taesd import hub

    for part in ("encoder", "decoder"):
        bundled = load_file(str(hub.BUNDLED_DIR / f"taef2_{part}.safetensors"))
        original = _raw(shared_dir / "weights" / f"taef2_{part}.pth")
        assert set(bundled) == set(original)
        for key, tensor in original.items():
            assert bundled[key].dtype == tensor.dtype and torch.equal(bundled[key], tensor), key


@pytest.mark.shared_extra
def test_bundled_taesana_encoder_is_the_published_file(shared_dir):
    published = shared_dir / "weights" / "taesana_encoder.pth"
    assert (DATA_DIR / "taesana_encoder.pth").read_bytes() == published.read_bytes()


def test_scale_and_unscale_latents_are_inverse(taef2, load_photo):
    with torch.no_grad():
        latents = taef2.encode(load_photo("yongen", 64, 64))
    scaled = TAESD.scale_latents(latents)
    assert scaled.min() >= 0 and scaled.max() <= 1
    inside = latents.abs() < 3  # scale_latents clamps outside [-3, 3]
    assert inside.float().mean() > 0.9
    torch.testing.assert_close(TAESD.unscale_latents(scaled)[inside], latents[inside], rtol=0, atol=1e-6)
    torch.testing.assert_close(scaled, (latents / 6 + 0.5).clamp(0, 1))
