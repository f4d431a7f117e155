"""The TAEHV memory block's first conv without its concatenation (row "triton_mem_conv", kind "mem_conv", Hopper+).

A memory block convolves cat([x, past]) (3x3, 2C -> C_out), where `past` is x one frame earlier (each sample's first
frame: the carried memory, or zeros at the start of a video). PyTorch builds `past` and the 2C-channel cat, two
copies of the activations per block. This kernel reads both K halves where they already are: the x half from x's
frame, the past half from the frame before it through the same NHWC TMA descriptor (the memory frame through a
second one), into one accumulator. It is triton_conv_tma's implicit GEMM (tiles of TILE_H x TILE_W pixels, one
TMA box per tap and channel chunk, the packed weight and fused epilogue shared with the other tensor-core convs),
in one launch over every frame: each program reads its frame's past from x or, for a sample's first frame, from
the memory (one launch fills the GPU's waves where two, one per source, each left a partly empty last wave).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .conv_contract import f16_3x3_reason, new_out
from .conv_epilogue import epilogue, tile_origin
from .conv_launch import mark_launched, mem_operands, on_device, spec_launched
from .conv_pack import Plan, packed_weight, plan
from .device import capability
from .tma_pdl import pdl_args, pdl_start
from .triton_conv_tma import TMAConfig, default_config, device_sms, grid_tiles
from .triton_import import TRITON_ERROR, tl, triton, triton_unavailable_reason

if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

NAME = "triton_mem_conv"
MAX_CHANNELS = 256  # per half of the input, and out


def mem_plan(c: int, c_out: int) -> Plan:
    """The packed weight's plan for 2c input channels: K chunks of min(64, pow2(c)) channels, so that each chunk lies
    wholly in x's half or the past's."""
    return plan(2 * c, c_out, 1, min(64, 1 << max(0, (c - 1).bit_length())))


def mem_config(c_out: int, x_shape, device: torch.device) -> TMAConfig:
    """triton_conv_tma's config where its programs give every SM one. On smaller grids (a streaming step's one frame
    at 44x80 to 88x160) the channels go in 64-wide blocks (three stages: this kernel holds both halves' buffers, and
    four left one program per SM), and where that is still short of the SMs, tiles of 8 x 8 pixels. On the H200 at
    one frame: 0.030 ms against 0.071 at 256 channels, 44x80; 0.026 against 0.039 at 128, 88x160."""
    base = default_config(c_out)
    bn = plan(64, c_out, 1).block_n
    blocks = -(-c_out // bn)
    tiles, sms = grid_tiles(x_shape), device_sms(device)
    if tiles * blocks >= sms:
        return base
    if bn > 64 and tiles * blocks * (bn // 64) >= sms:
        return TMAConfig(128, 4, 3, 16, block_n=64)
    return TMAConfig(64, 4, 3, 8, block_n=min(64, bn))


def unsupported_reason(x_shape, w_shape, dtype, frames: int, device: torch.device) -> str | None:
    """Why this kernel cannot take the call (None: it can), from shapes only."""
    c_in, c_out = w_shape[1], w_shape[0]
    if c_in % 2 or c_in // 2 != x_shape[1]:
        return f"weight takes {c_in} channels, expected 2 x the input's {x_shape[1]} (x and its past)"
    reason = f16_3x3_reason((x_shape[0], c_in, *x_shape[2:]), w_shape, dtype, 1, 2 * MAX_CHANNELS)
    if reason is not None:
        return reason
    c = x_shape[1]
    block_k = mem_plan(c, c_out).block_k
    if c < 16 or c % block_k or c_out > MAX_CHANNELS:
        return (f"needs <= {MAX_CHANNELS} channels out and per half 16 or more, a multiple of {block_k}; "
                f"got {c} -> {c_out}")
    if frames < 1 or x_shape[0] % frames:
        return f"{x_shape[0]} frames do not split into samples of {frames}"
    if device.type == "cuda" and capability(device)[0] < 9:
        return "TMA needs compute capability 9.0 (Hopper) or newer"
    return None


if triton is not None:

    @triton.jit
    def _half(acc, desc, img, gy0, gx0, w_ptr, rk, rn, FIRST: tl.constexpr, HALF: tl.constexpr, N_PAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc + one K half: frame `img` of desc (x, its previous frame, or the memory) times the packed weight's
        chunks FIRST..FIRST+HALF-1 of every tap."""
        for kk in range(9 * HALF):
            tap = kk // HALF
            chunk = kk % HALF
            a = desc.load([img, gy0 - 1 + tap // 3, gx0 - 1 + tap % 3, chunk * BLOCK_K])
            wt = tl.load(w_ptr + ((tap * 2 * HALF + FIRST + chunk) * BLOCK_K + rk)[:, None] * N_PAD + rn[None, :])
            acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), wt, acc)
        return acc

    @triton.jit(do_not_specialize=["H", "W", "TILES_Y", "TILES_X", "K"])
    def _mem_conv_kernel(
        x_desc, m_desc, w_ptr, b_ptr, y_ptr,
        H, W, TILES_Y, TILES_X, K,  # K frames per sample
        C_OUT: tl.constexpr, N_PAD: tl.constexpr, HALF: tl.constexpr, HAS_MEMORY: tl.constexpr,
        HAS_BIAS: tl.constexpr, RELU: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl_start(PDL)
        BLOCK_M: tl.constexpr = TILE_H * TILE_W
        # img: x's frame, also the output frame
        img, gy0, gx0, rn = tile_origin(tl.program_id(0), TILES_Y, TILES_X, TILE_H, TILE_W, C_OUT, BLOCK_N)
        sample = img // K
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Packed weight row (tap * 2 * HALF + chunk) * BLOCK_K + k: chunks 0..HALF-1 are x's, HALF..2*HALF-1 the past's.
        acc = _half(acc, x_desc, img, gy0, gx0, w_ptr, rk, rn, 0, HALF, N_PAD, BLOCK_M, BLOCK_K)
        if img % K != 0:  # the past is x's previous frame
            acc = _half(acc, x_desc, img - 1, gy0, gx0, w_ptr, rk, rn, HALF, HALF, N_PAD, BLOCK_M, BLOCK_K)
        elif HAS_MEMORY:  # a sample's first frame: the past is its memory frame (zeros without one)
            acc = _half(acc, m_desc, sample, gy0, gx0, w_ptr, rk, rn, HALF, HALF, N_PAD, BLOCK_M, BLOCK_K)
        rm = tl.arange(0, BLOCK_M)
        gy = gy0 + rm // TILE_W
        gx = gx0 + rm % TILE_W
        m_ok = (gy < H) & (gx < W)
        epilogue(acc, b_ptr, y_ptr, y_ptr, (img * H + gy) * W + gx, m_ok, rn, C_OUT, BLOCK_N, HAS_BIAS, False,
                 RELU)


def mem_conv_launch(x: Tensor, memory: Tensor | None, w: Tensor, b: Tensor | None, frames: int, relu: bool,
                    config: TMAConfig | None = None) -> Tensor:
    """conv2d(cat([x, past]), w, b, padding=1) (ReLU'd if relu) for x [B*frames, C, H, W], where past is each
    frame's predecessor within its sample and memory[s] ([B, C, H, W]; zeros when None) for sample s's first frame.
    Returns the channels_last output. ValueError where the kernel cannot take the call."""
    if triton is None:
        raise RuntimeError(f"{NAME}: {TRITON_ERROR}")
    reason = unsupported_reason(tuple(x.shape), tuple(w.shape), x.dtype, frames, x.device)
    x, memory, b, copied = mem_operands(NAME, x, memory, b, frames, reason)
    n, c, h, wd = x.shape
    c_out = w.shape[0]
    out = new_out((n, c_out, h, wd), x)
    cfg = config or mem_config(c_out, x.shape, x.device)
    p = mem_plan(c, c_out)
    wp, packed_now = packed_weight(w, 1, p)
    tile_h, tile_w = cfg.block_m // cfg.tile_w, cfg.tile_w
    tiles_y, tiles_x = -(-h // tile_h), -(-wd // tile_w)
    box = [1, tile_h, tile_w, p.block_k]
    with on_device(x):
        x_desc = TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1), box)
        m_desc = x_desc if memory is None else TensorDescriptor.from_tensor(memory.permute(0, 2, 3, 1), box)
        bias = b if b is not None else wp
        block_n = cfg.n_block(p)
        _mem_conv_kernel[(n * tiles_y * tiles_x, p.n_pad // block_n)](
            x_desc, m_desc, wp, bias, out, h, wd, tiles_y, tiles_x, frames,
            C_OUT=c_out, N_PAD=p.n_pad, HALF=c // p.block_k, HAS_MEMORY=memory is not None, HAS_BIAS=b is not None,
            RELU=bool(relu), TILE_H=tile_h, TILE_W=tile_w, BLOCK_N=block_n, BLOCK_K=p.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x, packed_now + copied))
    mark_launched(NAME, x, w, 1, 1, False, b is not None, memory is not None, relu, (cfg, tuple(x.shape), frames))
    return out


# --------------------------------------------------------------------------- the row


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA, Triton, then the kernel's limits."""
    if not spec.device.startswith("cuda"):
        return "CPU tensor"
    if spec.layout != "channels_last":
        return f"{spec.layout} input (reads channels_last)"
    return triton_unavailable_reason(spec.device) or unsupported_reason(
        spec.x_shape, spec.w_shape, spec.dtype, spec.frames, torch.device(spec.device))


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (TMA launches specialise on the sizes)."""
    cfg = mem_config(spec.w_shape[0], spec.x_shape, torch.device(spec.device))
    return spec_launched(NAME, spec, (cfg, tuple(spec.x_shape), spec.frames))


def run(x: Tensor, memory: Tensor | None, w: Tensor, b: Tensor | None, frames: int, relu: bool) -> Tensor:
    """The dispatcher's mem_conv entry."""
    return mem_conv_launch(x, memory, w, b, frames, relu)
