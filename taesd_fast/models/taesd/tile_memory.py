"""How much memory a tiled or untiled TAESD run needs, and how much is free: what `tile_size="auto"` decides with.

The estimate walks the encoder/decoder Sequential and finds its widest activation, in elements per image pixel (64
channels at full resolution for every f8 variant; TAEF2's untiled GroupNorm branch holds 256 channels at 1/64 of the
pixels, 4 per pixel). While a layer runs, about LIVE activations of that width are alive at once: a Block keeps its
input for the skip while its convs read one buffer and write another, and the CPU convolution adds a workspace.
LIVE comes from measurement: an untiled CPU fp32 decode of the real TAEF2 at 768 px peaked at about 4x its widest
activation, so LIVE = 4.5 estimates 1.12x of that peak. With tiling.memory_needed's phases, the estimates of 256 px
tiles on the CPU are 1.10x (decode) and 1.16x (encode) of the measured peaks. On an H200 in fp16 (bundled TAEF2,
768-2048 px, tiles of 256 and 512) they were 1.07-1.36x, and 1.12x untiled; never below the peak.
tests/test_tiling.py::test_memory_estimate_bounds_the_measured_peak re-measures the CPU cases in a subprocess.
"""

from __future__ import annotations

import torch
from torch import nn

from ...host_memory import available_ram
from ..layers import Block

LIVE = 4.5
# Plan with this share of the free memory: the allocator rounds and fragments, and other work may start meanwhile.
HEADROOM = 0.75


def widest_activation(layers: nn.Sequential, channels: int, scale: float) -> tuple[float, int, float]:
    """(largest activation of layers, its input included, in elements per image pixel; output channels; output scale).

    channels, scale: the input's channel count and its pixels per image pixel along one side (1/8 for f8 latents)."""
    widest = channels * scale * scale
    for layer in layers:
        if isinstance(layer, nn.Conv2d):
            channels, scale = layer.out_channels, scale / layer.stride[0]
        elif isinstance(layer, nn.Upsample):
            scale *= float(layer.scale_factor)
        elif isinstance(layer, Block):
            channels = layer.conv[0].out_channels
            if layer.pool is not None:
                widest = max(widest, layer.pool[0].out_channels * scale * scale)
        widest = max(widest, channels * scale * scale)
    return widest, channels, scale


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can use now: on CUDA what the driver reports free plus what PyTorch's
    caching allocator holds unused; elsewhere the available RAM."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return available_ram()
