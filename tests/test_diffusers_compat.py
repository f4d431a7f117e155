"""AutoencoderTinyFast against diffusers' own AutoencoderTiny, the VAE calls a pipeline makes, and the Wan head patch.

diffusers' AutoencoderTiny has no midblock GroupNorm, so it cannot hold TAEF2: the comparisons against it use random
init with 4 and 16 latent channels; the real TAEF2 weights are checked against TAESD's own encode/decode.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import populate_hub_cache

from taesd_fast import TAESD, dispatch
from taesd_fast.models.taesd.diffusers import AutoencoderTinyFast, architecture_config
from taesd_fast.models.weights_io import WeightsError, to_diffusers

TOL = 1e-5  # fp32 CPU, same convolutions in the same order: measured differences are 0


@pytest.fixture(scope="module")
def diffusers():
    return pytest.importorskip("diffusers", reason="diffusers is not installed (pip install 'taesd_fast[diffusers]')")


def randomize_biases(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return module


def reference_tiny(diffusers, latent_channels: int, seed: int = 0):
    torch.manual_seed(seed)
    return randomize_biases(diffusers.AutoencoderTiny(latent_channels=latent_channels), seed).eval()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def taef2() -> AutoencoderTinyFast:
    return AutoencoderTinyFast.from_pretrained()  # bundled real TAEF2 weights


# ------------------------------------------------------------------------------ against diffusers' AutoencoderTiny


@pytest.mark.parametrize("latent_channels, variant", [(4, "taesd"), (16, "taesd3")])
def test_from_diffusers_matches_autoencoder_tiny(diffusers, latent_channels, variant):
    ref = reference_tiny(diffusers, latent_channels)
    fast = AutoencoderTinyFast.from_diffusers(ref)
    assert fast.taesd.variant == variant
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(1)) * 2 - 1
    z = torch.randn(2, latent_channels, 8, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert close(fast.encode(images).latents, ref.encode(images).latents)
        assert close(fast.encode(images, return_dict=False)[0], ref.encode(images, return_dict=False)[0])
        assert close(fast.decode(z).sample, ref.decode(z).sample)
        assert close(fast.decode(z, return_dict=False)[0], ref.decode(z, return_dict=False)[0])
        assert close(fast(images).sample, ref(images).sample)
    for key in ("latent_channels", "scaling_factor", "shift_factor", "force_upcast", "latent_magnitude",
                "latent_shift", "in_channels", "out_channels", "upsampling_scaling_factor"):
        assert fast.config[key] == ref.config[key], key
    for key in ("block_out_channels", "decoder_block_out_channels", "num_decoder_blocks", "encoder_block_out_channels",
                "num_encoder_blocks"):
        assert tuple(fast.config[key]) == tuple(ref.config[key]), key


@pytest.mark.parametrize("latent_channels, variant", [(4, "taesd"), (16, "taef1")])
def test_to_diffusers_state_dict_loads_into_autoencoder_tiny(diffusers, latent_channels, variant):
    """Our upstream-keyed weights, converted with to_diffusers, load strictly and give the same outputs."""
    torch.manual_seed(3)
    ours = randomize_biases(TAESD(variant)).eval()
    ref = diffusers.AutoencoderTiny(latent_channels=latent_channels).eval()
    ref.load_state_dict(to_diffusers(ours.encoder.state_dict(), ours.decoder.state_dict()), strict=True)
    fast = AutoencoderTinyFast(ours)
    images = torch.rand(1, 3, 64, 64) * 2 - 1
    z = torch.randn(1, latent_channels, 8, 8)
    with torch.no_grad():
        assert close(fast.encode(images).latents, ref.encode(images).latents)
        assert close(fast.decode(z).sample, ref.decode(z).sample)


def test_decode_is_unclamped_like_decoder_tiny(diffusers):
    """DecoderTiny returns 2 * decoder(z) - 1 without clamping; so do we (pipelines clamp afterwards)."""
    ref = reference_tiny(diffusers, 4)
    with torch.no_grad():
        ref.decoder.layers[-1].bias.add_(1.0)  # push part of the output above 1
    fast = AutoencoderTinyFast.from_diffusers(ref)
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        ours, theirs = fast.decode(z).sample, ref.decode(z).sample
    assert theirs.max() > 1 and close(ours, theirs)


def test_save_pretrained_loads_in_diffusers_and_back(diffusers, tmp_path):
    ref = reference_tiny(diffusers, 4)
    fast = AutoencoderTinyFast.from_diffusers(ref)
    fast.config.scaling_factor = 0.5
    fast.save_pretrained(tmp_path)
    theirs = diffusers.AutoencoderTiny.from_pretrained(tmp_path)
    again = AutoencoderTinyFast.from_pretrained(tmp_path)
    assert theirs.config.scaling_factor == again.config.scaling_factor == 0.5
    z = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        assert close(theirs.decode(z).sample, ref.decode(z).sample)
        assert close(again.decode(z).sample, ref.decode(z).sample)


# ---------------------------------------------------------------------------------------- inside a pipeline


def vae_only_pipeline(diffusers):
    """A DiffusionPipeline with only a VAE, making the VAE calls StableDiffusionPipeline makes (no transformers)."""
    from diffusers.image_processor import VaeImageProcessor

    class VaeOnlyPipeline(diffusers.DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)
            self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)  # as StableDiffusionPipeline
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

        @torch.no_grad()
        def __call__(self, latents, output_type="pt", generator=None):
            latents = latents.to(self.vae.dtype)
            image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False, generator=generator)[0]
            return self.image_processor.postprocess(image, output_type=output_type)

        @torch.no_grad()
        def encode_image(self, image):
            pixels = self.image_processor.preprocess(image).to(self.vae.dtype)
            encoded = self.vae.encode(pixels)  # img2img's retrieve_latents: latent_dist, else .latents
            latents = encoded.latent_dist.mode() if hasattr(encoded, "latent_dist") else encoded.latents
            return latents * self.vae.config.scaling_factor

    return VaeOnlyPipeline


def test_pipeline_vae_swap(diffusers):
    ref = reference_tiny(diffusers, 4)
    pipe = vae_only_pipeline(diffusers)(ref)
    z = torch.randn(1, 4, 8, 12)
    expected = pipe(z)
    pipe.vae = AutoencoderTinyFast.from_diffusers(ref)  # the `pipe.vae = ...` drop-in
    assert pipe.config["vae"] == ("taesd_fast.models.taesd.diffusers", "AutoencoderTinyFast")
    assert pipe.components["vae"] is pipe.vae
    pipe.to(torch.float32)
    assert pipe.dtype == torch.float32 and pipe.device == torch.device("cpu")
    got = pipe(z)
    assert got.shape == (1, 3, 64, 96) and close(got, expected)
    pil = pipe(z, output_type="pil")[0]
    assert pil.size == (96, 64)
    assert pipe.encode_image(pil).shape == (1, 4, 8, 12)


def test_pipeline_register_modules_and_scale_factor(diffusers, taef2):
    pipe = vae_only_pipeline(diffusers)(taef2)
    assert pipe.vae_scale_factor == 8 and pipe.vae is taef2
    assert 2 ** (len(architecture_config(TAESD("taesana").arch)["block_out_channels"]) - 1) == 32


def test_pipeline_offload_hook_runs_before_encode_and_decode(taef2):
    calls = []

    class Hook:
        def pre_forward(self, module):
            calls.append(module)

    vae = copy.deepcopy(taef2)
    vae._hf_hook = Hook()
    with torch.no_grad():
        vae.decode(torch.zeros(1, 32, 4, 4))
        vae.encode(torch.zeros(1, 3, 32, 32))
    assert calls == [vae, vae]


# --------------------------------------------------------------------------------- real TAEF2, tiling, slicing


def test_taef2_real_weights_follow_diffusers_conventions(taef2, load_photo):
    """[-1, 1] images in, unclamped 2 * decoder - 1 out: TAESD's own [0, 1] results mapped."""
    assert taef2.taesd.variant == "taef2" and taef2.config.latent_channels == 32
    assert taef2.config.scaling_factor == 1.0 and taef2.config.shift_factor == 0.0
    assert taef2.dtype == torch.float32 and taef2.device == torch.device("cpu") and not taef2.training
    photo = load_photo("musk", 128, 192)
    with torch.no_grad():
        latents = taef2.encode(photo * 2 - 1).latents
        assert close(latents, taef2.taesd.encode(photo))
        decoded = taef2.decode(latents).sample
        assert close(decoded.add(1).div(2).clamp(0, 1), taef2.taesd.decode(latents))
    assert (decoded.add(1).div(2) - photo).abs().mean() < 0.05  # and it is a real autoencoder


