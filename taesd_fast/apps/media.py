"""Image files for the CLI (Pillow): images are [1, 3, H, W] float32 in [0, 1]. Latents files: latents_io."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")


def collect_files(paths: Iterable[str | os.PathLike], suffixes: tuple[str, ...], what: str) -> list[Path]:
    """The given files, with each folder replaced by the files in it with one of `suffixes`, sorted by name
    (hidden files skipped, no recursion). An empty folder is an error naming what was looked for."""
    files = []
    for path in map(Path, paths):
        if not path.is_dir():
            files.append(path)
            continue
        found = sorted(p for p in path.iterdir()
                       if p.suffix.lower() in suffixes and not p.name.startswith(".") and p.is_file())
        if not found:
            raise FileNotFoundError(f"folder {path} holds no {what} (looked for {', '.join(suffixes)})")
        files += found
    return files


def load_image(path: str | os.PathLike) -> torch.Tensor:
    """An image file as [1, 3, H, W] float32 in [0, 1] (EXIF rotation applied, alpha dropped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    with Image.open(path) as im:
        rgb = ImageOps.exif_transpose(im).convert("RGB")
    array = np.asarray(rgb, dtype=np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0).contiguous()


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[1, 3, H, W] or [3, H, W] in [0, 1] -> [H, W, 3] uint8 (rounded, not truncated)."""
    image = images[0] if images.dim() == 4 else images
    return image.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()


def save_image(images: torch.Tensor, path: str | os.PathLike) -> None:
    Image.fromarray(to_uint8(images)).save(path)


def pad_to_multiple(images: torch.Tensor, multiple: int) -> torch.Tensor:
    """Pad the bottom and right edges to a multiple of `multiple` by repeating the edge pixels.

    Edge replication rather than zeros: the autoencoder then sees no artificial border, so the kept area is
    decoded as if the image continued.
    """
    height, width = images.shape[-2:]
    pad_h, pad_w = -height % multiple, -width % multiple
    if not (pad_h or pad_w):
        return images
    return F.pad(images, (0, pad_w, 0, pad_h), mode="replicate")


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(height, width) of an image file, reading only its header; a clear error for a missing or non-image file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"image not found: {path}")
    with Image.open(path) as im:
        width, height = im.size
        if im.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8):
            width, height = height, width  # stored rotated by 90 degrees; load_image turns it upright
    return height, width


def check_image_file_size(size: tuple[int, int], multiple: int, source: str) -> None:
    """size: (height, width). Raises a ValueError when a side is not a multiple (the CLI's --no-pad), saying that
    without --no-pad the image is padded."""
    height, width = size
    if height % multiple or width % multiple:
        raise ValueError(
            f"{source} is {width}x{height} pixels, not a multiple of {multiple} on each side; resize or crop it, "
            f"or leave out --no-pad to pad it by edge replication (the decoded result is cropped back)"
        )
