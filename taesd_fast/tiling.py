"""Seamless tiled encode/decode: bounded memory, and results equal to the untiled model.

Each tile is the model run on a window that extends its core by `overlap` cells on every side; only the core
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

import torch
import torch.nn as nn

from .layers import Block
from .validation import check_multiple, check_tensor

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


def check_geometry(tile, overlap, unit: int, what: str) -> None:
    for name, value, low in (("tile", tile, 1), ("overlap", overlap, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low} ({what}), got {value!r}")
        if value % unit:
            raise ValueError(f"{name}={value} must be a multiple of {unit} ({what}): tiles must align with latents")


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


def _part(model, part: str) -> nn.Sequential:
    layers = getattr(model, part, None)
    if layers is None:
        verb = "decode" if part == "decoder" else "encode"
        raise RuntimeError(f"this TAESD model has no {part}, so it cannot {verb} (tiled or not)")
    return layers


def decode_tiled(
    model, latents: torch.Tensor, tile: int = 64, overlap: int | None = None, *, clamp: bool = True
) -> torch.Tensor:
    """model.decode(latents) computed in tiles of `tile` x `tile` latent cells (tile*8 pixels; *32 for taesana).

    overlap: extra latent cells decoded around each tile and thrown away; default (None) is the receptive-field
        radius, which makes the result equal to the untiled decode. Work grows as ((tile + 2*overlap) / tile)^2.
    clamp: clamp to [0, 1] like `TAESD.decode` (False gives the raw decoder output).
    Peak activation memory is set by the tile size, not by the image size (see the module docstring for TAEF2).
    """
    layers = _part(model, "decoder")
    check_tensor(latents, "latents", channels=model.latent_channels, like=next(layers.parameters()))
    overlap = radius(model, "decoder") if overlap is None else overlap
    check_geometry(tile, overlap, 1, "latent cells")
    head, middle, _ = split_global("decoder", layers)
    out = _run_tiled(middle, head(model.preferred_layout(latents)), tile, overlap, 1, model.downscale)
    return out.clamp_(0, 1) if clamp else out


def encode_tiled(model, images: torch.Tensor, tile: int = 512, overlap: int | None = None) -> torch.Tensor:
    """model.encode(images) computed in tiles of `tile` x `tile` pixels.

    tile, overlap: in image pixels, multiples of the downscale factor (8; 32 for taesana). overlap defaults to the
        receptive-field radius, which makes the result equal to the untiled encode.
    """
    layers = _part(model, "encoder")
    f = model.downscale
    check_tensor(images, "images", channels=3, like=next(layers.parameters()))
    check_multiple(images, f, f"the encoder downsamples {f}x")
    overlap = radius(model, "encoder") * f if overlap is None else overlap
    check_geometry(tile, overlap, f, "image pixels")
    _, middle, tail = split_global("encoder", layers)
    return tail(_run_tiled(middle, model.preferred_layout(images), tile // f, overlap // f, f, 1))
