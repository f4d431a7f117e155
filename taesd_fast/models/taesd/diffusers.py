"""diffusers drop-in: `AutoencoderTinyFast` has diffusers' `AutoencoderTiny` interface and runs taesd_fast's TAESD.

    pipe.vae = AutoencoderTinyFast.from_pretrained("madebyollin/taesd", torch_dtype=torch.float16)
    pipe.vae = AutoencoderTinyFast.from_diffusers(pipe.vae)   # convert an AutoencoderTiny already loaded

It inherits nothing from diffusers, so it works without diffusers installed. Conventions are AutoencoderTiny's:
images in [-1, 1], latents unscaled, and `decode` is NOT clamped (DecoderTiny returns 2 * decoder(z) - 1 as is;
pipelines clamp in their image processor). Differences from AutoencoderTiny, all deliberate:
- `encode` raises when H or W is not a multiple of 8 (32 for taesana); AutoencoderTiny rounds up silently.
- `enable_tiling()` uses `taesd_fast.models.taesd.tiling`: the tiled result equals the untiled one (no blending), for
  every latent channel count (AutoencoderTiny's tiling hard-codes 4 latent and 3 image channels). Its tile_size counts
  image pixels, like AutoencoderTiny's tile_sample_min_size, and may be "auto" (fit the free memory).
- `config` is a mutable dict with attribute access, not a FrozenDict.
- TAEF2 (midblock GroupNorm) and TAESANA (f32) load here; AutoencoderTiny cannot represent them.
For the Wan 2.2 video VAE head, see `patch_wan_vae` (in taesd_fast.models.head.diffusers, which needs diffusers).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn

from ...validation import as_float_dtype, check_tensor
from ...value_range import warn_if_unusual_range
from ..layers import Block
from ..weights_io import WeightsError, from_diffusers, save_safetensors, to_diffusers
from . import hub
from .architecture import VARIANTS, Architecture, build_decoder
from .model import TAESD
from .tiling import check_tile_arguments

# Config keys a checkpoint's config.json or the caller may set; the rest describe the architecture.
SETTABLE = ("scaling_factor", "shift_factor", "latent_magnitude", "latent_shift", "force_upcast")
_DEFAULTS = {
    "scaling_factor": 1.0, "shift_factor": 0.0, "latent_magnitude": 3.0, "latent_shift": 0.5, "force_upcast": False,
}


class TinyVAEConfig(dict):
    """A diffusers-style config: keys are also attributes (`vae.config.scaling_factor`)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the VAE config has no {name!r}") from None

    def __setattr__(self, name, value):
        self[name] = value


class _Output:
    """diffusers' BaseOutput access: by field name, by index, or as a tuple."""

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    def __getitem__(self, key):
        return self.to_tuple()[key] if isinstance(key, int) else getattr(self, key)


@dataclass
class TinyEncoderOutput(_Output):
    """What `encode` returns with return_dict=True (diffusers' AutoencoderTinyOutput fields)."""

    latents: torch.Tensor


@dataclass
class TinyDecoderOutput(_Output):
    """What `decode` returns with return_dict=True (diffusers' DecoderOutput fields)."""

    sample: torch.Tensor


def architecture_config(arch: Architecture) -> dict:
    """The AutoencoderTiny config keys that describe an architecture (pipelines read block_out_channels)."""
    with torch.device("meta"):
        decoder = build_decoder(arch)
    widths, counts, blocks = [], [], []
    for layer in [*decoder, None]:  # stages end at each Upsample (and at the end)
        if isinstance(layer, Block):
            blocks.append(layer)
        elif (layer is None or isinstance(layer, nn.Upsample)) and blocks:
            widths.append(blocks[0].conv[0].out_channels)
            counts.append(len(blocks))
            blocks = []
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": arch.latent_channels, "act_fn": "relu",
        "upsample_fn": "nearest", "upsampling_scaling_factor": 2,
        "encoder_block_out_channels": (64, 64, 64, 64), "num_encoder_blocks": (1, 3, 3, 3),
        "decoder_block_out_channels": tuple(widths), "num_decoder_blocks": tuple(counts),
        # 2 ** (len(block_out_channels) - 1) is how pipelines compute vae_scale_factor: 8, or 32 for taesana
        "block_out_channels": tuple(widths),
    }


