"""The small-tile latency conv (row "gluon_conv_tile"): 64->64 stride-1 3x3 convs on Hopper (Gluon: TMA and wgmma
with both operands in shared memory), for the 32^2-128^2 levels of a B=1 decode.

Why: a B=1 decode is ~35 dependent kernels, so each conv's time from its predecessor's end to its own end matters
more than its throughput. The pointer kernel walks 9 taps after griddepcontrol.wait, each loading an input slice
and a [64, 64] weight slice from L2 a few taps ahead of the MMA: its critical path is a chain of L2 round trips.

How: one program computes 1 or 2 rows of 64 output pixels of one image (narrower images leave the rest of the row
to TMA's zero fill and clipped stores). The 9 weight taps (72 KB) are loaded into shared memory by TMA *before*
griddepcontrol.wait: weights are not written by the previous kernel, so their load overlaps its drain. After the
wait, one round of TMA loads brings the input rows y0-1 .. y0+2 as three boxes shifted by dx = -1, 0, +1 columns
(TMA zero-fills outside the image: the conv's padding), and the residual rows; each box has its own barrier, so the
MMAs of the first box to land start while the others are in flight. Output row r's tap (dy, dx) is the 64-pixel
slice at row r + dy of box dx. The 9 (or 18) wgmmas run back to back from shared memory (one warpgroup, one
accumulator per output row); bias, residual and ReLU are applied in registers and the tile leaves through a TMA
store (clipped at the image's edges). Small grids split the output channels over two programs; where one-row tiles
would need more than one wave, two-row tiles (see tile_shape). Larger images run in several waves: correct, and
the dispatcher's timing decides whether that is worth it.

Covers C_in = C_out = 64, stride 1, no upsample or pre_clamp, W >= 16, with or without bias and residual, sm_90 with
Gluon. The weight is conv_pack's (rows tap * 64 + c_in, tap = 3 * dy + dx). x and the residual must start 16-byte
aligned (TMA): views that do not are copied first.
"""

from __future__ import annotations

from torch import Tensor

from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason, spec_launched
from .conv_pack import packed_weight, plan
from .device import sm_count
from .gluon_import import GLUON_ERROR as _GLUON_ERROR
from .gluon_import import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                           warpgroup_mma_wait)
from .tma_pdl import nhwc_desc, pdl_wait

NAME = "gluon_conv_tile"

C = 64  # channels in and out
TW = 64  # tile width in pixels: one wgmma's M (narrower images leave columns to TMA's zero fill and clipped stores)


