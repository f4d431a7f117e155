"""Row "triton_fused" (kind head_full): the fused head (head_full_common.py: RMS norm + SiLU + causal temporal GEMM
straight from the raw features into g, then the stencil) with the Triton g kernels of triton_fused_kernel.py, on any
CUDA GPU Triton runs on (and on CPU tensors under TRITON_INTERPRET=1, which is how the CPU tests run them).

CONFIG holds the kernel settings the row launches with: the variant ("roll" or "per_t", triton_fused_kernel.py)
and its tiles, the best of a sweep on the H200 unless set_default_config changes them. `launch_head_g` is the raw
launch (no device check); `launch_g` is the row's g kernel for head_full_common's driver.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .head_full_common import N_PAD, contract_spec_reason, flat_pixels, packed_taps, row_run
from .head_g_layout import CAUSAL, GC
from .head_stencil import stencil_ready
from .triton_bf16 import INTERPRETED
from .triton_fused_kernel import KERNELS
from .triton_import import TRITON_ERROR, triton

NAME = "triton_fused"
VARIANTS = ("roll", "per_t")
DEFAULT_CONFIG = {"variant": "roll", "block_m": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}

__all__ = ["DEFAULT_CONFIG", "VARIANTS", "launch_g", "launch_head_g", "run", "set_default_config",
           "spec_ready", "spec_unsupported_reason"]


def set_default_config(**config) -> None:
    """Set the kernel config the row launches with (variant, block_m, block_k, num_warps, num_stages), e.g. the
    winner of a benchmark sweep. Unknown keys and variants raise."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"set_default_config: unknown keys {sorted(unknown)}; expected {sorted(DEFAULT_CONFIG)}")
    if config.get("variant", "roll") not in VARIANTS:
        raise ValueError(f"set_default_config: variant must be one of {VARIANTS}, got {config['variant']!r}")
    DEFAULT_CONFIG.update(config)


def launch_head_g(features: Tensor, cache: Tensor | None, gs: Tensor, wk: Tensor, g: Tensor, new_cache: Tensor,
                  eps: float, *, variant: str = "roll", block_m: int = 64, block_k: int = 64,
                  num_warps: int = 8, num_stages: int = 2) -> None:
    """Raw launch of the g kernel into caller-made g [B, T, H, W, GC] (dense) and new_cache [B, C, 2, H, W]
    (contiguous). gs = scale*gamma fp32 [C], wk = pack_weight_taps(weight). No device check: CPU tensors run
    under TRITON_INTERPRET=1. Arguments as fused_head checks them."""
    if triton is None:
        raise RuntimeError(f"launch_head_g: {TRITON_ERROR}")
    if variant not in VARIANTS:
        raise ValueError(f"launch_head_g: variant must be one of {VARIANTS}, got {variant!r}")
    for name, v in (("block_m", block_m), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"launch_head_g: {name} must be a power of two >= 16 (tl.dot tiles), got {v}")
    b, c, t, h, w = features.shape
    hw = h * w
    if tuple(g.shape) != (b, t, h, w, GC) or not g.is_contiguous():
        raise ValueError(f"launch_head_g: g must be contiguous {(b, t, h, w, GC)}, got {tuple(g.shape)}")
    if tuple(new_cache.shape) != (b, c, CAUSAL, h, w) or not new_cache.is_contiguous():
        raise ValueError(f"launch_head_g: new_cache must be contiguous {(b, c, CAUSAL, h, w)}")
    if tuple(wk.shape) != (3, c, N_PAD) or not wk.is_contiguous() or gs.shape != (c,) or not gs.is_contiguous():
        raise ValueError(f"launch_head_g: wk must be [3, {c}, {N_PAD}] and gs [{c}], contiguous")
    features = flat_pixels(features)
    cache = None if cache is None else flat_pixels(cache)
    # Inside one image, offsets are int32 (the kernels widen only the batch offset).
    for name, x in (("features", features), ("cache", cache)):
        if x is not None and x.stride(1) * (c - 1) + x.stride(2) * (x.shape[2] - 1) + hw >= 2**31:
            raise ValueError(f"launch_head_g: one image of {name} spans >= 2**31 elements; split it")
    if t * hw * GC >= 2**31 or c * 2 * hw >= 2**31:
        raise ValueError("launch_head_g: g or new_cache of one image would span >= 2**31 elements; split T or H")
    if b > 65535:
        raise ValueError(f"launch_head_g: B={b} > 65535 (grid y)")
    cache_arg = features if cache is None else cache  # any valid pointer; unused when HAS_CACHE is False
    ints = (t, hw, features.stride(0), features.stride(1), features.stride(2),
            cache_arg.stride(0), cache_arg.stride(1), cache_arg.stride(2))
    npb = triton.cdiv(hw, block_m)
    grid = (npb if variant == "roll" else npb * t, b)
    cfg = (variant, block_m, min(block_k, c), num_warps, num_stages)
    KERNELS[variant][grid](
        features, cache_arg, gs, wk, g, new_cache, *ints, float(eps),
        C=c, N=N_PAD, G=GC, BLOCK_M=block_m, BK=cfg[2], HAS_CACHE=cache is not None, INTERP=INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    if features.is_cuda:
        _compiled.add(_specialisation(features.device, cfg, c, cache is not None, ints))


def launch_g(features: Tensor, cache: Tensor | None, gs: Tensor, weight: Tensor, g: Tensor, new_cache: Tensor,
             eps: float, **config) -> None:
    """The row's g kernel for head_full_common.fused_head_with: DEFAULT_CONFIG, updated by `config`."""
    if triton is None:
        raise ValueError(f"fused_head: row {NAME!r} cannot run this call: {TRITON_ERROR}")
    launch_head_g(features, cache, gs, packed_taps(weight, transposed=False), g, new_cache, eps,
                  **{**DEFAULT_CONFIG, **config})


# Triton compiles one binary per specialisation: int arguments equal to 1 become constants, multiples of 16 get a
# divisibility hint (pointers too; fresh allocations are 16-byte aligned). Recorded after each launch, so
# spec_ready can tell whether a call would compile (not allowed in the middle of a CUDA-graph capture).
_compiled: set = set()


def _specialisation(device, cfg: tuple, c: int, has_cache: bool, ints: tuple) -> tuple:
    return (str(torch.device(device)), cfg, c, has_cache, tuple((v == 1, v % 16 == 0) for v in ints))


def _contiguous_ints(c: int, t: int, h: int, w: int, has_cache: bool) -> tuple:
    """launch_head_g's int arguments for contiguous features and cache (without a cache, features stand in)."""
    hw = h * w
    x = (c * t * hw, t * hw, hw)
    return (t, hw, *x, *((c * 2 * hw, 2 * hw, hw) if has_cache else x))


def spec_unsupported_reason(spec) -> str | None:
    """The fused head's contract (head_full_common), with Triton."""
    return contract_spec_reason(spec) or TRITON_ERROR


def spec_ready(spec) -> bool:
    """True once this shape's g kernel (contiguous inputs, DEFAULT_CONFIG: what `run` launches) and the stencil are
    loaded: launching then compiles nothing, so it is safe inside a CUDA-graph capture."""
    b, c, t, h, w = spec.x_shape
    cfg = DEFAULT_CONFIG
    key = _specialisation(spec.device, (cfg["variant"], cfg["block_m"], min(cfg["block_k"], c), cfg["num_warps"],
                                        cfg["num_stages"]), c, bool(spec.residual),
                          _contiguous_ints(c, t, h, w, bool(spec.residual)))
    return key in _compiled and stencil_ready(spec)


run = row_run(NAME)
