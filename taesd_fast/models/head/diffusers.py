"""Put taesd_fast's OutputHead into diffusers' AutoencoderKLWan decoder (Wan 2.1 / 2.2 VAEs). Needs diffusers.

    vae = AutoencoderKLWan.from_pretrained("Wan-AI/Wan2.2-TI2V-5B-Diffusers", subfolder="vae", torch_dtype=...)
    patch_wan_vae(vae)   # in place; returns vae

diffusers' decoder ends in `norm_out` -> `nonlinearity` (SiLU) -> `conv_out(x, feat_cache[idx])`, and keeps the
last two post-SiLU frames in `feat_cache` itself (CACHE_T = 2). The patch swaps `norm_out` for OutputHead's
RMSNorm and `conv_out` for `FastWanHeadConv`, both holding the very same Parameters (no copy, same state_dict
keys), and leaves diffusers' forward and cache bookkeeping alone, so chunked `vae.decode(z)` works unchanged.

Differences from the unpatched decoder:
- the conv output is clamped to [-1, 1] inside the head (the kernels fuse it); diffusers clamps after unpatchify,
  which is the same elementwise. Not in `tiled_decode` (vae.enable_tiling()), which blends overlapping tiles
  before its clamp, so where a tile overshoots [-1, 1] inside a blend band the patched VAE blends clamped
  values instead: equal when nothing saturates; on a random model with 45% of pixels saturated the blend bands
  differed by up to 1.3. The untiled `vae.decode` is exact either way.
- in bf16/fp16 the RMS norm is rounded once, after the gamma multiply (diffusers rounds before it too).
"""

from __future__ import annotations

import torch
import torch.nn as nn

try:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanDecoder3d, WanRMS_norm
except ImportError as err:  # pragma: no cover - exercised only without diffusers
    raise ImportError(
        "taesd_fast.models.head.diffusers needs diffusers with AutoencoderKLWan: pip install 'diffusers>=0.35'"
    ) from err

from .model import CAUSAL_FRAMES, OutputHead, RMSNorm


class FastWanHeadConv(WanCausalConv3d):
    """`decoder.conv_out` replacement: called by diffusers as conv_out(x, cache_x), runs OutputHead.

    It is still a WanCausalConv3d, so diffusers' count of causal convs (the feat_cache length) is unchanged.
    """

    def __init__(self, conv: WanCausalConv3d, norm: RMSNorm):
        with torch.device("meta"):  # placeholders only: the real Parameters are attached below
            super().__init__(conv.in_channels, conv.out_channels, 3, padding=1)
            head = OutputHead(conv.in_channels, conv.out_channels, patch_size=None)  # diffusers unpatchifies
        head.norm_out = norm
        head.conv_out.weight, head.conv_out.bias = conv.weight, conv.bias
        # One parameter dict for both modules: whatever replaces a Parameter here (accelerate offload hooks,
        # load_state_dict(assign=True)) is what the head runs with. The head itself is not a registered
        # submodule, so state_dict keys stay decoder.conv_out.{weight,bias}.
        self._parameters = head.conv_out._parameters
        object.__setattr__(self, "head", head)

    def forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        if cache_x is not None:
            frames = cache_x.shape[2]
            if frames > CAUSAL_FRAMES:
                raise ValueError(f"cache_x has {frames} frames; the causal conv takes at most {CAUSAL_FRAMES}")
            # After a 1-frame chunk diffusers caches 1 frame and zero-pads the other: same zeros here.
            cache_x = nn.functional.pad(cache_x.to(x.device), (0, 0, 0, 0, CAUSAL_FRAMES - frames, 0))
        return self.head.forward_activated(x, cache_x)[0]


def patch_wan_vae(vae):
    """Route the decoder head of a diffusers AutoencoderKLWan through OutputHead, in place. Returns vae.

    Idempotent. The encoder is untouched (its head has no clamp).
    """
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, WanDecoder3d):
        raise TypeError(f"patch_wan_vae expects a diffusers AutoencoderKLWan, got {type(vae).__name__}")
    if isinstance(decoder.conv_out, FastWanHeadConv):
        return vae
    norm, conv = decoder.norm_out, decoder.conv_out
    problems = []
    plain_norm = isinstance(norm, WanRMS_norm) and norm.channel_first and norm.gamma.dim() == 4
    if not (plain_norm and isinstance(norm.bias, float) and norm.bias == 0.0):
        problems.append(f"norm_out is {norm!r}, not a channel-first 5-D WanRMS_norm without bias")
    if not isinstance(decoder.nonlinearity, nn.SiLU):
        problems.append(f"nonlinearity is {decoder.nonlinearity!r}, not SiLU")
    if not (type(conv) is WanCausalConv3d and conv.kernel_size == (3, 3, 3) and conv.stride == (1, 1, 1)
            and tuple(conv._padding) == (1, 1, 1, 1, 2, 0) and conv.bias is not None):
        problems.append(f"conv_out is {conv!r}, not a causal 3x3x3 conv with bias")
    if problems:
        raise ValueError("this decoder head is not the Wan head OutputHead implements: " + "; ".join(problems))
    with torch.device("meta"):
        fast_norm = RMSNorm(norm.gamma.shape[0])
    fast_norm.gamma = norm.gamma  # the same Parameter: decoder.norm_out.gamma
    decoder.norm_out = fast_norm
    decoder.conv_out = FastWanHeadConv(conv, fast_norm)
    return vae
