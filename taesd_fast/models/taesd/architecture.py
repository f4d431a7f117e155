"""The published TAESD architectures, built as bare nn.Sequentials so upstream keys load unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..layers import Block, Clamp, ReLUSequential, conv3x3


@dataclass(frozen=True)
class Architecture:
    latent_channels: int
    midblock_gn: bool = False  # TAEF2: pool branch in the encoder's last 3 and the decoder's first 3 Blocks
    f32: bool = False  # TAESANA: 32x down/up-sampling instead of 8x

    @property
    def downscale(self) -> int:
        return 32 if self.f32 else 8

    def describe(self) -> str:
        extras = [s for s, on in (("midblock GN", self.midblock_gn), ("f32 layout", self.f32)) if on]
        return ", ".join([f"{self.latent_channels} latent channels", *extras])


# Published variants. taesd/taesdxl and taesd3/taef1 share an architecture: only the name tells them apart.
VARIANTS: dict[str, Architecture] = {
    "taesd": Architecture(4),
    "taesdxl": Architecture(4),
    "taesd3": Architecture(16),
    "taef1": Architecture(16),
    "taef2": Architecture(32, midblock_gn=True),
    "taesana": Architecture(32, f32=True),
}

# Channel widths of the decoder's stages, top to bottom; the encoder mirrors the f8 one.
_DECODER_WIDTHS = {False: (64, 64, 64, 64), True: (256, 128, 64, 64, 64, 64)}


def build_encoder(arch: Architecture) -> nn.Sequential:
    if arch.f32:
        # Two stride-2 convs replace the f8 stem's full-resolution conv.
        layers: list[nn.Module] = [conv3x3(3, 32, stride=2), nn.ReLU(), conv3x3(32, 64, stride=2), nn.ReLU(), Block(64, 64)]
    else:
        layers = [conv3x3(3, 64), Block(64, 64)]
    for stage in range(3):
        gn = arch.midblock_gn and stage == 2
        layers += [conv3x3(64, 64, stride=2, bias=False), *(Block(64, 64, gn) for _ in range(3))]
    layers.append(conv3x3(64, arch.latent_channels))
    return ReLUSequential(*layers)


def build_decoder(arch: Architecture) -> nn.Sequential:
    widths = _DECODER_WIDTHS[arch.f32]
    layers: list[nn.Module] = [Clamp(), conv3x3(arch.latent_channels, widths[0]), nn.ReLU()]
    for stage, (width, next_width) in enumerate(zip(widths, widths[1:])):
        gn = arch.midblock_gn and stage == 0
        layers += [*(Block(width, width, gn) for _ in range(3)), nn.Upsample(scale_factor=2)]
        layers.append(conv3x3(width, next_width, bias=False))
    layers += [Block(widths[-1], widths[-1]), conv3x3(widths[-1], 3)]
    return ReLUSequential(*layers)
