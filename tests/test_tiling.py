"""Tiled encode/decode (taesd_fast.models.taesd.tiling): equal to the untiled model, memory set by the tile, measured
radius, tile sizes in image pixels everywhere, the smallest efficient tile, and tile_size="auto".

Most checks use strips (tiled along one axis, 1-3 latent cells across the other) so they stay fast on 2 CPU
cores; the real-photo test tiles both axes with the real TAEF2 weights.

Why the smallest tile is twice the overlap: each tile runs on a window `overlap` pixels wider on every side. Measured
on a shared 2-core CPU (TAEF2, fp32, 64x64 latents = 512 px, overlap 72 px), decode took 0.94 s untiled and 6.2 s,
4.7 s, 3.4 s, 2.5 s, 2.1 s with tiles of 64, 96, 144, 192, 256 px (an audit measured 126 s for 8 px tiles against
0.6 s untiled). At 144 px (twice the overlap) a tile costs at most 4x its share of the work, and larger tiles gain
less per step.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import REPO_ROOT

from taesd_fast import TAESD, AutoencoderTinyFast
from taesd_fast.models.taesd import tile_memory, tiling
from taesd_fast.models.taesd.tiling import (
    RADIUS,
    decode_tiled,
    encode_tiled,
    minimum_tile,
    radius,
    split_global,
)

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
    from taesd_fast.models.taesd.architecture import VARIANTS as ALL

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
# (variant, axis): both axes, except taesana, whose strips are 32x larger (its layers are symmetric anyway)
STRIPS = [(v, axis) for v in VARIANTS for axis in (0, 1) if (v, axis) != ("taesana", 1)]


class count_windows:
    """Records how many windows each tiled call of model.<part> ran (calls of the last layer of its tiled middle
    part: split_global slices a new Sequential each time, and a nearest Upsample first layer is folded into a conv)."""

    def __init__(self, model, part: str):
        self.last = split_global(part, getattr(model, part))[1][-1]
        self.counts: list[int] = []
        self.calls = 0

    def _hook(self, module, inputs):
        self.calls += 1

    def __enter__(self) -> list[int]:
        self.handle = self.last.register_forward_pre_hook(self._hook)
        self._original = tiling._run_tiled

        def counted(*args, **kwargs):
            before = self.calls
            out = self._original(*args, **kwargs)
            self.counts.append(self.calls - before)
            return out

        tiling._run_tiled = counted
        return self.counts

    def __exit__(self, *exc):
        tiling._run_tiled = self._original
        self.handle.remove()


@pytest.mark.parametrize("variant, axis", STRIPS)
def test_decode_tiled_equals_untiled(variant, axis):
    """Tiles of the smallest size, 2R cells (R = radius), on a strip 5R + 5 long: the middle tile's window ends
    exactly R cells past its core, and the last window is shifted inwards."""
    model = random_model(variant)
    f, r = model.downscale, radius(model, "decoder")
    across = 1 if variant == "taesana" else 3
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(2, model.latent_channels, *strip(5 * r + 5, across, axis), generator=gen)
    with torch.no_grad(), count_windows(model, "decoder") as windows:
        untiled = model.decoder(z)
        tiled = decode_tiled(model, z, tile_size=2 * r * f, clamp=False)
    assert windows == [3]
    assert tiled.shape == untiled.shape
    assert (tiled - untiled).abs().max().item() <= TOL * untiled.abs().max().item()
    with torch.no_grad():
        assert torch.equal(decode_tiled(model, z, 2 * r * f), tiled.clamp(0, 1))  # clamp=True is decode's clamp


@pytest.mark.parametrize("variant, axis", STRIPS)
def test_encode_tiled_equals_untiled(variant, axis):
    model = random_model(variant)
    f, r = model.downscale, radius(model, "encoder")
    across = 1 if variant == "taesana" else 3
    h, w = strip((5 * r + 5) * f, across * f, axis)
    images = torch.rand(1, 3, h, w, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), count_windows(model, "encoder") as windows:
        untiled = model.encode(images)
        tiled = encode_tiled(model, images, tile_size=2 * r * f)
    assert windows == [3]
    assert tiled.shape == untiled.shape
    assert (tiled - untiled).abs().max().item() <= TOL * untiled.abs().max().item()


def test_real_photo_taef2_tiled_equals_untiled(taef2_real, load_photo):
    """Real TAEF2 weights on a real photo, tiled along both axes: no seams, equal to the untiled result."""
    image = load_photo("monalisa", 384, 384)
    with torch.no_grad():
        latents = taef2_real.encode(image)  # [1, 32, 48, 48]
        tiled_latents = encode_tiled(taef2_real, image, tile_size=192)  # 24-cell tiles, 42-cell windows: 4 tiles
        assert (tiled_latents - latents).abs().max().item() <= TOL * latents.abs().max().item()
        decoded = taef2_real.decode(latents)
        tiled = decode_tiled(taef2_real, latents, tile_size=192)
    assert tiled.shape == decoded.shape == image.shape
    assert (tiled - decoded).abs().max().item() <= TOL
    # the seams: rows and columns where tiles meet (192 px)
    assert (tiled[..., 188:196, :] - decoded[..., 188:196, :]).abs().max().item() <= TOL
    assert (tiled[..., :, 188:196] - decoded[..., :, 188:196]).abs().max().item() <= TOL


def test_a_smaller_overlap_is_accepted():
    """overlap= below the receptive field (cheaper, approximate) still gives the right shape and tile count."""
    model = random_model("taesd")
    z = torch.randn(1, 4, 40, 2)
    with torch.no_grad(), count_windows(model, "decoder") as windows:
        out = decode_tiled(model, z, tile_size=64, overlap=16)
    assert out.shape == (1, 3, 320, 16) and windows == [5]


# ------------------------------------------------------------------------------------ tile sizes in pixels


def test_tile_size_counts_image_pixels_everywhere(taef2_real, load_photo):
    """TAESD.encode/decode(tile_size=), encode_tiled/decode_tiled and the diffusers adapter's enable_tiling all count
    image pixels: 160 px tiles on a 480x320 image are 3 x 2 windows, for encode and for decode alike."""
    model = taef2_real
    image = load_photo("musk", 480, 320)
    vae = AutoencoderTinyFast(model)
    vae.enable_tiling(tile_size=160)
    with torch.no_grad():
        latents = model.encode(image)  # [1, 32, 60, 40]
        decoded = model.decode(latents)
        with count_windows(model, "encoder") as windows:
            got = [model.encode(image, tile_size=160), encode_tiled(model, image, 160),
                   vae.encode(image * 2 - 1).latents]
        assert windows == [6, 6, 6]
        for tiled in got:
            assert (tiled - latents).abs().max().item() <= TOL * latents.abs().max().item()
        with count_windows(model, "decoder") as windows:
            got = [model.decode(latents, tile_size=160), decode_tiled(model, latents, 160),
                   vae.decode(latents).sample.add(1).div(2).clamp(0, 1)]
        assert windows == [6, 6, 6]
        for tiled in got:
            assert tiled.shape == decoded.shape and (tiled - decoded).abs().max().item() <= 2 * TOL


def test_minimum_tile_is_twice_the_overlap():
    """Written out by hand from RADIUS (which test_receptive_field measures): 2 x radius x downscale pixels."""
    expected = {("taef2", "decoder"): 144, ("taef2", "encoder"): 144, ("taesd", "decoder"): 304,
                ("taesd", "encoder"): 304, ("taesana", "decoder"): 1280, ("taesana", "encoder"): 1216}
    for (variant, part), pixels in expected.items():
        model = random_model(variant)
        assert minimum_tile(model, tiling.overlap_pixels(model, part)) == pixels, (variant, part)
    model = random_model("taesd")
    assert minimum_tile(model, 0) == 8 and minimum_tile(model, 24) == 48 and minimum_tile(model, 8) == 16


def test_too_small_tile_is_raised_to_the_minimum_with_a_warning(taef2_real):
    """decode(z, tile_size=8) used to run 1-cell tiles (126 s against 0.6 s untiled); now it warns and runs 144 px
    tiles, still exact."""
    z = torch.randn(1, 32, 40, 24, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        untiled = taef2_real.decode(z)
        with count_windows(taef2_real, "decoder") as windows, pytest.warns(
            UserWarning, match=r"tile_size=8 is too small to tile efficiently: each tile runs with 72 extra pixels "
                               r"on every side.*using tile_size=144"):
            tiled = taef2_real.decode(z, tile_size=8)
        assert windows == [3 * 2]  # 320 x 192 px in 144 px tiles
        assert (tiled - untiled).abs().max().item() <= TOL
        with pytest.warns(UserWarning, match=r"tile_size=16 is too small.*using tile_size=144"):
            encode_tiled(taef2_real, torch.rand(1, 3, 320, 64), tile_size=16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            taef2_real.decode(z, tile_size=144)  # the minimum itself: no warning


@pytest.mark.parametrize("tile, message", [
    (100, r"tile_size=100 must be a multiple of 8 \(image pixels\): tiles must align with the 8x8-pixel latent"),
    (0, r"tile_size must be an int >= 8 \(image pixels\), got 0"),
    (-64, r"tile_size must be an int >= 8 \(image pixels\), got -64"),
    (True, r"tile_size must be an int >= 8 \(image pixels\), got True"),
    (256.0, r"tile_size must be an int >= 8 \(image pixels\), got 256.0"),
    ("big", r"tile_size='big': expected a number of image pixels or 'auto'"),
])
def test_bad_tile_sizes_are_refused(taef2_real, tile, message):
    with pytest.raises(ValueError, match=message):
        taef2_real.decode(torch.randn(1, 32, 4, 4), tile_size=tile)
    with pytest.raises(ValueError, match=message):
        taef2_real.encode(torch.rand(1, 3, 32, 32), tile_size=tile)
    with pytest.raises(ValueError, match=message):
        decode_tiled(taef2_real, torch.randn(1, 32, 4, 4), tile)
    with pytest.raises(ValueError, match=message):
        AutoencoderTinyFast(taef2_real).enable_tiling(tile_size=tile)


def test_taesana_tiles_are_multiples_of_32():
    model = random_model("taesana")
    with pytest.raises(ValueError, match=r"tile_size=1000 must be a multiple of 32 \(image pixels\)"):
        model.decode(torch.randn(1, 32, 2, 2), tile_size=1000)


def test_overlap_counts_pixels_and_needs_a_tile(taef2_real):
    z = torch.randn(1, 32, 40, 4)
    with pytest.raises(ValueError, match=r"overlap=12 must be a multiple of 8 \(image pixels\)"):
        taef2_real.decode(z, tile_size=256, overlap=12)
    with pytest.raises(ValueError, match=r"overlap must be an int >= 0 \(image pixels\), got -8"):
        taef2_real.decode(z, tile_size=256, overlap=-8)
    with pytest.raises(ValueError, match=r"overlap=16 was given without tile_size; pass tile_size"):
        taef2_real.decode(z, overlap=16)


# ------------------------------------------------------------------------------------------- tile_size="auto"


@pytest.fixture
def free_memory(monkeypatch):
    """free_memory(bytes): what tile_size="auto" sees as free."""

    def set_free(n: int) -> None:
        monkeypatch.setattr(tiling, "free_bytes", lambda device: n)

    return set_free


def test_auto_runs_untiled_when_the_image_fits(taef2_real, free_memory):
    z = torch.randn(1, 32, 40, 24)
    need = tiling.memory_needed(taef2_real, "decoder", z, None)
    assert need == int(4.5 * 64 * 320 * 192 * 4)  # LIVE = 4.5 activations of 64 channels at 320x192 px, fp32
    free_memory(int(need / tiling.HEADROOM) + 1)
    with torch.no_grad(), count_windows(taef2_real, "decoder") as windows:
        out = taef2_real.decode(z, tile_size="auto")
    assert windows == [] and torch.equal(out, taef2_real.decode(z))


def test_auto_picks_the_largest_tile_that_fits(taef2_real, free_memory):
    z = torch.randn(1, 32, 64, 48, generator=torch.Generator().manual_seed(6))  # 512 x 384 px
    overlap = tiling.overlap_pixels(taef2_real, "decoder")
    need = functools.partial(tiling.memory_needed, taef2_real, "decoder", z)
    budget = need(224, overlap) + 1000  # room for 224 px tiles, not for 232 px ones
    assert need(232, overlap) > budget and need(None) > budget
    free_memory(int(budget / tiling.HEADROOM))
    assert tiling.choose_tile(taef2_real, "decoder", z, "auto", overlap) == 224
    with torch.no_grad(), count_windows(taef2_real, "decoder") as windows:
        out = taef2_real.decode(z, tile_size="auto")
    assert windows == [3 * 2]  # 512 x 384 px in 224 px tiles
    with torch.no_grad():
        assert (out - taef2_real.decode(z)).abs().max().item() <= TOL
    # the adapter's enable_tiling(tile_size="auto"), with plenty of memory: no tiling
    vae = AutoencoderTinyFast(taef2_real)
    vae.enable_tiling(tile_size="auto")
    free_memory(1 << 50)
    with torch.no_grad(), count_windows(taef2_real, "encoder") as windows:
        vae.encode(torch.rand(1, 3, 512, 384) * 2 - 1)
    assert windows == []


def test_auto_with_too_little_memory_uses_the_smallest_tile_and_says_so(taef2_real, free_memory):
    z = torch.randn(1, 32, 40, 24)
    free_memory(10 << 20)
    with pytest.warns(UserWarning, match=r"tile_size='auto': even the smallest efficient tile \(144 px\) needs about "
                                         r"0\.\d GiB and only 0\.0 GiB is free on cpu; trying it anyway"):
        assert tiling.choose_tile(taef2_real, "decoder", z, "auto", 72) == 144


def test_memory_estimate_scales_with_batch_and_dtype(taef2_real):
    z = torch.randn(1, 32, 64, 64)
    one = tiling.memory_needed(taef2_real, "decoder", z, 256, 72)
    assert tiling.memory_needed(taef2_real, "decoder", z.expand(3, -1, -1, -1), 256, 72) == 3 * one
    assert abs(tiling.memory_needed(taef2_real, "decoder", z.half(), 256, 72) - one / 2) <= 1


def test_free_memory_sources(monkeypatch):
    """CUDA: the driver's free memory plus what PyTorch's caching allocator holds unused; CPU: available RAM."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 << 30)
    assert tile_memory.free_bytes(torch.device("cuda", 0)) == 7 << 30
    ram = tile_memory.available_ram()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < ram <= total
    assert tile_memory.free_bytes(torch.device("cpu")) == pytest.approx(ram, rel=0.2)


