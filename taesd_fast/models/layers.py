"""Building blocks whose parameter names match the upstream TAESD state_dict keys.

Every convolution is a `DispatchConv2d`: an `nn.Conv2d` (so `weight`/`bias` keys and
initialisation are PyTorch's) whose forward goes through `taesd_fast.dispatch`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import dispatch
from ..validation import warn_if_slow_on_cpu


class DispatchConv2d(nn.Conv2d):
    """nn.Conv2d with 'same' padding whose forward asks the dispatcher which implementation runs.

    `residual` and `relu` let callers hand the epilogue to the dispatcher, so a kernel can fuse it:
    y = conv(x) + bias (+ residual), then ReLU if `relu`.
    """

    layer_name = "?"  # set by `name_layers` to the module's path, for the dispatch table

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, relu: bool = False,
                upsample: int = 1, pre_clamp: bool = False) -> torch.Tensor:
        return dispatch.conv2d(x, self.weight, self.bias, stride=self.stride[0], residual=residual, relu=relu,
                               upsample=upsample, pre_clamp=pre_clamp, layer=self)


def conv3x3(n_in: int, n_out: int, stride: int = 1, bias: bool = True) -> DispatchConv2d:
    return DispatchConv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


def conv1x1(n_in: int, n_out: int) -> DispatchConv2d:
    return DispatchConv2d(n_in, n_out, 1, bias=False)


class Clamp(nn.Module):
    """Soft clamp of the latents to (-3, 3), the first step of every TAESD decoder."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.soft_clamp(x)


class Block(nn.Module):
    """Residual block: relu(conv-relu-conv-relu-conv(x) + skip(x)), with TAEF2's optional pool branch.

    Keys: conv.{0,2,4}.{weight,bias}, skip.weight (only when n_in != n_out),
    pool.0.weight, pool.1.{weight,bias}, pool.3.weight (only with midblock GN).
    """

    def __init__(self, n_in: int, n_out: int, midblock_gn: bool = False):
        super().__init__()
        self.conv = nn.Sequential(conv3x3(n_in, n_out), nn.ReLU(), conv3x3(n_out, n_out), nn.ReLU(), conv3x3(n_out, n_out))
        self.skip = conv1x1(n_in, n_out) if n_in != n_out else nn.Identity()
        self.fuse = nn.ReLU()
        self.pool = None
        if midblock_gn:
            # TAEF2's global branch: GroupNorm statistics span the whole image, giving the block global context.
            width = 4 * n_in
            self.pool = nn.Sequential(conv1x1(n_in, width), nn.GroupNorm(4, width), nn.ReLU(), conv1x1(width, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        first, _, second, _, third = self.conv
        h = first(x, relu=True)
        h = second(h, relu=True)
        # The last conv takes the skip and the block's final ReLU as its epilogue.
        return third(h, residual=self.skip(x), relu=True)


def _nearest_factor(module: nn.Module) -> int | None:
    """The integer factor of a nearest nn.Upsample (the decoder's), else None."""
    if not isinstance(module, nn.Upsample) or module.mode != "nearest" or module.size is not None:
        return None
    f = module.scale_factor
    return int(f) if isinstance(f, (int, float)) and float(f).is_integer() else None


class ReLUSequential(nn.Sequential):
    """nn.Sequential that hands the dispatcher fused calls: a Clamp or a nearest nn.Upsample followed by a conv (a
    kernel may fold either into the conv), and a conv followed by nn.ReLU.

    Keys and indices are those of a plain nn.Sequential; only the forward differs.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules = list(self)
        i = 0
        while i < len(modules):
            upsample, pre_clamp = _nearest_factor(modules[i]), isinstance(modules[i], Clamp)
            if (upsample is not None or pre_clamp) and i + 1 < len(modules) and isinstance(modules[i + 1], DispatchConv2d):
                i += 1  # the conv does the upsample / clamp
            else:
                upsample, pre_clamp = 1, False
            module = modules[i]
            if isinstance(module, DispatchConv2d):
                relu = i + 1 < len(modules) and isinstance(modules[i + 1], nn.ReLU)
                x = module(x, relu=relu, upsample=upsample or 1, pre_clamp=pre_clamp)
                i += 2 if relu else 1
            else:
                x = module(x)
                i += 1
        return x


def conv_weights_channels_last(module: nn.Module) -> None:
    """Keep a model's 4-D (conv) weights channels_last on CUDA, where cuDNN and our tensor-core kernels run TAESD's
    and TAEHV's convs fastest (TAESD's 64-channel convs ~1.5x faster in cuDNN, ANCHORS.md); values and keys stay.
    Called from the models' `_apply`, so every `.to()` / `.cuda()` / `.half()` keeps it."""
    for param in module.parameters():
        if param.is_cuda and param.dim() == 4:
            param.data = param.data.contiguous(memory_format=torch.channels_last)


def preferred_format(device: torch.device) -> torch.memory_format:
    """The memory layout the models run fastest with on `device`: channels_last on CUDA."""
    return torch.channels_last if torch.device(device).type == "cuda" else torch.contiguous_format


def preferred_layout(x: torch.Tensor) -> torch.Tensor:
    """x in the memory layout the models run fastest with on its device (`preferred_format`)."""
    return x.contiguous(memory_format=preferred_format(x.device)) if x.is_cuda else x


def name_layers(root: nn.Module, prefix: str = "") -> None:
    """Give every DispatchConv2d its module path, so dispatch choices can be reported per layer."""
    for name, module in root.named_modules(prefix=prefix):
        if isinstance(module, DispatchConv2d):
            module.layer_name = name


class TinyAutoencoder(nn.Module):
    """What TAESD and TAEHV share: their architecture record and variant name, the encoder and decoder Sequentials
    (either may be None; built before the layers are named for the dispatch table), the CUDA-graph switch with the
    whole-call graph caches it governs (`graph_caches`: name -> graphs.GraphCache), the input signatures whose
    value range was checked (value_range), and what a move (`.to()`, `.half()`, ...) must redo."""

    def __init__(self, arch, variant: str | None, encoder: nn.Module | None, decoder: nn.Module | None,
                 graph_caches: dict | None = None):
        super().__init__()
        self.arch, self.variant = arch, variant
        self.encoder = encoder
        self.decoder = decoder
        name_layers(self)
        self.cuda_graphs = True
        self._graph_caches = graph_caches or {}
        self._range_checked: set = set()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for cache in self._graph_caches.values():  # graphs hold the old weights' addresses and memory
            cache.clear()
        conv_weights_channels_last(self)  # and the models take their inputs channels_last (preferred_layout)
        dispatch.prepare(self)
        warn_if_slow_on_cpu(self)
        return self

    @property
    def latent_channels(self) -> int:
        return self.arch.latent_channels
