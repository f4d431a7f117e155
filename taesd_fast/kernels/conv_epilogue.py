"""The Triton conv kernels' shared device code (triton_conv's pointer kernel, triton_conv_tma and triton_mem_conv): the
fused epilogue, the upsample fold's program-to-phase mapping and the TMA kernels' 2-D tile origin. The epilogue follows
conv_contract: + bias, + residual, ReLU in fp32, one rounding to f16, stored to the dense NHWC output."""

from __future__ import annotations

from .triton_import import tl, triton

__all__ = ["epilogue", "tile_origin", "upsample_phase"]

if triton is not None:

    @triton.jit
    def upsample_phase(pid, UPSAMPLE: tl.constexpr):
        """(phase, tile, py, px) of program pid. With the upsample fold, the 4 output phases of one tile are
        neighbouring programs: they read the same low-res input, so L2 serves them."""
        if UPSAMPLE:
            return pid % 4, pid // 4, (pid % 4) // 2, pid % 2
        return 0, pid, 0, 0

    @triton.jit
    def tile_origin(t, TILES_Y, TILES_X, TILE_H: tl.constexpr, TILE_W: tl.constexpr, C_OUT: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """(image, first row, first column, output channels) of 2-D tile t (tiles row-major, TILES_Y x TILES_X per
        image) for this program's channel block (program_id(1), where C_OUT takes more than one)."""
        tx = t % TILES_X
        t = t // TILES_X
        ty = t % TILES_Y
        if C_OUT <= BLOCK_N:
            rn = tl.arange(0, BLOCK_N)
        else:
            rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return t // TILES_Y, ty * TILE_H, tx * TILE_W, rn

    @triton.jit
    def epilogue(acc, b_ptr, r_ptr, y_ptr, out_px, m_ok, rn, C_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RELU: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] fp32 for output pixels out_px (NHWC pixel indices) and channels rn: + bias,
        + residual, ReLU, stored as f16 where m_ok and rn < C_OUT."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < C_OUT, other=0.0).to(tl.float32)[None, :]
        o_ptrs = out_px.to(tl.int64)[:, None] * C_OUT + rn[None, :]
        if C_OUT == BLOCK_N:
            o_mask = m_ok[:, None]
        else:
            o_mask = m_ok[:, None] & (rn < C_OUT)[None, :]
        if HAS_RES:
            acc += tl.load(r_ptr + o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        tl.store(y_ptr + o_ptrs, acc.to(tl.float16), mask=o_mask)
else:
    epilogue = upsample_phase = None
