"""Input checks with messages that say what was wrong and what was expected."""

from __future__ import annotations

import torch


def check_tensor(x, name: str, *, channels: int, like: torch.Tensor, rank: int = 4) -> None:
    """x must be a floating tensor of `rank` dims with `channels` at dim 1, on like's device and dtype."""
    layout = {4: "[B, C, H, W]", 5: "[B, C, T, H, W]"}[rank]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(x.shape)}"
                         f"{_missing_dim_hint(x, rank, channels)}")
    if x.shape[1] != channels:
        raise ValueError(f"{name} must have {channels} channels at dim 1, got shape {tuple(x.shape)}")
    if 0 in x.shape[2:]:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(x.shape)} {layout}; every size after C must be >= 1")
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


def _missing_dim_hint(x: torch.Tensor, rank: int, channels: int) -> str:
    """Which unsqueeze turns a tensor one dimension short into the expected layout, when that is clear."""
    if x.dim() != rank - 1:
        return ""
    if x.shape[0] == channels:
        return " (add a batch dimension with .unsqueeze(0))"
    if rank == 5 and x.shape[1] == channels:  # [B, C, H, W]: one frame per sample
        return " (add a time dimension with .unsqueeze(2))"
    return ""


_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def as_float_dtype(dtype, name: str = "dtype") -> torch.dtype | None:
    """None, a floating torch.dtype, or its name ("float16", "torch.bfloat16", "fp16", ...) -> torch.dtype or None."""
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        resolved = getattr(torch, _DTYPE_ALIASES.get(key, key), None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{name}={dtype!r} is not a torch dtype; use e.g. torch.float16 or \"float16\"")
        dtype = resolved
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{name} must be a floating point dtype such as torch.float16, got {dtype!r}")
    return dtype
