"""diffusers drop-in: `AutoencoderTinyWan` has the interface diffusers' Wan pipelines use of `AutoencoderKLWan`, and
runs a TAEHV (taew2_1 for Wan 2.1 / Wan 2.2 14B, taew2_2 or taew2_2_super for Wan 2.2 TI2V 5B).

    pipe.vae = AutoencoderTinyWan.from_pretrained("taew2_2", torch_dtype=torch.bfloat16, device="cuda")

What the pipelines use, and how it is met:
- `vae.config.z_dim`, `latents_mean`, `latents_std`, `scale_factor_temporal`, `scale_factor_spatial`, and
  `vae.temperal_downsample` (sic, diffusers' spelling; the video-to-video pipeline reads it), `vae.dtype`.
- `vae.decode(z, return_dict=False)[0]` / `.sample`: z is NCTHW and de-normalised by the pipeline
  (z_norm * latents_std + latents_mean); TAEHV decodes the diffusion model's own (normalised) latents, so decode
  undoes that in float32 first. Returns NCTHW video in [-1, 1], 4T - 3 frames, as AutoencoderKLWan.
- `vae.encode(video)`: NCTHW in [-1, 1] -> `.latent_dist.mode()` / `.sample()` / `.latents`, de-normalised as
  AutoencoderKLWan's encoder output is (pipelines normalise it themselves). TAEHV's encoder is deterministic.
Not supported: tiling (`enable_tiling` warns and is ignored: TAEHV needs far less memory than the Wan VAE).
`cuda_graphs` (default False): whether decode / encode replay TAEHV's whole-call CUDA graph (see TAEHV).
It inherits nothing from diffusers, so it imports without diffusers installed.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from ...value_range import warn_if_unusual_range
from ..taesd.diffusers import AutoencoderTinyFast, TinyDecoderOutput, TinyVAEConfig
from .model import TAEHV

# The latent statistics of the VAEs each TAEHV was distilled from: AutoencoderKLWan's defaults (Wan 2.1 VAE,
# 16 channels) and the Wan 2.2 TI2V 5B VAE (48 channels; Wan-Video/Wan2.2 wan/modules/vae2_2.py).
WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
              -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
             1.6382, 1.1253, 2.8251, 1.916]
WAN22_MEAN = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
              0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
              -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
              -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_STD = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885,
             0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338,
             0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458,
             1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
WAN_STATS = {"taew2_1": (WAN21_MEAN, WAN21_STD), "taew2_2": (WAN22_MEAN, WAN22_STD),
             "taew2_2_super": (WAN22_MEAN, WAN22_STD)}
# AutoencoderKLWan config keys taken from a `vae_config` (the VAE being replaced).
_FROM_VAE_CONFIG = ("latents_mean", "latents_std", "scale_factor_temporal", "scale_factor_spatial")


class DeterministicLatents:
    """What `encode(...).latent_dist` gives: TAEHV's encoder has no variance, so mode, mean and sample agree."""

    def __init__(self, latents: torch.Tensor):
        self.mean = latents

    def mode(self) -> torch.Tensor:
        return self.mean

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.mean


@dataclass
class TinyWanEncoderOutput:
    """encode's result: `.latent_dist` as AutoencoderKLWan's, `.latents` as AutoencoderTiny's."""

    latent_dist: DeterministicLatents

    @property
    def latents(self) -> torch.Tensor:
        return self.latent_dist.mean

    def __getitem__(self, index: int):
        return (self.latent_dist,)[index]