class AutoencoderTinyFast(nn.Module):
    """Drop-in for `diffusers.AutoencoderTiny`. Wraps a `TAESD` (kept as `.taesd`, upstream state_dict keys)."""

    def __init__(self, taesd: TAESD, **config):
        super().__init__()
        if not isinstance(taesd, TAESD):
            raise TypeError(f"AutoencoderTinyFast wraps a taesd_fast.TAESD, got {type(taesd).__name__}")
        unknown = sorted(set(config) - set(SETTABLE))
        if unknown:
            raise TypeError(f"unknown config keys {unknown}; settable keys are {', '.join(SETTABLE)}")
        self.taesd = taesd
        settings = {**architecture_config(taesd.arch), **_DEFAULTS, **config, "variant": taesd.variant}
        self.config = TinyVAEConfig(settings)
        self.use_tiling = False
        self.use_slicing = False
        self.tile_size: int | str = 512  # image pixels per tile side, or "auto"
        self.tile_overlap: int | None = None  # image pixels; None = the exact receptive-field radius
        self.train(taesd.training)  # from_pretrained models are in eval mode, as in diffusers

    # ------------------------------------------------------------------ loading and saving

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike | None = None,
        *,
        torch_dtype: torch.dtype | None = None,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        variant: str | None = None,
        device: torch.device | str | None = None,
        **config,
    ) -> "AutoencoderTinyFast":
        """Load like `AutoencoderTiny.from_pretrained`: a Hub repo id, a local folder (diffusers or upstream
        files), or None for the bundled TAEF2 weights. scaling_factor, shift_factor, ... come from the folder's
        config.json when it has one; keyword arguments override them.

        variant: a TAESD variant name to check the weights against ("taesd", "taef1", ...). diffusers' file
            variants ("fp16") do not exist here: pass torch_dtype instead.
        """
        if variant is not None and variant not in VARIANTS:
            raise ValueError(
                f"variant={variant!r}: here variant names a TAESD variant ({', '.join(VARIANTS)}); diffusers-style "
                "file variants such as 'fp16' are not used, pass torch_dtype=torch.float16 instead"
            )
        torch_dtype = as_float_dtype(torch_dtype, "torch_dtype")  # also "float16", as some configs spell it
        loaded = hub.resolve(pretrained_model_name_or_path, revision=revision, cache_dir=cache_dir,
                             local_files_only=local_files_only, subfolder=subfolder)
        model = TAESD.from_loaded(loaded, variant=variant, dtype=torch_dtype, device=device)
        found = loaded.config  # {} for the bundled weights and upstream-file sources
        if found.get("latent_channels", model.latent_channels) != model.latent_channels:
            raise WeightsError(
                f"config.json of {pretrained_model_name_or_path} says latent_channels={found['latent_channels']} "
                f"but its weights have {model.latent_channels}"
            )
        settings = {k: found[k] for k in SETTABLE if k in found}
        return cls(model, **{**settings, **config})

    @classmethod
    def from_diffusers(cls, vae: nn.Module) -> "AutoencoderTinyFast":
        """Convert a loaded `diffusers.AutoencoderTiny` (same weights, dtype, device and scaling settings)."""
        if not (isinstance(vae, nn.Module) and hasattr(vae, "config")):
            raise TypeError(f"expected a diffusers AutoencoderTiny, got {type(vae).__name__}")
        encoder, decoder = from_diffusers(vae.state_dict())
        source = f"a {type(vae).__name__}"
        loaded = hub.LoadedWeights(encoder or None, decoder or None, None, {"encoder": source, "decoder": source})
        param = next(vae.parameters())
        model = TAESD.from_loaded(loaded, dtype=param.dtype, device=param.device)
        settings = {k: vae.config[k] for k in SETTABLE if k in vae.config}
        return cls(model, **settings).train(vae.training)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write config.json + diffusion_pytorch_model.safetensors in diffusers' AutoencoderTiny layout.

        diffusers' AutoencoderTiny can load the result for the variants it can represent (not taef2/taesana);
        AutoencoderTinyFast.from_pretrained loads every variant.
        """
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        encoder = self.taesd.encoder.state_dict() if self.taesd.encoder is not None else None
        decoder = self.taesd.decoder.state_dict() if self.taesd.decoder is not None else None
        save_safetensors(to_diffusers(encoder, decoder), folder / hub.DIFFUSERS_WEIGHTS)
        config = {"_class_name": "AutoencoderTiny", **{k: v for k, v in self.config.items() if k != "variant"}}
        (folder / hub.DIFFUSERS_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    # ------------------------------------------------------------------ the AutoencoderTiny interface

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def enable_tiling(self, use_tiling: bool = True, *, tile_size: int | str | None = None,
                      overlap: int | None = None) -> None:
        """Decode (and encode) in tiles of tile_size image pixels (default 512; "auto": the largest tile that fits in
        the free memory, none when the image fits); exact, see tiling.py. overlap: image pixels, default exact.

        The first argument is diffusers' `use_tiling` flag, so `enable_tiling(False)` turns tiling off there too."""
        tile_size = self.tile_size if tile_size is None else tile_size
        check_tile_arguments(self.taesd, tile_size, overlap)
        self.use_tiling = bool(use_tiling)
        self.tile_size = tile_size
        self.tile_overlap = overlap

    def disable_tiling(self) -> None:
        self.use_tiling = False

    def enable_slicing(self) -> None:
        """Encode/decode a batch one sample at a time."""
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def scale_latents(self, x: torch.Tensor) -> torch.Tensor:
        """Raw latents -> [0, 1]."""
        return x.div(2 * self.config.latent_magnitude).add(self.config.latent_shift).clamp(0, 1)

    def unscale_latents(self, x: torch.Tensor) -> torch.Tensor:
        """[0, 1] -> raw latents."""
        return x.sub(self.config.latent_shift).mul(2 * self.config.latent_magnitude)

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        """[B, 3, H, W] images in [-1, 1] -> latents (`.latents`, or a 1-tuple with return_dict=False)."""
        self._offload_hook()
        check_tensor(x, "images", channels=3, like=self.taesd._param("encoder"))
        warn_if_unusual_range(x, (-1.0, 1.0), self.taesd._range_checked)
        parts = x.split(1) if self.use_slicing and x.shape[0] > 1 else (x,)
        latents = torch.cat([self._encode01(p.add(1).div(2)) for p in parts])
        return TinyEncoderOutput(latents) if return_dict else (latents,)

    def decode(self, z: torch.Tensor, generator: torch.Generator | None = None, return_dict: bool = True):
        """Latents -> images in about [-1, 1], unclamped like AutoencoderTiny (`.sample`, or a 1-tuple).

        generator is accepted for pipeline compatibility and unused (decoding is deterministic).
        """
        self._offload_hook()
        check_tensor(z, "latents", channels=self.taesd.latent_channels, like=self.taesd._param("decoder"))
        parts = z.split(1) if self.use_slicing and z.shape[0] > 1 else (z,)
        images = torch.cat([self._decode_raw(p) for p in parts]).mul(2).sub(1)
        return TinyDecoderOutput(images) if return_dict else (images,)

    def forward(self, sample: torch.Tensor, return_dict: bool = True):
        """Round trip through 8-bit latents, as AutoencoderTiny.forward does."""
        latents = self.encode(sample).latents
        stored = self.scale_latents(latents).mul(255).round().byte()
        decoded = self.decode(self.unscale_latents(stored / 255.0).to(latents.dtype)).sample
        return TinyDecoderOutput(decoded) if return_dict else (decoded,)

    # ------------------------------------------------------------------ internals

    def _tiling(self) -> tuple[int | str | None, int | None]:
        return (self.tile_size, self.tile_overlap) if self.use_tiling else (None, None)

    def _encode01(self, images: torch.Tensor) -> torch.Tensor:
        return self.taesd._encode(images, *self._tiling(), value_range=None)  # encode() checked the [-1, 1] range

    def _decode_raw(self, z: torch.Tensor) -> torch.Tensor:
        # unclamped, as DecoderTiny; untiled, a graph replay from a shape's second call on
        return self.taesd._decode(z, *self._tiling(), clamp=False)

    def _offload_hook(self) -> None:
        # accelerate's offload hooks move weights in forward(); pipelines call encode/decode directly, so run the
        # hook here (what diffusers' apply_forward_hook does for its models).
        hook = getattr(self, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self)

    def extra_repr(self) -> str:
        return f"scaling_factor={self.config.scaling_factor}, shift_factor={self.config.shift_factor}"
