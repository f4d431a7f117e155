"""Tiled encode/decode (taesd_fast.tiling): equal to the untiled model, memory set by the tile, measured radius.

Most checks use strips (tiled along one axis, 1-3 latent cells across the other) so they stay fast on 2 CPU
cores; the real-photo test tiles both axes with the real TAEF2 weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

from taesd_fast import TAESD
from taesd_fast.tiling import RADIUS, decode_tiled, encode_tiled, radius, split_global

# fp32 CPU: the tiles run the same convolutions on the same values; only the conv algorithm chosen for a different
# spatial size can change rounding. Measured differences are 0; 1e-5 leaves room for other BLAS/oneDNN builds.
TOL = 1e-5

VARIANTS = ["taesd", "taesd3", "taef2", "taesana"]  # 4, 16, 32 (midblock GN), 32 (f32) latent channels


@functools.cache
def random_model(variant: str) -> TAESD:
    """Random init with random biases and GroupNorm affines, so no path is silently zero."""
    torch.manual_seed(0)
    model = TAESD(variant).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def taef2_real() -> TAESD:
    return TAESD.from_pretrained()  # the bundled real TAEF2 weights


def strip(length: int, across: int, axis: int) -> tuple[int, int]:
    """(H, W) of a strip `length` long along `axis` (0: H, 1: W) and `across` wide."""
    return (length, across) if axis == 0 else (across, length)


# ----------------------------------------------------------------------------------------------- the radius


def measured_radius(layers, channels: int, scale_in: int, scale_out: int, expected: int) -> int:
    """Farthest output cell (along H) that changes when one input cell changes, in latent cells.

    The input is a strip 2*(expected+2) cells long, so a radius one larger than expected would still show.
    """
    n = 2 * (expected + 2)
    centre = n // 2
    x = torch.randn(1, channels, n * scale_in, 2 * scale_in, generator=torch.Generator().manual_seed(1))
    farthest = 0
    with torch.no_grad():
        base = layers(x)
        for offset in (0, scale_in - 1):  # both edges of the centre cell
            bumped = x.clone()
            bumped[:, :, centre * scale_in + offset, :] += 10.0
            changed = (layers(bumped) - base).abs().amax(dim=(0, 1, 3)) > 0
            rows = torch.nonzero(changed).flatten()
            assert rows.numel() > 0
            farthest = max(farthest, int((rows // scale_out - centre).abs().max()))
    return farthest


@pytest.mark.parametrize("part", ["decoder", "encoder"])
@pytest.mark.parametrize("variant", ["taesd", "taef2", "taesana"])
def test_receptive_field(variant, part):
    """The RADIUS table is what perturbing one cell measures (not just an upper bound: also not smaller)."""
    model = random_model(variant)
    head, middle, _ = split_global(part, getattr(model, part))
    expected = radius(model, part)
    f = model.downscale
    if part == "decoder":
        channels = head(torch.zeros(1, model.latent_channels, 1, 1)).shape[1]
        got = measured_radius(middle, channels, 1, f, expected)
    else:
        got = measured_radius(middle, 3, f, 1, expected)
    assert got == expected, f"{variant} {part}: measured radius {got}, RADIUS says {expected}"


def test_radius_table_covers_every_variant():
    from taesd_fast.architecture import VARIANTS as ALL

    for arch in ALL.values():
        for part in ("encoder", "decoder"):
            assert (part, arch.f32, arch.midblock_gn) in RADIUS


def test_groupnorm_layers_are_not_tiled():
    """TAEF2's GN Blocks are split off (global statistics); without GN nothing is."""
    taef2, taesd = random_model("taef2"), random_model("taesd")
    head, middle, tail = split_global("decoder", taef2.decoder)
    assert [type(m).__name__ for m in head] == ["Clamp", "DispatchConv2d", "ReLU", "Block", "Block", "Block"]
    assert all(getattr(m, "pool", None) is None for m in middle) and len(tail) == 0
    head, middle, tail = split_global("encoder", taef2.encoder)
    assert len(head) == 0 and [type(m).__name__ for m in tail] == ["Block", "Block", "Block", "DispatchConv2d"]
    assert all(getattr(m, "pool", None) is None for m in middle)
    head, middle, tail = split_global("decoder", taesd.decoder)
    assert len(head) == len(tail) == 0 and len(middle) == len(taesd.decoder)