def test_tiling_equals_untiled_for_32_channels(taef2, load_photo):
    vae = copy.deepcopy(taef2)
    photo = load_photo("sit", 256, 384) * 2 - 1
    with torch.no_grad():
        latents = vae.encode(photo).latents  # [1, 32, 32, 48]
        untiled = vae.decode(latents).sample
        vae.enable_tiling(tile_size=144)  # image pixels: 2 x 3 tiles
        assert vae.use_tiling
        assert close(vae.encode(photo).latents, latents)
        assert close(vae.decode(latents).sample, untiled)
        vae.disable_tiling()
        assert torch.equal(vae.decode(latents).sample, untiled)


def test_tiling_equals_untiled_for_16_channels(diffusers):
    """AutoencoderTiny's own tiling hard-codes 4 latent channels; ours takes any."""
    fast = AutoencoderTinyFast.from_diffusers(reference_tiny(diffusers, 16))
    z = torch.randn(1, 16, 100, 3)  # a strip of 800 px: 3 tiles of 304 px, the smallest for this architecture
    images = torch.rand(1, 3, 100 * 8, 24) * 2 - 1
    with torch.no_grad():
        untiled, latents = fast.decode(z).sample, fast.encode(images).latents
        fast.enable_tiling(tile_size=304)
        assert close(fast.decode(z).sample, untiled)
        assert close(fast.encode(images).latents, latents)


