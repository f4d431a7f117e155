"""The GPU facts the kernels' support rules and launch shapes read: compute capability and SM count, asked once
per device (each query costs a driver call)."""

from __future__ import annotations

import functools

import torch

__all__ = ["capability", "is_sm90", "sm_count"]


@functools.cache
def capability(device: torch.device | str) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device."""
    return torch.cuda.get_device_capability(torch.device(device))


def is_sm90(device: torch.device | str) -> bool:
    """True for a Hopper GPU (sm_90): the wgmma and TMA kernels are built for it. False for CPU devices."""
    device = torch.device(device)
    return device.type == "cuda" and capability(device)[0] == 9


@functools.cache
def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device: the one-wave limits of the latency kernels."""
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
