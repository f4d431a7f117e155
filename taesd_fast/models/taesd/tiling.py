"""Seamless tiled encode/decode: bounded memory, and results equal to the untiled model.

Tile sizes and overlaps are given in image pixels everywhere (multiples of the downscale factor), and run in latent
cells. Each tile is the model run on a window that extends its core by `overlap` on every side; only the core
of the result is kept (no blending). When `overlap` is at least the receptive-field radius of the tiled layers
(`RADIUS`), every kept pixel saw exactly the inputs it sees in the untiled run, so the stitched result equals
the untiled one up to float rounding. Smaller overlaps are allowed (less work) but are no longer exact.

Windows all have the same size (edge windows are shifted inwards), so the dispatcher sees few distinct shapes.

TAEF2's midblock GroupNorm normalises over the whole image, which no tile can see. Its GN Blocks sit at latent
resolution (the decoder's first three Blocks, the encoder's last three), so those layers run untiled on the
whole (small) latent-resolution feature map, and only the full-resolution layers are tiled:
  decode: [clamp, conv, 3 GN Blocks] untiled  ->  the rest tiled;
  encode: everything before the GN Blocks tiled  ->  [3 GN Blocks, conv] untiled.
The untiled part holds 64-256 channels at 1/64 of the pixels: 4-16 bytes per image pixel in fp32, about the
size of the image itself, so memory still does not grow with the tile's full-resolution activations.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from ...validation import user_stacklevel
from ..layers import Block
from .tile_memory import HEADROOM, LIVE, free_bytes, widest_activation

# Receptive-field radius, in latent cells, of the layers that get tiled: an output cell changes only when an
# input cell at most this far away (per axis) changes. Measured by perturbing one cell of random-init models and
# finding the farthest output cell that moved (tests/test_tiling.py::test_receptive_field re-measures every
# entry); they match the count by hand: each 3x3 conv adds 1 pixel at its resolution, a Block 3, an
# upsample/stride-2 conv halves what follows. E.g. the f8 decoder: conv + 3 Blocks per resolution is 10 pixels
# at 1x, 2x, 4x, plus conv + Block + conv (5) at 8x: 10 + 10/2 + 10/4 + 5/8 + rounding of the nearest upsample
# = 19. With overlap one less, tiles differ from the untiled result (also tested).
# Keys: (part, f32 layout, GN layers split off and run untiled).
RADIUS: dict[tuple[str, bool, bool], int] = {
    ("decoder", False, False): 19,
    ("decoder", False, True): 9,  # after the untiled [clamp, conv, 3 GN Blocks] = 10 latent pixels
    ("decoder", True, False): 20,
    ("encoder", False, False): 19,  # 145 image pixels
    ("encoder", False, True): 9,  # before the untiled [3 GN Blocks, conv]: 65 image pixels
    ("encoder", True, False): 19,  # 579 image pixels
}


def split_global(part: str, layers: nn.Sequential) -> tuple[nn.Sequential, nn.Sequential, nn.Sequential]:
    """(untiled head, tiled middle, untiled tail) of an encoder or decoder Sequential.

    The untiled pieces hold the Blocks with a GroupNorm pool branch (and whatever sits between them and the
    nearer end at the same resolution); without GN Blocks the whole Sequential is the tiled middle.
    """
    gn = [i for i, m in enumerate(layers) if isinstance(m, Block) and m.pool is not None]
    n = len(layers)
    if not gn:
        return layers[:0], layers, layers[n:]
    if part == "decoder":
        return layers[: gn[-1] + 1], layers[gn[-1] + 1 :], layers[n:]
    return layers[:0], layers[: gn[0]], layers[gn[0] :]


def radius(model, part: str) -> int:
    """Receptive-field radius in latent cells of the tiled layers of model.encoder / model.decoder."""
    return RADIUS[(part, model.arch.f32, model.arch.midblock_gn)]


def _windows(n: int, tile: int, overlap: int):
    """(core_start, core_end, window_start, window_end) covering [0, n) with cores of `tile` cells.

    Windows are tile + 2*overlap cells (clipped to n) and contain the core plus `overlap` cells each side
    wherever the image has them; edge windows are shifted inwards to keep one window size.
    """
    size = min(n, tile + 2 * overlap)
    for start in range(0, n, tile):
        end = min(start + tile, n)
        w0 = min(max(start - overlap, 0), n - size)
        yield start, end, w0, w0 + size


# A tile is run on a window `overlap` pixels wider on every side, and that border is thrown away. A tile smaller than
# MIN_CORE_PER_OVERLAP times the overlap spends most of its work on the border: at that ratio a window is twice the
# tile per side, 4x the work. Measured on a shared 2-core CPU, TAEF2 decode of 64x64 latents (512 px, overlap 72 px):
# untiled 0.94 s; tiles of 64 px 6.2 s, 96 px 4.7 s, 144 px (the minimum) 3.4 s, 192 px 2.5 s, 256 px 2.1 s.
MIN_CORE_PER_OVERLAP = 2


def overlap_pixels(model, part: str) -> int:
    """The exact overlap in image pixels: the receptive-field radius of the tiled layers."""
    return radius(model, part) * model.downscale


def minimum_tile(model, overlap: int) -> int:
    """The smallest tile (image pixels) worth running: MIN_CORE_PER_OVERLAP x the overlap, at least one latent."""
    f = model.downscale
    return max(f, -(-MIN_CORE_PER_OVERLAP * overlap // f) * f)


def _check_pixels(name: str, value, f: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low} (image pixels), got {value!r}")
    if value % f:
        raise ValueError(f"{name}={value} must be a multiple of {f} (image pixels): tiles must align with the "
                         f"{f}x{f}-pixel latent cells")


def check_tile_arguments(model, tile, overlap) -> None:
    """tile: "auto" or a positive multiple of the downscale factor; overlap: None or a multiple >= 0 (pixels)."""
    f = model.downscale
    if not (isinstance(tile, str) and tile == "auto"):
        if isinstance(tile, str):
            raise ValueError(f"tile_size={tile!r}: expected a number of image pixels or 'auto'")
        _check_pixels("tile_size", tile, f, f)
    if overlap is not None:
        _check_pixels("overlap", overlap, f, 0)


def choose_tile(model, part: str, x: torch.Tensor, tile, overlap: int) -> int | None:
    """The tile size (image pixels) to run with, or None to run untiled.

    "auto": None when the untiled run fits in the free memory, else the largest tile that fits. A number below
    `minimum_tile` is raised to it with a warning."""
    if tile == "auto":
        return _auto_tile(model, part, x, overlap, minimum_tile(model, overlap))
    return efficient_tile(model, tile, overlap)


def efficient_tile(model, tile: int, overlap: int, name: str = "tile_size=") -> int:
    """`tile`, or `minimum_tile` with a warning when `tile` is below it. name: how the caller spells the option in
    the warning ('tile_size=' in Python; the CLI passes '--tile ')."""
    smallest = minimum_tile(model, overlap)
    if tile >= smallest:
        return tile
    warnings.warn(f"{name}{tile} is too small to tile efficiently: each tile runs with {overlap} extra pixels on "
                  f"every side, so a tile under {smallest} px spends most of its time on that border; using "
                  f"{name}{smallest}", stacklevel=user_stacklevel())
    return smallest


def image_size(model, part: str, x: torch.Tensor) -> tuple[int, int]:
    """(H, W) in image pixels of the encoder's input or the decoder's output."""
    scale = model.downscale if part == "decoder" else 1
    return x.shape[-2] * scale, x.shape[-1] * scale


def memory_needed(model, part: str, x: torch.Tensor, tile: int | None, overlap: int = 0) -> int:
    """Estimated peak bytes of a run on x. Untiled: LIVE x the widest activation over the whole image. Tiled, the
    largest of three phases that run one after another: the untiled head (TAEF2's GroupNorm layers before the
    tiles: LIVE x its widest activation), the tiles (LIVE x the widest activation over one window, plus their
    whole-image input and the stitched output, both held throughout), and the untiled tail (LIVE x its widest
    activation, plus the stitched output it reads). How close that lands to measured peaks: tile_memory."""
    height, width = image_size(model, part, x)
    f = model.downscale
    head, middle, tail = split_global(part, getattr(model, part))
    scale = 1 / f if part == "decoder" else 1.0
    if tile is None:
        per_pixel = LIVE * widest_activation(getattr(model, part), x.shape[1], scale)[0]
    else:
        whole_head, channels, scale = widest_activation(head, x.shape[1], scale)
        tiles_in = channels * scale * scale  # the head's output, or x (or its channels_last copy): held throughout
        tiled, channels, scale = widest_activation(middle, channels, scale)
        tiles_out = channels * scale * scale
        whole_tail = widest_activation(tail, channels, scale)[0] if len(tail) else 0.0
        window = min(height, tile + 2 * overlap) * min(width, tile + 2 * overlap)
        per_pixel = max(LIVE * whole_head if len(head) else 0.0,
                        LIVE * tiled * window / (height * width) + tiles_in + tiles_out,
                        LIVE * whole_tail + tiles_out if len(tail) else 0.0)
    return int(x.shape[0] * x.element_size() * per_pixel * height * width)


def _auto_tile(model, part: str, x: torch.Tensor, overlap: int, smallest: int) -> int | None:
    budget = HEADROOM * free_bytes(x.device)
    if memory_needed(model, part, x, None) <= budget:
        return None
    f = model.downscale
    for tile in range(max(image_size(model, part, x)) // f * f, smallest - 1, -f):
        if memory_needed(model, part, x, tile, overlap) <= budget:
            return tile
    need = memory_needed(model, part, x, smallest, overlap)
    warnings.warn(f"tile_size='auto': even the smallest efficient tile ({smallest} px) needs about {need / 2**30:.1f} "
                  f"GiB and only {budget / HEADROOM / 2**30:.1f} GiB is free on {x.device}; trying it anyway",
                  stacklevel=user_stacklevel())
    return smallest


def run_tiled(model, part: str, x: torch.Tensor, tile: int, overlap: int) -> torch.Tensor:
    """model.encoder(x) or model.decoder(x) (unclamped) in tiles of `tile` image pixels with `overlap` extra pixels
    around each; arguments already checked (TAESD.encode / decode)."""
    f = model.downscale
    head, middle, tail = split_global(part, getattr(model, part))
    if part == "decoder":
        return _run_tiled(middle, head(x), tile // f, overlap // f, 1, f)
    return tail(_run_tiled(middle, x, tile // f, overlap // f, f, 1))


def _run_tiled(layers: nn.Sequential, x: torch.Tensor, tile: int, overlap: int, scale_in: int, scale_out: int):
    """layers(x) computed window by window. tile/overlap are in latent cells; a cell is scale_in pixels of x
    and scale_out pixels of the output."""
    si, so = scale_in, scale_out
    h, w = x.shape[-2] // si, x.shape[-1] // si
    out = None
    for y0, y1, wy0, wy1 in _windows(h, tile, overlap):
        for x0, x1, wx0, wx1 in _windows(w, tile, overlap):
            y = layers(x[..., wy0 * si : wy1 * si, wx0 * si : wx1 * si])
            if out is None:  # allocated once the first tile tells the output channels and dtype
                out = y.new_empty(*y.shape[:2], h * so, w * so)
            core = y[..., (y0 - wy0) * so : (y1 - wy0) * so, (x0 - wx0) * so : (x1 - wx0) * so]
            out[..., y0 * so : y1 * so, x0 * so : x1 * so] = core
    return out


def decode_tiled(model, latents: torch.Tensor, tile_size: int | str = 512, overlap: int | None = None, *,
                 clamp: bool = True) -> torch.Tensor:
    """model.decode(latents) computed in tiles of `tile_size` x `tile_size` image (output) pixels.

    tile_size: image pixels, a multiple of the downscale factor (8; 32 for taesana), or "auto" (the largest tile that fits
        in the free memory; untiled when the whole image fits). A tile below `minimum_tile` is raised to it with a
        warning. (Tile sizes count image pixels everywhere: here, in encode_tiled, TAESD.encode/decode(tile_size=)
        and AutoencoderTinyFast.enable_tiling.)
    overlap: image pixels decoded around each tile and thrown away; default (None) is the receptive-field radius,
        which makes the result equal to the untiled decode. Work grows as ((tile + 2*overlap) / tile)^2.
    clamp: clamp to [0, 1] like `TAESD.decode` (False gives the raw decoder output).
    Peak activation memory is set by the tile size, not by the image size (see the module docstring for TAEF2).
    (This argument was once `tile`, in latent cells; it is now `tile_size`, in image pixels, as everywhere else.)
    """
    return model._decode(latents, tile_size, overlap, clamp=clamp)


def encode_tiled(model, images: torch.Tensor, tile_size: int | str = 512, overlap: int | None = None) -> torch.Tensor:
    """model.encode(images) computed in tiles of `tile_size` x `tile_size` image pixels.

    tile_size, overlap: image pixels, as in `decode_tiled` (tile_size may be "auto"). overlap defaults to the receptive-field
        radius, which makes the result equal to the untiled encode.
    """
    return model._encode(images, tile_size, overlap)