def test_slicing_gives_the_same_batch(taef2):
    vae = copy.deepcopy(taef2)
    z = torch.randn(3, 32, 4, 6)
    with torch.no_grad():
        whole = vae.decode(z).sample
        vae.enable_slicing()
        assert close(vae.decode(z).sample, whole)
        vae.disable_slicing()


# ---------------------------------------------------------------------------------------------- loading


def test_from_pretrained_hub_repo_config_and_dtype(diffusers, tmp_path, no_network, hub_offline):
    """`pipe.vae = AutoencoderTinyFast.from_pretrained("madebyollin/taesd", torch_dtype=torch.float16)`, with the repo
    (diffusers layout) in the Hub cache: config.json's scaling/shift are used, keyword arguments override them."""
    folder = tmp_path / "files"
    AutoencoderTinyFast.from_diffusers(reference_tiny(diffusers, 4)).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "scaling_factor": 1.5305, "shift_factor": 0.0609}))
    cache = tmp_path / "cache"
    populate_hub_cache(cache, "madebyollin/taesd", {p.name: p for p in folder.iterdir()})
    pipe = vae_only_pipeline(diffusers)(reference_tiny(diffusers, 4))
    pipe.vae = AutoencoderTinyFast.from_pretrained("madebyollin/taesd", torch_dtype=torch.float16, cache_dir=cache)
    assert pipe.vae.dtype == torch.float16 and pipe.dtype == torch.float16 and pipe.vae.taesd.variant == "taesd"
    assert (pipe.vae.config.scaling_factor, pipe.vae.config.shift_factor) == (1.5305, 0.0609)
    vae = AutoencoderTinyFast.from_pretrained(folder, shift_factor=0.0)
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.5305, 0.0)


def test_bad_input_gives_clear_errors(taef2, tmp_path):
    with pytest.raises(ValueError, match="file variants such as 'fp16'"):
        AutoencoderTinyFast.from_pretrained(variant="fp16")
    with pytest.raises(ValueError, match="not a torch dtype"):
        AutoencoderTinyFast.from_pretrained(torch_dtype="half_float")
    assert AutoencoderTinyFast.from_pretrained(torch_dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(TypeError, match="expected a diffusers AutoencoderTiny"):
        AutoencoderTinyFast.from_diffusers(taef2.taesd)
    with pytest.raises(TypeError, match="unknown config keys"):
        AutoencoderTinyFast(taef2.taesd, scaling_factr=1.0)
    with pytest.raises(TypeError, match="wraps a taesd_fast.TAESD"):
        AutoencoderTinyFast(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="32 channels"):
        taef2.decode(torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="multiple of 8"):
        taef2.encode(torch.zeros(1, 3, 60, 64))
    with pytest.raises(RuntimeError, match="no decoder"):
        AutoencoderTinyFast(TAESD("taesd", decoder=False)).decode(torch.zeros(1, 4, 8, 8))
    taef2.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "latent_channels": 16}))
    with pytest.raises(WeightsError, match="latent_channels=16"):
        AutoencoderTinyFast.from_pretrained(tmp_path)
    with pytest.raises(AttributeError, match="no 'latents_mean'"):
        taef2.config.latents_mean  # noqa: B018 - SDXL probes it with hasattr


# ---------------------------------------------------------------------------------------------- Wan head


def tiny_wan(diffusers, wan22: bool):
    """A small random AutoencoderKLWan: Wan 2.2 layout (residual blocks, patch size 2, 12-channel head) or 2.1."""
    torch.manual_seed(4)
    common = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, latents_mean=[0.0] * 4,
                  latents_std=[1.0] * 4)
    if wan22:
        vae = diffusers.AutoencoderKLWan(decoder_base_dim=16, is_residual=True, in_channels=12, out_channels=12,
                                         patch_size=2, scale_factor_spatial=16, **common)
    else:
        vae = diffusers.AutoencoderKLWan(**common)
    return randomize_biases(vae).eval()


