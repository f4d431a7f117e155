"""Image and latents files for the CLI and the lip-sync pipeline (Pillow, safetensors, torch.load).

Images are [1, 3, H, W] float32 in [0, 1]. Latent files hold [N, C, h, w] (a [C, h, w] tensor is read as N=1):
  .safetensors  key "latents"; metadata "image_height"/"image_width" give the size to crop a padded decode back to
  .pt / .pth    a tensor, or a dict with key "latents" (read with weights_only=True: no arbitrary unpickling)
  .png          8-bit latents scaled to [0, 1] by TAESD.scale_latents (at most 4 channels); same size keys as text
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import ExifTags, Image, ImageOps, PngImagePlugin

LATENT_SUFFIXES = (".safetensors", ".pt", ".pth", ".png")
LATENTS_KEY = "latents"
PNG_CHANNELS = (1, 2, 3, 4)  # latent channel counts a PNG holds: L, LA, RGB, RGBA


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
    """size: (height, width). Raises a ValueError that offers --pad when a side is not a multiple."""
    height, width = size
    if height % multiple or width % multiple:
        raise ValueError(
            f"{source} is {width}x{height} pixels, not a multiple of {multiple} on each side; resize or crop it, "
            f"or pass --pad to pad it by edge replication (the decoded result is cropped back)"
        )


def load_latents(path: str | os.PathLike) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """A latents file -> ([N, C, h, w] tensor, (image_height, image_width) to crop a decode to, or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"latents file not found: {path}")
    suffix = path.suffix.lower()
    size = None
    if suffix == ".safetensors":
        from safetensors import safe_open

        with _reading(path), safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            latents = f.get_tensor(LATENTS_KEY) if LATENTS_KEY in keys else None
            size = _size_from(f.metadata() or {})
        if latents is None:
            raise ValueError(f"{path} has no tensor named {LATENTS_KEY!r} (it has: {', '.join(keys) or 'none'})")
    elif suffix in (".pt", ".pth"):
        with _reading(path):
            data = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(data, dict) and LATENTS_KEY in data:
            data = data[LATENTS_KEY]
        if not isinstance(data, torch.Tensor):
            raise ValueError(f"{path} should hold a latents tensor or a dict with key {LATENTS_KEY!r}, got {type(data).__name__}")
        latents = data
    elif suffix == ".png":
        with _reading(path), Image.open(path) as im:
            size = _size_from(im.info)
            array = np.asarray(im, dtype=np.float32) / 255.0
        array = array[..., None] if array.ndim == 2 else array
        from .taesd import TAESD

        latents = TAESD.unscale_latents(torch.from_numpy(array.copy()).permute(2, 0, 1))
    else:
        raise ValueError(f"{path}: unknown latents format {suffix!r}; expected one of {', '.join(LATENT_SUFFIXES)}")
    if latents.dim() == 3:
        latents = latents.unsqueeze(0)
    if latents.dim() != 4 or not latents.dtype.is_floating_point:
        raise ValueError(f"{path}: latents must be a floating point [N, C, h, w] tensor, got {latents.dtype} {tuple(latents.shape)}")
    return latents, size


@contextmanager
def _reading(path: Path):
    """Any error of a file reader (safetensors, torch.load, Pillow) -> one ValueError naming the file and the
    reader's reason (without torch.load's advice to unpickle with weights_only=False)."""
    from .weights_io import reader_reason

    try:
        yield
    except Exception as err:
        raise ValueError(f"could not read latents file {path} ({type(err).__name__}: {reader_reason(err)}): it is "
                         "corrupt or truncated, or not a latents file") from err


def save_latents(latents: torch.Tensor, path: str | os.PathLike, image_size: tuple[int, int] | None = None) -> None:
    """[N, C, h, w] -> .safetensors under key "latents"; image_size (H, W) is kept as metadata."""
    from safetensors.torch import save_file

    metadata = None if image_size is None else {"image_height": str(image_size[0]), "image_width": str(image_size[1])}
    save_file({LATENTS_KEY: latents.detach().cpu().contiguous()}, str(path), metadata=metadata)


def save_latents_png(latents: torch.Tensor, path: str | os.PathLike, image_size: tuple[int, int] | None = None) -> None:
    """[1, C, h, w] with C <= 4 -> 8-bit PNG of TAESD.scale_latents (values beyond +-3 are clipped)."""
    from .taesd import TAESD

    channels = latents.shape[1]
    if channels not in PNG_CHANNELS:
        raise ValueError(
            f"latents with {channels} channels cannot be stored as a PNG (at most 4 channels, as with "
            f"taesd or taesdxl weights); write .safetensors instead"
        )
    scaled = TAESD.scale_latents(latents[0].detach().float()).mul(255).round().to(torch.uint8)
    array = scaled.permute(1, 2, 0).cpu().numpy()
    info = PngImagePlugin.PngInfo()
    if image_size is not None:
        info.add_text("image_height", str(image_size[0]))
        info.add_text("image_width", str(image_size[1]))
    # fromarray picks L / LA / RGB / RGBA from the array shape.
    Image.fromarray(array[..., 0] if channels == 1 else array).save(path, pnginfo=info)


def _size_from(metadata: dict) -> tuple[int, int] | None:
    try:
        return int(metadata["image_height"]), int(metadata["image_width"])
    except (KeyError, ValueError):
        return None