class AutoencoderTinyWan(nn.Module):
    """Drop-in for diffusers' AutoencoderKLWan in Wan pipelines; wraps a `TAEHV` (kept as `.taehv`)."""

    def __init__(self, taehv: TAEHV, *, latents_mean=None, latents_std=None, scale_factor_temporal: int | None = None,
                 scale_factor_spatial: int | None = None):
        super().__init__()
        if not isinstance(taehv, TAEHV):
            raise TypeError(f"AutoencoderTinyWan wraps a taesd_fast.TAEHV, got {type(taehv).__name__}")
        self.taehv = taehv
        known = WAN_STATS.get(taehv.variant)
        if (latents_mean is None or latents_std is None) and known is None:
            raise ValueError(f"{taehv.variant} is not a Wan TAEHV: pass latents_mean and latents_std (or vae_config) "
                             "of the VAE it replaces")
        mean = list(latents_mean if latents_mean is not None else known[0])
        std = list(latents_std if latents_std is not None else known[1])
        z_dim = taehv.latent_channels
        if len(mean) != z_dim or len(std) != z_dim:
            raise ValueError(f"latents_mean / latents_std have {len(mean)} / {len(std)} entries; the {taehv.variant} "
                             f"latents have {z_dim} channels")
        self.config = TinyVAEConfig(
            z_dim=z_dim, latents_mean=mean, latents_std=std,
            scale_factor_temporal=scale_factor_temporal or taehv.t_downscale,
            scale_factor_spatial=scale_factor_spatial or 8 * taehv.patch_size,
            patch_size=taehv.patch_size if taehv.patch_size > 1 else None, variant=taehv.variant,
        )
        self.temperal_downsample = [False, True, True]  # AutoencoderKLWan's attribute (4x time)
        self.use_slicing = False
        self.parallel = True  # False: decode one latent frame at a time (memory bounded by one step)
        # A pipeline decodes once per video, minutes apart: TAEHV's whole-call CUDA graph would save ~10 ms a video
        # and hold its memory (~1.4 GB for 121 frames at 704x1280) through the next generation. True: replay it.
        self.cuda_graphs = False
        self.train(taehv.training)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, *, variant: str | None = None,
                        torch_dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                        vae_config: dict | None = None, **kwargs) -> "AutoencoderTinyWan":
        """TAEHV.from_pretrained(name_or_path, variant=...) wrapped. vae_config: the config of the AutoencoderKLWan
        this replaces (e.g. `AutoencoderKLWan.load_config(repo, subfolder="vae")`); its latent statistics and scale
        factors are used, and its z_dim must match."""
        taehv = TAEHV.from_pretrained(name_or_path, variant=variant, dtype=torch_dtype, device=device, **kwargs)
        return cls.for_vae_config(taehv, vae_config)

    @classmethod
    def for_vae_config(cls, taehv: TAEHV, vae_config: dict | None) -> "AutoencoderTinyWan":
        if vae_config is None:
            return cls(taehv)
        z_dim = vae_config.get("z_dim", taehv.latent_channels)
        if z_dim != taehv.latent_channels:
            raise ValueError(f"the VAE config has z_dim={z_dim} but {taehv.variant} has {taehv.latent_channels} "
                             "latent channels; use taew2_1 for 16-channel Wan VAEs and taew2_2 for the 48-channel one")
        return cls(taehv, **{k: vae_config[k] for k in _FROM_VAE_CONFIG if vae_config.get(k) is not None})

    dtype = AutoencoderTinyFast.dtype  # the parameters' dtype and device, as diffusers' models report them
    device = AutoencoderTinyFast.device

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def enable_tiling(self, *args, **kwargs) -> None:
        warnings.warn("AutoencoderTinyWan does not tile; TAEHV decodes whole frames with far less memory than the "
                      "Wan VAE (use .parallel = False to bound memory by one latent frame)", stacklevel=2)

    def disable_tiling(self) -> None:
        pass

    def clear_cache(self) -> None:
        """AutoencoderKLWan's cache reset; TAEHV keeps no state between calls."""

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.config.latents_mean, dtype=torch.float32, device=like.device).view(shape)
        std = torch.tensor(self.config.latents_std, dtype=torch.float32, device=like.device).view(shape)
        return mean, std

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        """[B, 3, T, H, W] video in [-1, 1] -> de-normalised latents [B, z_dim, ceil(T / 4), H / s, W / s]."""
        self._offload_hook()
        _check_ncthw(x, "video", 3)
        # The range is checked here against this interface's [-1, 1]; TAEHV's own check of the rescaled frames would
        # give the advice for [0, 1] inputs, so it is silenced for this call.
        warn_if_unusual_range(x, (-1.0, 1.0), self.taehv._range_checked, what="video frames")
        parts = x.split(1) if self.use_slicing and x.shape[0] > 1 else (x,)
        with warnings.catch_warnings(), self._graphs():
            warnings.filterwarnings("ignore", message="video frames range over", category=UserWarning)
            latents = torch.cat([self.taehv.encode_video(p.transpose(1, 2).add(1).div(2), parallel=self.parallel)
                                 for p in parts]).transpose(1, 2)
        mean, std = self._stats(latents)
        raw = (latents.float() * std + mean).to(latents.dtype)
        dist = DeterministicLatents(raw)
        return TinyWanEncoderOutput(dist) if return_dict else (dist,)

    def decode(self, z: torch.Tensor, return_dict: bool = True):
        """[B, z_dim, T, h, w] latents as the pipeline de-normalised them -> [B, 3, 4T - 3, H, W] in [-1, 1]."""
        self._offload_hook()
        _check_ncthw(z, "latents", self.config.z_dim)
        mean, std = self._stats(z)
        normalised = ((z.float() - mean) / std).to(self.dtype)
        parts = normalised.split(1) if self.use_slicing and z.shape[0] > 1 else (normalised,)
        with self._graphs():
            frames = torch.cat([self.taehv.decode_video(p.transpose(1, 2), parallel=self.parallel) for p in parts])
        video = frames.transpose(1, 2).mul(2).sub(1)
        return TinyDecoderOutput(video) if return_dict else (video,)

    def forward(self, sample: torch.Tensor, return_dict: bool = True):
        decoded = self.decode(self.encode(sample).latent_dist.mode()).sample
        return TinyDecoderOutput(decoded) if return_dict else (decoded,)

    @contextlib.contextmanager
    def _graphs(self):
        """The wrapped TAEHV's cuda_graphs set to this adapter's for the call (its own setting is put back)."""
        saved, self.taehv.cuda_graphs = self.taehv.cuda_graphs, self.cuda_graphs
        try:
            yield
        finally:
            self.taehv.cuda_graphs = saved

    # accelerate's offload hooks move weights in forward(); pipelines call encode/decode directly, so run it there.
    _offload_hook = AutoencoderTinyFast._offload_hook


def _check_ncthw(x, name: str, channels: int) -> None:
    """diffusers' video layout is NCTHW; a one-line error for anything else (TAEHV's own NTCHW included)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 5-dim [B, C, T, H, W] (NCTHW) tensor, got {shape}")
    if x.shape[1] != channels:
        hint = " (it looks NTCHW: pass .transpose(1, 2))" if x.shape[2] == channels else ""
        raise ValueError(f"{name} must have {channels} channels at dim 1 (NCTHW), got shape {tuple(x.shape)}{hint}")
