"""The upsample-fold latency conv (row "gluon_conv_up"): nearest 2x upsample + 64->64 3x3 conv for small images on
Hopper (Gluon: TMA and wgmma from shared memory), the decoder's upsample convs at 64^2-256^2 output at B=1.

Why: the Triton kernels give each program one output phase of a 2-D tile and reload a weight slice per K step, so
the four phases of a tile read the same input four times.

How (conv_pack's docstring has the fold): output row 2y + py, column 2x + px reads the 2x2 low-res taps
x[y + py - 1 + ty, x + px - 1 + tx] with phase (py, px) weights. One program owns one output row parity py, TH
low-res rows y0 .. y0+TH-1 and a strip of 64 low-res columns, both column phases and all 64 output channels. Its 8
weight blocks (px, ty, tx) are 64 KB, loaded before griddepcontrol.wait (the previous kernel does not write them).
The input rows y0+py-1 .. y0+py+TH-1 arrive as three TMA boxes shifted by dx = -1, 0, +1 low-res columns (zero fill
= the padding), one barrier each; phase px, tap tx reads box dx = px + tx. Per low-res row, 8 wgmmas fill two
accumulators (px = 0, 1); the next row's MMAs are issued before the previous row's epilogue, which stores the two
phases side by side: the output seen as [B, H, 2, W, 2 * 64] (row parity and column phase split out) takes a
[64 pixels, 64 channels] box per phase.

Covers 64->64, stride 1, upsample 2, optional bias and ReLU (no residual, no pre_clamp), W >= 16, sm_90 with Gluon,
grids of at most one program per SM (rows_per_program). The weight is conv_pack's folded one ([4 phases,
tap * 64 + c_in, 64], phase = 2 * py + px, tap = 2 * ty + tx). x must start 16-byte aligned (TMA): a view that does
not is copied first.
"""

from __future__ import annotations

import functools

from torch import Tensor

from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason, spec_launched
from .conv_pack import packed_weight, plan
from .conv_schedule import one_wave_reason
from .device import sm_count
from .gluon_import import GLUON_ERROR as _GLUON_ERROR
from .gluon_import import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                           warpgroup_mma_wait)
from .tma_pdl import nhwc_desc, pdl_wait

NAME = "gluon_conv_up"

C = 64  # channels in and out
TW = 64  # low-res columns per program: one wgmma's M
# Low-res rows per program at most: 4 fills shared memory (input 120 KB + weights 64 + staging 32).
MAX_ROWS = 4


