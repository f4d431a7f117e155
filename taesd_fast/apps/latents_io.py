"""Latents files that say what made them.

A latents file holds [N, C, h, w] latents (a [C, h, w] tensor is read as N=1) and, when taesd_fast wrote it, a
record of the model and image behind them (`LatentsRecord`), so that decoding with another model is refused
instead of giving a garbage image, and a padded image is cropped back to its size:
  .safetensors  tensor "latents"; the record in the file's string metadata
  .png          8-bit latents scaled to [0, 1] by TAESD.scale_latents (at most 4 channels); the record in text chunks
  .pt / .pth    a tensor, or a dict with key "latents" (read with weights_only=True: nothing is unpickled); no record
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.taesd.architecture import VARIANTS
from ..models.taesd.hub import weights_hint

LATENT_SUFFIXES = (".safetensors", ".pt", ".pth", ".png")
LATENTS_KEY = "latents"
PNG_CHANNELS = (1, 2, 3, 4)  # latent channel counts a PNG holds: L, LA, RGB, RGBA
RAW, SCALED = "raw", "scaled"  # latents as the encoder gives them, or mapped to [0, 1] by TAESD.scale_latents


@dataclass(frozen=True)
class LatentsRecord:
    """What made a latents file: the model, and the size of the image before any padding."""

    variant: str | None
    latent_channels: int | None
    downscale: int | None
    image_size: tuple[int, int] | None  # (height, width) of the original image
    scale: str = RAW
    version: str | None = None  # the taesd_fast version that wrote the file

    @classmethod
    def for_model(cls, model, image_size: tuple[int, int], scale: str = RAW) -> LatentsRecord:
        from .. import __version__

        return cls(model.variant, model.latent_channels, model.downscale, tuple(image_size), scale, __version__)

    def to_metadata(self) -> dict[str, str]:
        fields = {"variant": self.variant, "latent_channels": self.latent_channels, "downscale": self.downscale,
                  "scale": self.scale, "taesd_fast_version": self.version}
        if self.image_size is not None:
            fields["image_height"], fields["image_width"] = self.image_size
        return {key: str(value) for key, value in fields.items() if value is not None}

    @classmethod
    def from_metadata(cls, metadata: dict, source: Path) -> LatentsRecord | None:
        """The record in a file's metadata; None when the file has none (written by another tool)."""
        if not any(key in metadata for key in ("variant", "image_height", "scale")):
            return None
        try:
            numbers = {key: int(metadata[key]) if key in metadata else None
                       for key in ("latent_channels", "downscale", "image_height", "image_width")}
        except ValueError:
            raise ValueError(f"{source}: its latents metadata is damaged ({_show(metadata)})") from None
        scale = metadata.get("scale", RAW)
        if scale not in (RAW, SCALED):
            raise ValueError(f"{source}: unknown latents scale {scale!r} in its metadata; expected {RAW} or {SCALED}")
        size = (numbers["image_height"], numbers["image_width"])
        return cls(metadata.get("variant"), numbers["latent_channels"], numbers["downscale"],
                   size if None not in size else None, scale, metadata.get("taesd_fast_version"))

    def describe(self) -> str:
        return f"{self.variant} ({self.latent_channels} latent channels, {self.downscale}x downscale)"

    def check_model(self, model, source: str | os.PathLike, *, cli: bool = False) -> None:
        """Refuse a model other than the one that made the latents, saying how to load that one."""
        if self.variant is None or self.variant == model.variant:
            return
        loaded = f"{model.variant} ({model.latent_channels} latent channels, {model.downscale}x downscale)"
        hint = weights_hint(self.variant, cli=cli) if self.variant in VARIANTS else "the model that made them"
        raise ValueError(f"{source} holds latents made by {self.describe()}, but the loaded model is {loaded}; "
                         f"decode them with {hint}")

    def check_latents(self, latents: torch.Tensor, source: str | os.PathLike) -> None:
        """The record must agree with the tensor it describes (a file edited by hand, or mixed up, does not)."""
        channels, height, width = latents.shape[1:]
        if self.latent_channels is not None and self.latent_channels != channels:
            raise ValueError(f"{source}: its metadata says {self.latent_channels} latent channels but the tensor has "
                             f"{channels}; the file is inconsistent")
        if self.image_size is not None and self.downscale:
            expected = tuple(-(-side // self.downscale) for side in self.image_size)
            if expected != (height, width):
                raise ValueError(f"{source}: its metadata says a {self.image_size[1]}x{self.image_size[0]} image "
                                 f"({expected[0]}x{expected[1]} latents at {self.downscale}x) but the latents are "
                                 f"{height}x{width}; the file is inconsistent")


def read_tensor_file(path: Path) -> tuple[torch.Tensor, dict]:
    """The latents tensor and metadata of a .safetensors (tensor "latents") or .pt/.pth file (a tensor, or a dict
    with "latents"), with one-line errors; image and video latents files alike. The caller checks the suffix."""
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with _reading(path), safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            latents = f.get_tensor(LATENTS_KEY) if LATENTS_KEY in keys else None
            metadata = f.metadata() or {}
        if latents is None:
            raise ValueError(f"{path} has no tensor named {LATENTS_KEY!r} (it has: {', '.join(keys) or 'none'})")
        return latents, dict(metadata)
    with _reading(path):
        data = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(data, dict) and LATENTS_KEY in data:
        data = data[LATENTS_KEY]
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"{path} should hold a latents tensor or a dict with key {LATENTS_KEY!r}, "
                         f"got {type(data).__name__}")
    return data, {}


def load_latents(path: str | os.PathLike) -> tuple[torch.Tensor, LatentsRecord | None]:
    """A latents file -> ([N, C, h, w] raw latents, its record or None)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"latents file not found: {path}")
    suffix = path.suffix.lower()
    metadata: dict = {}
    if suffix in (".safetensors", ".pt", ".pth"):
        latents, metadata = read_tensor_file(path)
    elif suffix == ".png":
        import numpy as np
        from PIL import Image

        with _reading(path), Image.open(path) as im:
            metadata = {**im.info, "scale": SCALED}  # a PNG holds scaled latents, whatever its text says
            array = np.asarray(im, dtype=np.float32) / 255.0
        array = array[..., None] if array.ndim == 2 else array
        latents = torch.from_numpy(array.copy()).permute(2, 0, 1)
    else:
        raise ValueError(f"{path}: unknown latents format {suffix!r}; expected one of {', '.join(LATENT_SUFFIXES)}")
    if latents.dim() == 3:
        latents = latents.unsqueeze(0)
    if latents.dim() != 4 or not latents.dtype.is_floating_point:
        raise ValueError(f"{path}: latents must be a floating point [N, C, h, w] tensor, got {latents.dtype} "
                         f"{tuple(latents.shape)}")
    record = LatentsRecord.from_metadata(metadata, path)
    if record is not None:
        record.check_latents(latents, path)
        if record.scale == SCALED:
            from ..models.taesd.model import TAESD

            latents = TAESD.unscale_latents(latents)
    return latents, record


def save_latents(latents: torch.Tensor, path: str | os.PathLike, record: LatentsRecord | None = None) -> None:
    """[N, C, h, w] raw latents -> .safetensors under key "latents", with the record as metadata."""
    from safetensors.torch import save_file

    if record is not None and record.scale != RAW:
        raise ValueError(f"save_latents stores raw latents; got a record with scale {record.scale!r}")
    metadata = None if record is None else record.to_metadata()
    save_file({LATENTS_KEY: latents.detach().cpu().contiguous()}, str(path), metadata=metadata)


def save_latents_png(latents: torch.Tensor, path: str | os.PathLike, record: LatentsRecord | None = None) -> None:
    """[1, C, h, w] raw latents with C <= 4 -> 8-bit PNG of TAESD.scale_latents (values beyond +-3 are clipped),
    with the record (scale "scaled") as text chunks."""
    from dataclasses import replace

    from PIL import Image, PngImagePlugin

    from ..models.taesd.model import TAESD

    channels = latents.shape[1]
    if channels not in PNG_CHANNELS:
        raise ValueError(
            f"latents with {channels} channels cannot be stored as a PNG (at most 4 channels, as with "
            f"taesd or taesdxl weights); write .safetensors instead"
        )
    scaled = TAESD.scale_latents(latents[0].detach().float()).mul(255).round().to(torch.uint8)
    array = scaled.permute(1, 2, 0).cpu().numpy()
    info = PngImagePlugin.PngInfo()
    if record is not None:
        for key, value in replace(record, scale=SCALED).to_metadata().items():
            info.add_text(key, value)
    # fromarray picks L / LA / RGB / RGBA from the array shape.
    Image.fromarray(array[..., 0] if channels == 1 else array).save(path, format="PNG", pnginfo=info)


@contextmanager
def _reading(path: Path):
    """Any error of a file reader (safetensors, torch.load, Pillow) -> one ValueError naming the file and the
    reader's reason (without torch.load's advice to unpickle with weights_only=False)."""
    from ..models.weights_io import reader_reason

    try:
        yield
    except Exception as err:
        raise ValueError(f"could not read latents file {path} ({type(err).__name__}: {reader_reason(err)}): it is "
                         "corrupt or truncated, or not a latents file") from err


def _show(metadata: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in list(metadata.items())[:6])
