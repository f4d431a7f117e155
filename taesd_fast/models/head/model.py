"""OutputHead: the Wan 2.2 (TI2V-5B) VAE decoder's output head.

RMS norm over channels (x / ||x|| * sqrt(C) * gamma) -> SiLU -> causal 3x3x3 conv C_in -> C_out
(two frames of causal context in front, none behind) -> clamp to [-1, 1] -> optional unpatchify to RGB.

Video is decoded in chunks (1 frame, then 4, 4, ...). Each chunk's conv sees the previous chunk's last two
post-SiLU frames; `forward` takes and returns that cache, so chunked decoding equals one-shot decoding.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ... import dispatch
from ...kernels import head_math as head_ops
from ...validation import as_float_dtype, check_device, check_tensor
from ..hub_files import OFFLINE_HINT, HubFiles, require_repo_id
from ..weights_io import WeightsError, read_state_dict

CAUSAL_FRAMES = 2  # temporal kernel 3: two frames of history
WAN_REPO = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
WAN_SUBFOLDER = "vae"
WAN_FILE = "diffusion_pytorch_model.safetensors"
# checkpoint key -> our key, for the diffusers VAE and the original Wan .pth
_KEY_LAYOUTS = {
    "diffusers": {"decoder.norm_out.gamma": "norm_out.gamma", "decoder.conv_out.weight": "conv_out.weight",
                  "decoder.conv_out.bias": "conv_out.bias"},
    "original": {"decoder.head.0.gamma": "norm_out.gamma", "decoder.head.2.weight": "conv_out.weight",
                 "decoder.head.2.bias": "conv_out.bias"},
}


class RMSNorm(nn.Module):
    """Channel-wise L2 normalisation times sqrt(C) times gamma (diffusers' WanRMS_norm, channel-first)."""

    def __init__(self, channels: int, eps: float = 1e-12):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(channels, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 at least, so bf16 features are rounded once, after the norm, not inside it.
        return head_ops.rms_norm(x, self.gamma, self.eps)


class CausalConv3d(nn.Conv3d):
    """3x3x3 conv with spatial 'same' padding; the caller supplies the two causal frames."""

    layer_name = "?"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.head_conv(x, self.weight, self.bias, layer=self)


class OutputHead(nn.Module):
    """norm_out -> SiLU -> conv_out (causal) -> clamp -> unpatchify. Keys: norm_out.gamma, conv_out.{weight,bias}."""

    def __init__(self, in_channels: int = 256, out_channels: int = 12, patch_size: int | None = 2):
        super().__init__()
        if patch_size is not None and out_channels % (patch_size * patch_size):
            raise ValueError(f"out_channels={out_channels} is not divisible by patch_size**2={patch_size**2}")
        self.patch_size = patch_size
        self.norm_out = RMSNorm(in_channels)
        self.conv_out = CausalConv3d(in_channels, out_channels, 3)
        self.conv_out.layer_name = "conv_out"

    @property
    def in_channels(self) -> int:
        return self.conv_out.in_channels

    def activate(self, features: torch.Tensor) -> torch.Tensor:
        """RMS norm then SiLU: what `forward_activated` expects to be given."""
        return head_ops.activate(features, self.norm_out.gamma, self.norm_out.eps)

    def forward(self, features: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """features: [B, C_in, T, H, W]; cache: the previous chunk's returned cache, or None for the first chunk.

        Returns (video, cache). video is [B, C_out/p², T, H*p, W*p] with patch size p (or [B, C_out, T, H, W]
        when patch_size is None), clamped to [-1, 1].
        """
        check_tensor(features, "features", channels=self.in_channels, like=self.conv_out.weight, rank=5)
        self._check_cache(features, cache)
        # One dispatched call for norm, SiLU, window, conv and unpatchify, so a kernel can fuse all of them.
        return dispatch.head_full(features, cache, self.norm_out.gamma, self.conv_out.weight, self.conv_out.bias,
                                  self.norm_out.eps, self.patch_size or 0, layer=self.conv_out)

    def forward_activated(self, activated: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Like forward, for callers that already applied the RMS norm and SiLU (see `activate`)."""
        check_tensor(activated, "activated features", channels=self.in_channels, like=self.conv_out.weight, rank=5)
        self._check_cache(activated, cache)
        window = head_ops.causal_window(activated, cache, CAUSAL_FRAMES)
        out = self.conv_out(window)
        return self.unpatchify(out), window[:, :, -CAUSAL_FRAMES:]

    @staticmethod
    def _check_cache(x: torch.Tensor, cache: torch.Tensor | None) -> None:
        b, c, _, h, w = x.shape
        if cache is not None and not isinstance(cache, torch.Tensor):
            raise TypeError(f"cache must be the tensor [B, C, {CAUSAL_FRAMES}, H, W] that the previous chunk's call "
                            f"returned, or None for the first chunk; got {type(cache).__name__}")
        if cache is not None and (cache.shape != (b, c, CAUSAL_FRAMES, h, w) or cache.dtype != x.dtype
                                  or cache.device != x.device):
            raise ValueError(
                f"cache must be the [B, C, {CAUSAL_FRAMES}, H, W] tensor returned by the previous call "
                f"({(b, c, CAUSAL_FRAMES, h, w)}, {x.dtype}, {x.device}), got {tuple(cache.shape)}, {cache.dtype}, "
                f"{cache.device}"
            )

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C_out, T, H, W] -> [B, C_out/p², T, H*p, W*p] (Wan's channel order, not pixel_shuffle's)."""
        return head_ops.unpatchify(x, self.patch_size or 0)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike = WAN_REPO,
        *,
        subfolder: str | None = WAN_SUBFOLDER,
        filename: str = WAN_FILE,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        patch_size: int | None = 2,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> "OutputHead":
        """Read only the head's tensors from a Wan VAE checkpoint (Hub repo, local .safetensors or .pth).

        The 2.8 GB safetensors file is opened lazily; only three tensors are materialised. Returns the head in eval
        mode with requires_grad off (an inference module; `.requires_grad_()` to train it).
        """
        dtype = as_float_dtype(dtype)
        device = check_device(device)  # a clear error for CUDA on a CPU-only torch, before reading the checkpoint
        path = _locate_checkpoint(name_or_path, subfolder, filename, revision, cache_dir, local_files_only)
        state = None
        for layout in _KEY_LAYOUTS.values():
            found = read_state_dict(path, keys=list(layout))
            if len(found) == len(layout):
                state = {layout[k]: v for k, v in found.items()}
                break
        if state is None:
            wanted = " or ".join(", ".join(layout) for layout in _KEY_LAYOUTS.values())
            raise WeightsError(f"{path} has no Wan output-head tensors: expected {wanted}")
        weight = state["conv_out.weight"]
        if weight.dim() != 5 or tuple(weight.shape[2:]) != (3, 3, 3):
            raise WeightsError(f"{path}: conv_out.weight should be [C_out, C_in, 3, 3, 3], got {tuple(weight.shape)}")
        head = cls(weight.shape[1], weight.shape[0], patch_size=patch_size)
        state["norm_out.gamma"] = state["norm_out.gamma"].reshape(-1, 1, 1, 1)
        head.load_state_dict(state)
        return head.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def dispatch_table(self) -> str:
        return dispatch.dispatch_table(self)


def _locate_checkpoint(name_or_path, subfolder, filename, revision, cache_dir, local_files_only) -> str:
    path = os.fspath(name_or_path)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        candidate = os.path.join(path, subfolder or "", filename)
        if not os.path.isfile(candidate):
            raise FileNotFoundError(f"no {filename} in {os.path.join(path, subfolder or '')}")
        return candidate
    path = require_repo_id(path, example=WAN_REPO)
    files = HubFiles(path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only,
                     subfolder=subfolder)
    found = files.get(filename)
    if found is not None:
        return str(found)
    name = "/".join(p for p in (subfolder, filename) if p)
    if files.unreachable is not None:
        raise FileNotFoundError(f"{name} of repo '{path}' is not in the local huggingface_hub cache and the Hub "
                                f"cannot be reached ({files.unreachable_reason()}); {OFFLINE_HINT}")
    if files.offline:
        raise FileNotFoundError(f"{name} of repo '{path}' is not in the local huggingface_hub cache (offline mode); "
                                "download it once while online, or pass a local file")
    raise FileNotFoundError(f"repo '{path}' has no {name}")