def rows_per_program(B: int, H: int, W: int, sms: int) -> int | None:
    """Low-res rows per program: the fewest that keep the grid to one program per SM (a B=1 decode's convs are a
    chain; a second wave would double the conv's latency), or None where even TH = 4 needs more."""
    strips = -(-W // TW)
    for th in (1, 2, 4):
        if th <= MAX_ROWS and B * -(-H // th) * strips * 2 <= sms:
            return th
    return None


def shape_reason(c_in: int, c_out: int, W: int, stride: int, upsample: int, pre_clamp: bool,
                 residual: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract, the GPU and one wave), or None."""
    if upsample != 2 or stride != 1 or pre_clamp or residual:
        return "not a plain upsample fold (the upsample kernel does upsample 2, stride 1, no pre_clamp or residual)"
    if c_in != C or c_out != C:
        return f"{c_in}->{c_out} channels (the upsample kernel does {C}->{C})"
    if W < 16:
        return f"W={W} (< 16: 64-pixel tile rows would be mostly padding)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90 with Gluon, the conv contract, shape_reason, one wave on this GPU."""
    B, c_in, H, W = spec.x_shape
    return (sm90_spec_reason(spec, _GLUON_ERROR)
            or shape_reason(c_in, spec.w_shape[0], W, spec.stride, spec.upsample,
                            spec.pre_clamp, spec.residual)
            or one_wave_reason(spec.x_shape, lambda sms: rows_per_program(B, H, W, sms), sm_count(spec.device)))


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (Gluon specialises on the sizes)."""
    return spec_launched(NAME, spec, tuple(spec.x_shape))


if gluon is not None:

    @gluon.jit
    def _row_mmas(x_smem, w_smem, bars, acc0, acc1, row: gl.constexpr, TH: gl.constexpr):
        # Low-res row `row` of the tile: phase px, tap (ty, tx) reads row row + ty of box dx = px + tx. Ordered by
        # box, so on the first row the MMAs of the first box to land start while the others are in flight.
        for dx in gl.static_range(3):
            if row == 0:
                mbarrier.wait(bars.index(1 + dx), 0)
            for ty in gl.static_range(2):
                a = x_smem.index(dx * (TH + 1) + row + ty).reshape([64, 64])
                if dx <= 1:  # px = 0, tx = dx
                    acc0 = warpgroup_mma(a, w_smem.index(2 * ty + dx), acc0, is_async=True)
                if dx >= 1:  # px = 1, tx = dx - 1
                    acc1 = warpgroup_mma(a, w_smem.index(4 + 2 * ty + dx - 1), acc1, is_async=True)
        return acc0, acc1

    @gluon.jit
    def _store_row(acc0, acc1, bias, o_smem, y_desc, img, y, py, x0, buf: gl.constexpr, HAS_BIAS: gl.constexpr,
                   RELU: gl.constexpr):
        # Both column phases of one output row into staging buffer `buf`, then out through TMA (clipped at the
        # image's edges). The stores of the row before (the other buffer) may still be reading theirs.
        tma.store_wait(2)
        gl.thread_barrier()  # every warp sees buffer `buf` free
        for px in gl.static_range(2):
            out = acc0 if px == 0 else acc1
            if HAS_BIAS:
                out = out + bias[None, :]
            if RELU:
                out = gl.maximum(out, 0.0)
            o_smem.index(2 * buf + px).reshape([64, 64]).store(out.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        for px in gl.static_range(2):
            tma.async_copy_shared_to_global(y_desc, [img, y, py, x0, px * 64], o_smem.index(2 * buf + px))

    @gluon.jit
    def _up_conv_kernel(x_desc, w_desc, y_desc, b_ptr, TILES_H, TILES_W, HAS_BIAS: gl.constexpr,
                        RELU: gl.constexpr, TH: gl.constexpr, PDL: gl.constexpr):
        py = gl.program_id(0) % 2
        pid = gl.program_id(0) // 2
        tx = pid % TILES_W
        t = pid // TILES_W
        img = t // TILES_H
        y0 = (t % TILES_H) * TH
        x0 = tx * 64

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        x_smem = gl.allocate_shared_memory(gl.float16, [3 * (TH + 1), 1, 1, 64, 64], x_desc.layout)  # [dx, row]
        w_smem = gl.allocate_shared_memory(gl.float16, [8, 64, 64], w_desc.layout)
        o_smem = gl.allocate_shared_memory(gl.float16, [4, 1, 1, 1, 64, 64], y_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(bars.index(i), count=1)
        w_bar = bars.index(0)

        # This parity's 8 weight blocks, phase (py, px) tap (ty, tx) at block 4 * px + 2 * ty + tx.
        mbarrier.expect(w_bar, 8 * 64 * 64 * 2)
        for blk in gl.static_range(8):
            tma.async_copy_global_to_shared(w_desc, [(2 * py + blk // 4) * 256 + (blk % 4) * 64, 0], w_bar,
                                            w_smem.index(blk))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            bias = gl.load(b_ptr + cols).to(gl.float32)
        else:
            bias = cols  # unused
        if PDL:  # see tma_pdl: activations are read only after the previous kernel's writes are visible
            pdl_wait()
        for dx in gl.static_range(3):  # one row per box: box shapes must be powers of two
            mbarrier.expect(bars.index(1 + dx), (TH + 1) * 64 * 64 * 2)
            for r in gl.static_range(TH + 1):
                tma.async_copy_global_to_shared(x_desc, [img, y0 + py - 1 + r, x0 - 1 + dx, 0], bars.index(1 + dx),
                                                x_smem.index(dx * (TH + 1) + r))

        zero = gl.zeros([64, 64], gl.float32, mma)
        mbarrier.wait(w_bar, 0)
        a0, a1 = _row_mmas(x_smem, w_smem, bars, zero, zero, 0, TH)
        for row in gl.static_range(1, TH):
            # Row `row`'s 8 MMAs go in before row - 1's epilogue, which then overlaps them.
            b0, b1 = _row_mmas(x_smem, w_smem, bars, zero, zero, row, TH)
            a0, a1 = warpgroup_mma_wait(8, deps=[a0, a1])
            _store_row(a0, a1, bias, o_smem, y_desc, img, y0 + row - 1, py, x0, (row - 1) % 2, HAS_BIAS, RELU)
            a0, a1 = b0, b1
        a0, a1 = warpgroup_mma_wait(0, deps=[a0, a1])
        _store_row(a0, a1, bias, o_smem, y_desc, img, y0 + TH - 1, py, x0, (TH - 1) % 2, HAS_BIAS, RELU)
        tma.store_wait(0)
        for i in gl.static_range(4):
            mbarrier.invalidate(bars.index(i))


@functools.cache
def _layout(rank: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


def launch(x: Tensor, wp: Tensor, b: Tensor | None, out: Tensor, relu: bool, pdl: dict | None = None) -> None:
    """x: channels_last f16 [B, 64, H, W], 16-byte aligned; out: channels_last f16 [B, 64, 2H, 2W]; wp: conv_pack's
    folded weight [4, 256, 64]; pdl: tma_pdl.pdl_args(x)."""
    B, _, H, W = x.shape
    th = rows_per_program(B, H, W, sm_count(x.device))
    x_desc = nhwc_desc(x, [1, 1, TW, C], _layout(4))
    # out [B, 2H, 2W, 64] as [B, H, py, W, (px, c)]: one [64 pixels, 64 channels] box per (row, phase)
    y_desc = TensorDescriptor(out, [B, H, 2, W, 2 * C], [4 * H * W * C, 4 * W * C, 2 * W * C, 2 * C, 1],
                              [1, 1, 1, TW, C], _layout(5))
    w_desc = TensorDescriptor.from_tensor(wp.reshape(4 * 4 * C, C), [C, C], _layout(2))
    tiles_h, tiles_w = -(-H // th), -(-W // TW)
    _up_conv_kernel[(B * tiles_h * tiles_w * 2,)](
        x_desc, w_desc, y_desc, b if b is not None else wp, tiles_h, tiles_w,
        HAS_BIAS=b is not None, RELU=bool(relu), TH=th, num_warps=4, **(pdl or {"PDL": False}),
    )


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    B, c_in, H, W = x.shape
    refuse = shape_reason(c_in, w.shape[0], W, stride, upsample, pre_clamp, residual is not None)
    if refuse is None and x.is_cuda:
        refuse = one_wave_reason(x.shape, lambda sms: rows_per_program(B, H, W, sms), sm_count(x.device))
    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, upsample, plan(C, C, upsample)),
                          lambda c, wp, pdl: launch(c.x, wp, c.b, c.out, relu, pdl), tuple(x.shape))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
