"""Input checks with messages that say what was wrong and what was expected."""

from __future__ import annotations

import torch


def check_tensor(x, name: str, *, channels: int, like: torch.Tensor, rank: int = 4) -> None:
    """x must be a floating tensor of `rank` dims with `channels` at dim 1, on like's device and dtype."""
    layout = {4: "[B, C, H, W]", 5: "[B, C, T, H, W]"}[rank]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        hint = " (add a batch dimension with .unsqueeze(0))" if x.dim() == rank - 1 else ""
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(x.shape)}{hint}")
    if x.shape[1] != channels:
        raise ValueError(f"{name} must have {channels} channels at dim 1, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating point tensor ({like.dtype} for this model), got {x.dtype}"
            + ("; convert uint8 images with x.float() / 255" if x.dtype == torch.uint8 else "")
        )
    if x.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {x.dtype} but the model is {like.dtype}; use {name}.to({like.dtype})")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the model is on {like.device}; move one of them")


def check_multiple(images: torch.Tensor, factor: int, why: str) -> None:
    """Image height and width must be multiples of `factor`; no silent padding."""
    if images.shape[-2] % factor or images.shape[-1] % factor:
        raise ValueError(
            f"image size {tuple(images.shape[-2:])} is not a multiple of {factor} ({why}); "
            f"pad or resize the images to a multiple of {factor} first"
        )
