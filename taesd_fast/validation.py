"""Input checks with messages that say what was wrong and what was expected."""

from __future__ import annotations

import os
import sys
import warnings

import torch

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


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


def check_device(device, name: str = "device") -> torch.device | None:
    """None, or a torch.device / its name -> torch.device, refusing a CUDA device this torch cannot use.

    Without this check, moving a model to "cuda" on a CPU-only torch fails deep inside torch with an
    AssertionError ("Torch not compiled with CUDA enabled"). `name` is how the caller spells the argument in
    messages: "device" (device='cuda') or a command-line flag such as "--device" (--device cuda).
    """
    if device is None:
        return None
    given = f"{name} {device}" if name.startswith("-") else f"{name}={str(device)!r}"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{given} is not a torch device (expected e.g. cpu, cuda, cuda:1)") from None
    if device.type != "cuda":
        return device
    fallback = f"use {name} cpu" if name.startswith("-") else f"use {name}='cpu'"
    if torch.version.cuda is None:
        raise RuntimeError(f"{given} needs CUDA, but torch {torch.__version__} is a CPU-only build; install a CUDA "
                           f"build of torch (pytorch.org/get-started) or {fallback}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{given} needs CUDA, but torch {torch.__version__} sees no CUDA device (no GPU, a "
                           f"driver problem, or CUDA_VISIBLE_DEVICES hides it); {fallback}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{given}: only {torch.cuda.device_count()} CUDA device(s) present "
                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def user_stacklevel() -> int:
    """The `stacklevel` for a warnings.warn call, made in the function that calls this, that points at the first
    caller outside this package and torch (a model method may be reached through several of our functions or
    through nn.Module.to), so the warning names the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith((_PACKAGE_DIR, _TORCH_DIR)):
        frame, level = frame.f_back, level + 1
    return level


# Which oneDNN check says a CPU runs convolutions of this dtype natively.
_ONEDNN_CHECKS = {torch.float16: "_is_mkldnn_fp16_supported", torch.bfloat16: "_is_mkldnn_bf16_supported"}


def cpu_has_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU runs PyTorch convolutions in `dtype` at about float32's speed.

    float16 and bfloat16 are fast on a CPU only through oneDNN, which needs the matching instructions (AVX512-FP16
    or AMX-FP16 for float16; AVX512-BF16 or AMX for bfloat16). Elsewhere, or with oneDNN off, PyTorch runs a
    reference loop instead: measured here with oneDNN off, a 128² TAEF2 encode took 12.2 s in float16 against
    0.11 s in float32 (110x), and a user's CPU took 194 s against 0.84 s for a 512² encode (230x)."""
    check = _ONEDNN_CHECKS.get(dtype)
    if check is None:
        return True
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                    and getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: assume the slow path
        return False


def warn_if_slow_on_cpu(model: torch.nn.Module) -> None:
    """Warn, once per model and dtype, when `model` sits on the CPU in a dtype this CPU convolves slowly
    (cpu_has_fast): a GPU snippet (dtype=torch.float16) run on a CPU machine is otherwise 100x slower, silently.
    Called from the models' `_apply`, so from_pretrained, `.to()` and `.half()` all reach it."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or cpu_has_fast(param.dtype):
        return
    warned = model.__dict__.setdefault("_slow_dtype_warned", set())
    if param.dtype in warned:
        return
    warned.add(param.dtype)
    name = str(param.dtype).replace("torch.", "")
    warnings.warn(f"{type(model).__name__} is in {name} on the CPU, and this CPU has no fast {name} convolution in "
                  f"PyTorch (oneDNN needs {'AVX512-FP16 or AMX-FP16' if name == 'float16' else 'AVX512-BF16 or AMX'}"
                  f"), so every call runs about 100x slower than in float32; use float32 on the CPU "
                  f"(dtype=torch.float32; in the taesd-fast command, leave out --dtype): {name} is for CUDA GPUs",
                  stacklevel=user_stacklevel())