# ------------------------------------------------------------------------------------- tiled == untiled


# (variant, axis): both axes, except taesana, whose strips are 32x larger (its layers are symmetric anyway)
STRIPS = [(v, axis) for v in VARIANTS for axis in (0, 1) if (v, axis) != ("taesana", 1)]


@pytest.mark.parametrize("variant, axis", STRIPS)
def test_decode_tiled_equals_untiled(variant, axis):
    """Tile = radius R, strip 3R + 5 long: the middle tile's window ends exactly R cells past its core."""
    model = random_model(variant)
    r = radius(model, "decoder")
    across = 1 if variant == "taesana" else 3
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2, model.latent_channels, *strip(3 * r + 5, across, axis), generator=gen)
    with torch.no_grad():
        untiled = model.decoder(z)
        tiled = decode_tiled(model, z, tile=r, clamp=False)
        assert tiled.shape == untiled.shape
        assert (tiled - untiled).abs().max().item() <= TOL * untiled.abs().max().item()
        assert torch.equal(decode_tiled(model, z, tile=r), tiled.clamp(0, 1))  # clamp=True is TAESD.decode's clamp


@pytest.mark.parametrize("variant, axis", STRIPS)
def test_encode_tiled_equals_untiled(variant, axis):
    model = random_model(variant)
    f, r = model.downscale, radius(model, "encoder")
    across = 1 if variant == "taesana" else 3
    h, w = strip((3 * r + 5) * f, across * f, axis)
    images = torch.rand(1, 3, h, w, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        untiled = model.encode(images)
        tiled = encode_tiled(model, images, tile=r * f)
    assert tiled.shape == untiled.shape
    assert (tiled - untiled).abs().max().item() <= TOL * untiled.abs().max().item()


def test_real_photo_taef2_tiled_equals_untiled(taef2_real, load_photo):
    """Real TAEF2 weights on a real photo, tiled along both axes: no seams, equal to the untiled result."""
    image = load_photo("monalisa", 384, 384)
    with torch.no_grad():
        latents = taef2_real.encode(image)  # [1, 32, 48, 48]
        tiled_latents = encode_tiled(taef2_real, image, tile=192)  # 24-cell tiles, 42-cell windows: 4 tiles
        assert (tiled_latents - latents).abs().max().item() <= TOL * latents.abs().max().item()
        decoded = taef2_real.decode(latents)
        tiled = decode_tiled(taef2_real, latents, tile=24)
    assert tiled.shape == decoded.shape == image.shape
    assert (tiled - decoded).abs().max().item() <= TOL
    # the seams: rows and columns where tiles meet (24 cells = 192 px)
    assert (tiled[..., 188:196, :] - decoded[..., 188:196, :]).abs().max().item() <= TOL
    assert (tiled[..., :, 188:196] - decoded[..., :, 188:196]).abs().max().item() <= TOL


def test_tile_size_argument_of_encode_and_decode(taef2_real, load_photo):
    """TAESD.encode/decode(tile_size=pixels) reach the same exact tiling."""
    image = load_photo("musk", 256, 320)
    with torch.no_grad():
        latents = taef2_real.encode(image)
        tiled_latents = taef2_real.encode(image, tile_size=128)
        decoded = taef2_real.decode(latents)
        tiled = taef2_real.decode(latents, tile_size=128)
    assert (tiled_latents - latents).abs().max().item() <= TOL * latents.abs().max().item()
    assert tiled.shape == decoded.shape and (tiled - decoded).abs().max().item() <= TOL
    with pytest.raises(ValueError, match=r"tile must be an int >= 1 \(image pixels\), got 0"):
        taef2_real.decode(latents, tile_size=0)
    with pytest.raises(ValueError, match=r"tile=100 must be a multiple of 8 \(image pixels\)"):
        taef2_real.decode(latents, tile_size=100)


def test_overlap_can_be_reduced():
    """A smaller overlap is accepted (cheaper, approximate) and still gives the right shape."""
    model = random_model("taesd")
    z = torch.randn(1, 4, 40, 2)
    with torch.no_grad():
        out = decode_tiled(model, z, tile=8, overlap=2)
    assert out.shape == (1, 3, 320, 16)


# ------------------------------------------------------------------------------------------------- memory


class PeakActivation:
    """Largest single activation (bytes) produced by any leaf module while active: a CPU stand-in for peak memory.

    The tiled functions' output buffer is not a module output, so this counts the working memory only.
    """

    def __init__(self, model):
        self.model = model
        self.peak = 0

    def _hook(self, module, inputs, output):
        self.peak = max(self.peak, output.numel() * output.element_size())

    def __enter__(self):
        leaves = [m for m in self.model.modules() if not list(m.children())]
        self.handles = [m.register_forward_hook(self._hook) for m in leaves]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def peak_of(model, fn, *args, **kwargs) -> int:
    with PeakActivation(model) as meter, torch.no_grad():
        fn(*args, **kwargs)
    return meter.peak


@pytest.mark.parametrize("variant", ["taesd", "taef2"])
def test_decode_peak_memory_set_by_tile_not_image(taef2_real, variant):
    model = taef2_real if variant == "taef2" else random_model(variant)
    small = torch.randn(1, model.latent_channels, 4, 60)
    large = torch.randn(1, model.latent_channels, 4, 120)
    tiled_small = peak_of(model, decode_tiled, model, small, tile=16)
    tiled_large = peak_of(model, decode_tiled, model, large, tile=16)
    untiled_small = peak_of(model, model.decode, small)
    untiled_large = peak_of(model, model.decode, large)
    assert tiled_large == tiled_small  # twice the image, same peak
    assert untiled_large == 2 * untiled_small  # untiled peak grows with the image
    assert tiled_large < untiled_large / 2
    assert peak_of(model, decode_tiled, model, small, tile=8) < tiled_small  # and shrinks with the tile


def test_taef2_untiled_groupnorm_part_is_small(taef2_real):
    """TAEF2's untiled GN Blocks hold 256 channels at latent resolution: 16 bytes per image pixel (fp32)."""
    z = torch.randn(1, 32, 40, 40)
    head, _, _ = split_global("decoder", taef2_real.decoder)
    assert peak_of(head, head, z) == 256 * 40 * 40 * 4


def test_encode_peak_memory_set_by_tile_not_image():
    model = random_model("taesd")
    small, large = torch.rand(1, 3, 64, 480), torch.rand(1, 3, 64, 960)
    tiled_small = peak_of(model, encode_tiled, model, small, tile=64)
    tiled_large = peak_of(model, encode_tiled, model, large, tile=64)
    untiled_large = peak_of(model, model.encode, large)
    assert tiled_large == tiled_small
    assert tiled_large < untiled_large / 2


# ------------------------------------------------------------------------------------------------- errors


def test_bad_arguments_are_clear():
    model = random_model("taesd")
    z = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="tile must be an int >= 1"):
        decode_tiled(model, z, tile=0)
    with pytest.raises(ValueError, match="overlap must be an int >= 0"):
        decode_tiled(model, z, tile=8, overlap=-1)
    with pytest.raises(ValueError, match="4 channels"):
        decode_tiled(model, torch.randn(1, 16, 8, 8))
    images = torch.rand(1, 3, 64, 64)
    with pytest.raises(ValueError, match="multiple of 8"):
        encode_tiled(model, images, tile=60)
    with pytest.raises(ValueError, match="multiple of 8"):
        encode_tiled(model, torch.rand(1, 3, 60, 64))
    with pytest.raises(RuntimeError, match="no decoder"):
        decode_tiled(TAESD("taesd", decoder=False), z)
