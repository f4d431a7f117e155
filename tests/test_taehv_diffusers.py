"""AutoencoderTinyWan against diffusers' Wan pipelines' use of AutoencoderKLWan.

The pipelines themselves need `transformers`, which the test environment lacks, so the tests (a) read the
installed pipelines' sources for every `vae.<attr>` / `vae.config.<key>` they use, (b) replay their decode and encode
call pattern line for line with diffusers' own VideoProcessor, and (c) compare shapes and conventions with a tiny
real AutoencoderKLWan.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from reference_taehv import published_keys, random_state_dict

from taesd_fast import TAEHV
from taesd_fast.models.taehv.diffusers import WAN21_MEAN, WAN21_STD, AutoencoderTinyWan

diffusers = pytest.importorskip("diffusers", reason="the adapter's tests compare with diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402
from diffusers.video_processor import VideoProcessor  # noqa: E402

PIPELINES = Path(diffusers.__file__).parent / "pipelines" / "wan"


@pytest.fixture(scope="module")
def w22():
    taehv = TAEHV.from_state_dict(random_state_dict(published_keys(48, 2), seed=7), variant="taew2_2")
    return AutoencoderTinyWan(taehv)


@pytest.fixture(scope="module")
def w21():
    taehv = TAEHV.from_state_dict(random_state_dict(published_keys(16, 1), seed=8), variant="taew2_1")
    return AutoencoderTinyWan(taehv)


def test_every_attribute_the_pipelines_read_exists(w22):
    sources = "\n".join(p.read_text() for p in PIPELINES.glob("pipeline_wan*.py"))
    config_keys = set(re.findall(r"vae\.config\.(\w+)", sources))
    attributes = set(re.findall(r"self\.vae\.(\w+)", sources)) - {"config"}
    assert {"z_dim", "latents_mean", "latents_std", "scale_factor_temporal"} <= config_keys  # the scan works
    assert {k for k in config_keys if k not in w22.config} == set()
    assert {a for a in attributes if not hasattr(w22, a)} == set()
    assert w22.config.scale_factor_spatial == 16 and w22.config.scale_factor_temporal == 4 and w22.config.z_dim == 48


def test_wan21_statistics_are_autoencoderklwans_defaults():
    config = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).config
    assert list(config.latents_mean) == WAN21_MEAN and list(config.latents_std) == WAN21_STD


def test_decode_undoes_the_pipelines_denormalisation(w22, monkeypatch):
    """pipeline_wan.py's lines after the denoising loop, with our VAE, give TAEHV's decode of the transformer's
    latents (so the de-normalisation is undone), mapped to [0, 1] by diffusers' VideoProcessor."""
    vae = w22
    latents = torch.randn(1, 48, 3, 2, 3, generator=torch.Generator().manual_seed(0))  # the transformer's output
    seen = []
    real_decode = vae.taehv.decode_video
    monkeypatch.setattr(vae.taehv, "decode_video", lambda z, **kw: seen.append(z) or real_decode(z, **kw))
    # --- as in WanPipeline.__call__ (output_type != "latent")
    lat = latents.to(vae.device, dtype=vae.dtype)
    latents_mean = (torch.tensor(vae.config.latents_mean)
                    .view(1, vae.config.z_dim, 1, 1, 1).to(lat.device, lat.dtype))
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
        lat.device, lat.dtype)
    lat = lat / latents_std + latents_mean
    video = vae.decode(lat, return_dict=False)[0]
    frames = VideoProcessor(vae_scale_factor=vae.config.scale_factor_spatial).postprocess_video(video, output_type="pt")
    # ---
    torch.testing.assert_close(seen[0], latents.transpose(1, 2), rtol=0, atol=1e-6)
    expected = real_decode(latents.transpose(1, 2))  # [N, T, 3, H, W] in [0, 1]
    assert video.shape == (1, 3, 9, 32, 48) and video.min() >= -1 and video.max() <= 1
    assert frames.shape == expected.shape
    torch.testing.assert_close(frames, expected, rtol=0, atol=1e-6)
    assert torch.equal(vae.decode(lat).sample, video)


def test_encode_gives_what_the_pipelines_normalise(w22):
    """pipeline_wan_i2v.py's prepare_latents: retrieve_latents(vae.encode(video), sample_mode="argmax"), then
    (x - mean) * (1 / std), gives TAEHV's own latents."""
    vae = w22
    video = torch.rand(1, 3, 9, 32, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1  # NCTHW, [-1, 1]
    out = vae.encode(video)
    latent_condition = out.latent_dist.mode()  # retrieve_latents' argmax branch
    assert torch.equal(out.latent_dist.sample(torch.Generator()), latent_condition)
    assert torch.equal(out.latents, latent_condition)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    normalised = (latent_condition - latents_mean) * latents_std
    expected = vae.taehv.encode_video(video.transpose(1, 2).add(1).div(2)).transpose(1, 2)
    assert normalised.shape == (1, 48, 3, 2, 4)
    torch.testing.assert_close(normalised, expected, rtol=1e-5, atol=1e-5)


def test_encode_warns_for_video_outside_its_own_range(w21):
    """The adapter takes [-1, 1]: 0-255 frames get the [-1, 1] advice, once (not TAEHV's [0, 1] advice as well)."""
    import warnings

    video = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match=r"video frames range over .* expects \[-1, 1\]: looks like 0-255 pixel "
                                         r"values; use x / 127\.5 - 1") as record:
        w21.encode(video * 255)
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w21.encode(video * 2 - 1)


def test_same_shapes_and_conventions_as_autoencoderklwan(w21):
    real = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
    video = torch.rand(1, 3, 9, 32, 32) * 2 - 1
    with torch.no_grad():
        ref_latents = real.encode(video).latent_dist.mode()
        ref_video = real.decode(ref_latents, return_dict=False)[0]
    latents = w21.encode(video).latent_dist.mode()
    decoded = w21.decode(latents, return_dict=False)[0]
    assert latents.shape == ref_latents.shape == (1, 16, 3, 4, 4)
    assert decoded.shape == ref_video.shape == (1, 3, 9, 32, 32)
    assert decoded.min() >= -1 and decoded.max() <= 1
    assert w21.config.scale_factor_spatial == real.config.scale_factor_spatial
    assert w21.config.scale_factor_temporal == real.config.scale_factor_temporal
    assert 2 ** sum(w21.temperal_downsample) == 4 and 2 ** len(w21.temperal_downsample) == 8


def test_vae_config_and_errors(w22):
    taehv = w22.taehv
    config = {"z_dim": 48, "latents_mean": [0.0] * 48, "latents_std": [2.0] * 48}
    custom = AutoencoderTinyWan.for_vae_config(taehv, config)
    assert custom.config.latents_std == [2.0] * 48
    with pytest.raises(ValueError, match="z_dim=16 but taew2_2 has 48 latent channels"):
        AutoencoderTinyWan.for_vae_config(taehv, {"z_dim": 16})
    with pytest.raises(ValueError, match=r"must have 48 channels at dim 1 \(NCTHW\).*looks NTCHW"):
        w22.decode(torch.randn(1, 2, 48, 2, 3))
    other = TAEHV.from_state_dict(random_state_dict(published_keys(32, 2), seed=9))
    with pytest.raises(ValueError, match="not a Wan TAEHV"):
        AutoencoderTinyWan(other)
