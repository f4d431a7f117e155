"""The tensor-core conv's TMA variant (Hopper+): the same implicit GEMM as conv_tc's kernel, but each program owns a
2-D tile of TILE_H x TILE_W output pixels and loads every tap's input box [1, TILE_H, TILE_W, BLOCK_K] with one TMA
copy from a 4-D NHWC descriptor. The TMA unit zero-fills the parts of a box outside the image (negative or too
large coordinates), so the conv's zero padding costs no masks and no per-pixel address maths.

Why (predicted before measuring, H200): the pointer kernel spends its issue slots on per-pixel address and mask
arithmetic and 16-byte cp.async per thread and runs at 290-360 TFLOP/s on 64->64 convs (run D / run E). One TMA
copy per tap frees those slots for the MMAs; Triton's TMA matmuls reach 550-650 TFLOP/s at these K. Predicted
64->64 256^2 B=64: 0.55-0.7 ms (from 0.94-1.06). Measured (run F): 0.83-0.87 ms (356-372 TFLOP/s), the upsample
fold 0.41-0.44 ms (from 0.54): still every tap reloads its box from L2 (BENCHMARKS.md, "Issue 5 continued").

Covers stride 1 (with or without the upsample fold), C_in a multiple of BLOCK_K (tap mode), no pre_clamp. conv_tc's
launcher calls `launch` when the config has tile_w > 0; everything else (checks, packing, epilogue semantics) is
conv_tc's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .conv_tc import _capability

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .conv_tc import _epilogue, _pdl_start, _upsample_phase
except Exception:  # conv_tc reports Triton's absence; this module is only imported once Triton ran
    triton = tl = TensorDescriptor = None


def unsupported_reason(c_in: int, stride: int, pre_clamp: bool, block_k: int, tile_w: int, block_m: int,
                       device: torch.device) -> str | None:
    if stride != 1:
        return "stride 2 (TMA boxes here are unit-stride)"
    if pre_clamp:
        return "pre_clamp (TMA copies go straight to shared memory; the clamp needs a pass through registers)"
    if c_in < 16 or c_in % block_k:
        return f"C_in={c_in} must be >= 16 and a multiple of block_k={block_k}"
    if tile_w < 8 or block_m % tile_w or tile_w & (tile_w - 1):
        return f"tile_w={tile_w} must be a power of two >= 8 dividing block_m={block_m}"
    if device.type == "cuda" and _capability(device) < 9:
        return "TMA needs compute capability 9.0 (Hopper) or newer"
    return None


if triton is not None:

    @triton.jit(do_not_specialize=["GH", "GW", "Ho", "Wo", "TILES_Y", "TILES_X", "NUM_TILES", "NUM_PROGS"])
    def _conv3x3_tc_tma_kernel(
        x_desc, w_ptr, b_ptr, r_ptr, y_ptr,
        GH, GW, Ho, Wo, TILES_Y, TILES_X,  # GH x GW: the grid of output pixels (per phase for the upsample fold)
        NUM_TILES, NUM_PROGS,  # persistent launches loop over tiles pid, pid + NUM_PROGS, ...
        C_OUT: tl.constexpr, N_PAD: tl.constexpr, K_ROWS: tl.constexpr, CHUNKS: tl.constexpr, KS: tl.constexpr,
        UPSAMPLE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr,
        TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PERSISTENT: tl.constexpr, PDL: tl.constexpr,
    ):
        _pdl_start(PDL)
        # PERSISTENT flattens the tile and K loops into one software pipeline, so the next tile's loads are in
        # flight during this tile's epilogue (K is only 9 steps: fill and drain are a large part of each tile).
        for pid in tl.range(tl.program_id(0), NUM_TILES, NUM_PROGS, flatten=PERSISTENT):
            _tma_tile(x_desc, w_ptr, b_ptr, r_ptr, y_ptr, pid, GH, GW, Ho, Wo, TILES_Y, TILES_X, C_OUT, N_PAD, K_ROWS,
                      CHUNKS, KS, UPSAMPLE, HAS_BIAS, HAS_RES, RELU, TILE_H, TILE_W, BLOCK_N, BLOCK_K)

    @triton.jit
    def _tma_tile(
        x_desc, w_ptr, b_ptr, r_ptr, y_ptr, pid, GH, GW, Ho, Wo, TILES_Y, TILES_X,
        C_OUT: tl.constexpr, N_PAD: tl.constexpr, K_ROWS: tl.constexpr, CHUNKS: tl.constexpr, KS: tl.constexpr,
        UPSAMPLE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr,
        TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        BLOCK_M: tl.constexpr = TILE_H * TILE_W
        phase, t, py, px = _upsample_phase(pid, UPSAMPLE)
        tx = t % TILES_X
        t = t // TILES_X
        ty = t % TILES_Y
        img = t // TILES_Y
        gy0 = ty * TILE_H
        gx0 = tx * TILE_W
        if C_OUT <= BLOCK_N:
            rn = tl.arange(0, BLOCK_N)
        else:
            rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + phase * (K_ROWS * N_PAD)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(KS * KS * CHUNKS):
            tap = kk // CHUNKS
            c0 = (kk % CHUNKS) * BLOCK_K
            # Box origin may be -1 or run past the image: TMA fills those pixels with zeros (the conv's padding).
            a = x_desc.load([img, gy0 + py - 1 + tap // KS, gx0 + px - 1 + tap % KS, c0])
            wt = tl.load(w_base + (kk * BLOCK_K + rk)[:, None] * N_PAD + rn[None, :])
            acc = tl.dot(a.reshape(BLOCK_M, BLOCK_K), wt, acc)

        rm = tl.arange(0, BLOCK_M)
        gy = gy0 + rm // TILE_W
        gx = gx0 + rm % TILE_W
        m_ok = (gy < GH) & (gx < GW)
        if UPSAMPLE:
            oy = 2 * gy + py
            ox = 2 * gx + px
        else:
            oy = gy
            ox = gx
        _epilogue(acc, b_ptr, r_ptr, y_ptr, (img * Ho + oy) * Wo + ox, m_ok, rn, C_OUT, BLOCK_N, HAS_BIAS, HAS_RES,
                  RELU)


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool, upsample: int,
           plan, cfg, pdl: dict) -> None:
    """x, residual, out: channels_last f16; wp: conv_tc's packed weight for `plan`; cfg: a TCConfig with tile_w;
    pdl: conv_tc.pdl_args(x)."""
    B, c_in, H, W = x.shape
    c_out = out.shape[1]
    Ho, Wo = out.shape[2], out.shape[3]
    GH, GW = (H, W) if upsample == 2 else (Ho, Wo)
    tile_h, tile_w = cfg.block_m // cfg.tile_w, cfg.tile_w
    tiles_y, tiles_x = -(-GH // tile_h), -(-GW // tile_w)
    x_desc = TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1), [1, tile_h, tile_w, plan.block_k])
    tiles = B * tiles_y * tiles_x * plan.phases
    programs = tiles
    if cfg.persistent:
        programs = min(tiles, cfg.persistent * torch.cuda.get_device_properties(x.device).multi_processor_count
                       if x.is_cuda else 3)  # the interpreter: a few programs, so each loops over several tiles
    grid = (programs, plan.n_pad // plan.block_n)
    _conv3x3_tc_tma_kernel[grid](
        x_desc, wp, b if b is not None else wp, residual if residual is not None else out, out,
        GH, GW, Ho, Wo, tiles_y, tiles_x, tiles, programs,
        C_OUT=c_out, N_PAD=plan.n_pad, K_ROWS=plan.k_rows, CHUNKS=plan.cin_pad // plan.block_k, KS=plan.ks,
        UPSAMPLE=upsample == 2, HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu),
        TILE_H=tile_h, TILE_W=tile_w, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PERSISTENT=bool(cfg.persistent),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl,
    )