@pytest.mark.parametrize("wan22", [True, False], ids=["wan2.2", "wan2.1"])
def test_patch_wan_vae_decodes_like_diffusers(diffusers, wan22, monkeypatch):
    from taesd_fast.models.head.diffusers import FastWanHeadConv, patch_wan_vae

    vae = tiny_wan(diffusers, wan22)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(8)  # so part of the output clamps
    ref = copy.deepcopy(vae)
    keys, weight, gamma = list(vae.state_dict()), vae.decoder.conv_out.weight, vae.decoder.norm_out.gamma
    assert patch_wan_vae(vae) is vae and patch_wan_vae(vae) is vae  # in place, idempotent
    head = vae.decoder.conv_out
    assert isinstance(head, FastWanHeadConv)
    assert list(vae.state_dict()) == keys  # same checkpoint keys
    assert head.weight is weight and vae.decoder.norm_out.gamma is gamma  # shared, not copied
    assert head.head.conv_out.weight is weight and head.head.norm_out is vae.decoder.norm_out

    calls = []
    real_head_conv = dispatch.head_conv
    monkeypatch.setattr(dispatch, "head_conv", lambda *a, **k: calls.append(a[0].shape[2]) or real_head_conv(*a, **k))
    z = torch.randn(1, 4, 3, 4, 5, generator=torch.Generator().manual_seed(5))  # 3 latent frames: 1 + 4 + 4 out
    with torch.no_grad():
        expected, got = ref.decode(z).sample, vae.decode(z).sample
    assert got.shape == expected.shape and got.shape[2] == 9
    assert (expected.abs() == 1).float().mean() > 0.05  # the clamp is exercised
    assert (got - expected).abs().max().item() < 1e-5
    assert calls == [1 + 2, 4 + 2, 4 + 2]  # our head ran for every chunk, with its 2 causal frames in front


def test_patched_wan_vae_tiled_decode(diffusers):
    """diffusers' tiled_decode blends tiles before its clamp; the patched head clamps each tile first. Both agree
    when nothing saturates (checked here); where a tile exceeds [-1, 1] inside a blend band they differ (see
    models/head/diffusers.py's docstring)."""
    from taesd_fast.models.head.diffusers import patch_wan_vae

    vae = tiny_wan(diffusers, True)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
        vae.decoder.conv_out.bias.zero_()
    ref = copy.deepcopy(vae)
    patch_wan_vae(vae)
    for v in (vae, ref):
        v.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                        tile_sample_stride_width=32)
    z = torch.randn(1, 4, 2, 8, 8, generator=torch.Generator().manual_seed(6))  # 128 px: 3 x 3 tiles
    with torch.no_grad():
        expected, got = ref.decode(z).sample, vae.decode(z).sample
    assert expected.abs().max() < 1 and (got - expected).abs().max().item() < 1e-5


def test_patched_wan_vae_follows_its_parameters(diffusers):
    """load_state_dict (also assign=True, as offload hooks replace Parameters) and .to() reach the head."""
    from taesd_fast.models.head.diffusers import patch_wan_vae

    vae, ref = tiny_wan(diffusers, True), tiny_wan(diffusers, True)
    with torch.no_grad():
        for p in ref.decoder.parameters():
            p.mul_(1.1)
    patch_wan_vae(vae)
    vae.load_state_dict(ref.state_dict(), assign=True)
    assert vae.decoder.conv_out.head.conv_out.weight is vae.decoder.conv_out.weight
    vae.to(torch.float64)
    ref.to(torch.float64)
    z = torch.randn(1, 4, 2, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        assert (vae.decode(z).sample - ref.decode(z).sample).abs().max().item() < 1e-10


def test_patch_wan_vae_rejects_other_models(diffusers, taef2):
    from taesd_fast.models.head.diffusers import patch_wan_vae

    with pytest.raises(TypeError, match="expects a diffusers AutoencoderKLWan"):
        patch_wan_vae(taef2)


def test_enable_tiling_takes_diffusers_use_tiling_flag():
    vae = AutoencoderTinyFast.from_pretrained()
    vae.enable_tiling()
    assert vae.use_tiling and vae.tile_size == 512  # image pixels, like AutoencoderTiny's tile_sample_min_size
    vae.enable_tiling(False)  # diffusers' signature: enable_tiling(use_tiling=True)
    assert not vae.use_tiling