def shape_reason(c_in: int, c_out: int, W: int, stride: int, upsample: int, pre_clamp: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if c_in != C or c_out != C:
        return f"{c_in}->{c_out} channels (the tile kernel does {C}->{C})"
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the tile kernel does plain stride-1 convs)"
    if W < 16:
        return f"W={W} (< 16: 64-pixel tile rows would be mostly padding)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90 with Gluon, the conv contract, then shape_reason."""
    return sm90_spec_reason(spec, _GLUON_ERROR) or shape_reason(
        spec.w_shape[1], spec.w_shape[0], spec.x_shape[3], spec.stride, spec.upsample,
        spec.pre_clamp)


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (Gluon specialises on the sizes)."""
    return spec_launched(NAME, spec, tuple(spec.x_shape))


def tile_shape(B: int, H: int, W: int, sms: int) -> tuple[int, int]:
    """(output rows, output channels) per program. Half the channels (each program's MMA chain halves) while the
    programs still fill at most half the SMs (32^2 at B=1); beyond that, each program loading all the input boxes
    costs more than the halved chain saves, and the next kernel finds no free SMs to start on early. One-row tiles
    with all channels while they fit one wave, else two-row tiles (128^2 at B=1)."""
    one_row_tiles = B * H * -(-W // TW)
    if 4 * one_row_tiles <= sms:
        return 1, 32
    return (1, 64) if one_row_tiles <= sms else (2, 64)


if gluon is not None:

    @gluon.jit
    def _taps(x_smem, w_smem, acc, row: gl.constexpr, dx: gl.constexpr):
        # Output row `row`, the three taps of box dx: tap (dy, dx) reads input row row + dy of the box, a 64-row slice
        # at a multiple of 64 (Gluon's shared-memory views need the offset to be a multiple of the slice's length).
        for dy in gl.static_range(3):
            a = x_smem.index(dx).reshape([256, 64]).slice((row + dy) * 64, 64)
            acc = warpgroup_mma(a, w_smem.index(3 * dy + dx), acc, is_async=True)
        return acc

    @gluon.jit
    def _epilogue(acc, row: gl.constexpr, bias, r_smem, o_smem, mma: gl.constexpr, TH: gl.constexpr,
                  BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr):
        if HAS_BIAS:
            acc = acc + bias[None, :]
        if HAS_RES:
            acc = acc + r_smem.reshape([TH * 64, BLOCK_N]).slice(row * 64, 64).load(mma).to(gl.float32)
        if RELU:
            acc = gl.maximum(acc, 0.0)
        o_smem.reshape([TH * 64, BLOCK_N]).slice(row * 64, 64).store(acc.to(gl.float16))

    @gluon.jit
    def _tile_conv_kernel(x_desc, w_desc, r_desc, y_desc, b_ptr, TILES_H, TILES_W,
                          HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr, TH: gl.constexpr,
                          BLOCK_N: gl.constexpr, PDL: gl.constexpr):
        n0 = (gl.program_id(0) % (64 // BLOCK_N)) * BLOCK_N  # this program's output channels
        pid = gl.program_id(0) // (64 // BLOCK_N)
        tx = pid % TILES_W
        t = pid // TILES_W
        img = t // TILES_H
        y0 = (t % TILES_H) * TH
        x0 = tx * 64

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        x_smem = gl.allocate_shared_memory(gl.float16, [3, 1, 4, 64, 64], x_desc.layout)  # rows y0-1 .. y0+2
        w_smem = gl.allocate_shared_memory(gl.float16, [9, 64, BLOCK_N], w_desc.layout)
        o_smem = gl.allocate_shared_memory(gl.float16, [1, TH, 64, BLOCK_N], y_desc.layout)
        if HAS_RES:
            r_smem = gl.allocate_shared_memory(gl.float16, [1, TH, 64, BLOCK_N], r_desc.layout)
        else:
            r_smem = o_smem  # never read
        # One barrier each for the weights, the three input boxes (MMAs start on the first box to land) and the
        # residual (needed only by the epilogue).
        bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(5):
            mbarrier.init(bars.index(i), count=1)
        w_bar = bars.index(0)
        r_bar = bars.index(4)

        # Weights and bias first: the previous kernel does not write them, so they load while it drains.
        mbarrier.expect(w_bar, 9 * 64 * BLOCK_N * 2)
        for tap in gl.static_range(9):
            tma.async_copy_global_to_shared(w_desc, [tap * 64, n0], w_bar, w_smem.index(tap))
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            bias = gl.load(b_ptr + cols).to(gl.float32)
        else:
            bias = cols  # unused
        if PDL:  # see tma_pdl: activations are read only after the previous kernel's writes are visible
            pdl_wait()
        for dx in gl.static_range(3):
            mbarrier.expect(bars.index(1 + dx), 4 * 64 * 64 * 2)
            tma.async_copy_global_to_shared(x_desc, [img, y0 - 1, x0 - 1 + dx, 0], bars.index(1 + dx),
                                            x_smem.index(dx))
        if HAS_RES:
            mbarrier.expect(r_bar, TH * 64 * BLOCK_N * 2)
            tma.async_copy_global_to_shared(r_desc, [img, y0, x0, n0], r_bar, r_smem)

        acc0 = gl.zeros([64, BLOCK_N], gl.float32, mma)
        if TH == 2:
            acc1 = gl.zeros([64, BLOCK_N], gl.float32, mma)
        mbarrier.wait(w_bar, 0)
        for dx in gl.static_range(3):
            mbarrier.wait(bars.index(1 + dx), 0)
            acc0 = _taps(x_smem, w_smem, acc0, 0, dx)
            if TH == 2:
                acc1 = _taps(x_smem, w_smem, acc1, 1, dx)
        if HAS_RES:
            mbarrier.wait(r_bar, 0)
        if TH == 2:
            acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
            _epilogue(acc0, 0, bias, r_smem, o_smem, mma, TH, BLOCK_N, HAS_BIAS, HAS_RES, RELU)
            _epilogue(acc1, 1, bias, r_smem, o_smem, mma, TH, BLOCK_N, HAS_BIAS, HAS_RES, RELU)
        else:
            acc0 = warpgroup_mma_wait(0, deps=[acc0])
            _epilogue(acc0, 0, bias, r_smem, o_smem, mma, TH, BLOCK_N, HAS_BIAS, HAS_RES, RELU)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(y_desc, [img, y0, x0, n0], o_smem)  # clipped at the image's edges
        tma.store_wait(0)
        for i in gl.static_range(5):
            mbarrier.invalidate(bars.index(i))


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           pdl: dict | None = None) -> None:
    """x, residual, out: channels_last f16 [B, 64, H, W], 16-byte aligned; wp: conv_pack's weight [1, 576, 64]
    (rows tap * 64 + c_in); pdl: tma_pdl.pdl_args(x)."""
    B, _, H, W = x.shape
    th, block_n = tile_shape(B, H, W, sm_count(x.device))
    x_desc = nhwc_desc(x, [1, 4, TW, C], gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4))
    box = [1, th, TW, block_n]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.float16)
    y_desc = nhwc_desc(out, box, layout)
    r_desc = nhwc_desc(residual, box, layout) if residual is not None else y_desc
    w_desc = TensorDescriptor.from_tensor(wp.reshape(9 * C, C), [C, block_n],
                                          gl.NVMMASharedLayout.get_default_for([C, block_n], gl.float16))
    tiles_h, tiles_w = -(-H // th), -(-W // TW)
    _tile_conv_kernel[(B * tiles_h * tiles_w * (C // block_n),)](
        x_desc, w_desc, r_desc, y_desc, b if b is not None else wp, tiles_h, tiles_w,
        HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu), TH=th, BLOCK_N=block_n,
        num_warps=4, **(pdl or {"PDL": False}),
    )


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], x.shape[3], stride, upsample, pre_clamp)
    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, upsample, plan(C, C, upsample)),
                          lambda c, wp, pdl: launch(c.x, wp, c.b, c.residual, c.out, relu, pdl), tuple(x.shape))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