def test_widest_activation():
    """64 channels at full resolution for every f8 decoder and encoder; TAEF2's GN branch: 256 channels at 1/64."""
    taef2, taesd = random_model("taef2"), random_model("taesd")
    assert tile_memory.widest_activation(taesd.decoder, 4, 1 / 8) == (64, 3, 1)
    assert tile_memory.widest_activation(taesd.encoder, 3, 1) == (64, 4, 1 / 8)
    head, middle, _ = split_global("decoder", taef2.decoder)
    assert tile_memory.widest_activation(head, 32, 1 / 8) == (256 / 64, 64, 1 / 8)
    assert tile_memory.widest_activation(middle, 64, 1 / 8) == (64, 3, 1)


# VmHWM, not ru_maxrss: a child of a large process (pytest) inherits the parent's maxrss across fork and exec.
MEASURE_PEAK = """
import sys, torch
from taesd_fast import TAESD
from taesd_fast.models.taesd.tiling import memory_needed, overlap_pixels, run_tiled
def status(key):  # bytes
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
part, tile = sys.argv[1], None if sys.argv[2] == "none" else int(sys.argv[2])
torch.manual_seed(0)
model = TAESD.from_pretrained()
x = torch.rand(1, 3, 768, 768) if part == "encoder" else torch.randn(1, 32, 96, 96)
overlap = overlap_pixels(model, part)
run = (lambda t: getattr(model, part)(t)) if tile is None else (lambda t: run_tiled(model, part, t, tile, overlap))
with torch.no_grad():
    run(x[..., :32, :32].contiguous() if part == "encoder" else x[..., :4, :4].contiguous())  # warm-up
    base = status("VmRSS")
    run(x)
print(status("VmHWM") - base, memory_needed(model, part, x, tile, overlap))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc/self/status")
@pytest.mark.parametrize("part, tile", [("decoder", "none"), ("decoder", "256"), ("encoder", "256")])
def test_memory_estimate_bounds_the_measured_peak(part, tile):
    """The estimate tile_size="auto" plans with, against the peak resident memory of a fresh process running the
    real TAEF2 at 768 px on the CPU (untiled: 577 MiB above the process's size before the run; tiled at 256: 168
    MiB for the decoder, 160 for the encoder). It must never fall short of the peak, and stay within 1.25x of it
    (the estimates are 1.10-1.16x of it here)."""
    # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed, and then keeps later blocks of that
    # size resident after their free, so the measured peak would depend on what the process freed before.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    result = subprocess.run([sys.executable, "-c", MEASURE_PEAK, part, tile], capture_output=True, text=True,
                            check=False, cwd=REPO_ROOT, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    measured, estimate = map(int, result.stdout.split())
    print(f"{part} tile={tile}: measured {measured / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB")
    assert measured > 100 << 20
    assert measured <= estimate <= 1.25 * measured


# ------------------------------------------------------------------------------- memory set by the tile


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
    tile = minimum_tile(model, tiling.overlap_pixels(model, "decoder"))  # 304 px taesd, 144 px taef2
    small = torch.randn(1, model.latent_channels, 4, 120)
    large = torch.randn(1, model.latent_channels, 4, 240)
    tiled_small = peak_of(model, decode_tiled, model, small, tile)
    tiled_large = peak_of(model, decode_tiled, model, large, tile)
    untiled_small = peak_of(model, model.decode, small)
    untiled_large = peak_of(model, model.decode, large)
    assert tiled_large == tiled_small  # twice the image, same peak
    assert untiled_large == 2 * untiled_small  # untiled peak grows with the image
    assert tiled_large < untiled_large / 2
    assert tiled_small < peak_of(model, decode_tiled, model, small, tile + 64)  # and grows with the tile


def test_taef2_untiled_groupnorm_part_is_small(taef2_real):
    """TAEF2's untiled GN Blocks hold 256 channels at latent resolution: 16 bytes per image pixel (fp32)."""
    z = torch.randn(1, 32, 40, 40)
    head, _, _ = split_global("decoder", taef2_real.decoder)
    assert peak_of(head, head, z) == 256 * 40 * 40 * 4


def test_encode_peak_memory_set_by_tile_not_image():
    model = random_model("taesd")
    small, large = torch.rand(1, 3, 32, 960), torch.rand(1, 3, 32, 1920)
    tiled_small = peak_of(model, encode_tiled, model, small, 304)
    tiled_large = peak_of(model, encode_tiled, model, large, 304)
    untiled_large = peak_of(model, model.encode, large)
    assert tiled_large == tiled_small
    assert tiled_large < untiled_large / 2


# ------------------------------------------------------------------------------------------------- errors


def test_bad_arguments_are_clear():
    model = random_model("taesd")
    z = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="4 channels"):
        decode_tiled(model, torch.randn(1, 16, 8, 8))
    with pytest.raises(ValueError, match="multiple of 8"):
        encode_tiled(model, torch.rand(1, 3, 60, 64))
    with pytest.raises(RuntimeError, match="no decoder"):
        decode_tiled(TAESD("taesd", decoder=False), z)
    with pytest.raises(RuntimeError, match="no encoder"):
        encode_tiled(TAESD("taesd", encoder=False), torch.rand(1, 3, 64, 64))
