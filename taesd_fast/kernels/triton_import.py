"""Triton, imported once for every Triton kernel module. Triton is optional: without it (or with a broken install)
the names are None and TRITON_ERROR says why; the kernels report that as their reason and the package still
imports. Importing this module imports Triton (about a second), so the package imports kernel modules lazily."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_ERROR: str | None = None
except Exception as e:  # noqa: BLE001  ImportError, or a broken install raising something else
    triton = tl = gdc_launch_dependents = gdc_wait = None
    TRITON_ERROR = f"triton not importable ({type(e).__name__}: {e})"

__all__ = ["TRITON_ERROR", "gdc_launch_dependents", "gdc_wait", "interpreting", "tl", "triton", "triton_available",
           "triton_unavailable_reason"]


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: Triton kernels then run as Python on CPU tensors (how the CPU tests run them)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device | str | None = "cuda") -> str | None:
    """Why a Triton kernel cannot run on `device` here, or None. Under TRITON_INTERPRET=1 any device works."""
    if TRITON_ERROR is not None:
        return TRITON_ERROR
    if interpreting():
        return None
    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return f"device {dev} (Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from .device import capability

    major, minor = capability(dev)
    if major < 8:  # f16/bf16 mma.sync with fp32 accumulation as Triton emits it: Ampere and newer
        return f"compute capability {major}.{minor} (needs >= 8.0)"
    return None


def triton_available(device: torch.device | str | None = "cuda") -> bool:
    return triton_unavailable_reason(device) is None
