"""The narrow-output latency conv (row "gluon_conv_narrow"): 64 -> C_out <= 7 stride-1 3x3 convs on small images
(Gluon: TMA and wgmma from shared memory), i.e. the decoder's last conv (64 -> 3) at up to 256^2 at B=1.

Why: on the row-streaming kernel that conv walks input rows one after another, each as three TMA boxes shifted by
dx = -1, 0, +1 columns, and its MMAs are N = 16 wide for 3 output channels.

How: the column taps go into N instead of into shifted input boxes. For output row y, with A_j the input row j as a
[W pixels, 64 channels] tile,

    P[x, dx * C_out + o] = sum_dy (A_{y+dy-1} @ W_dy)[x, dx * C_out + o],   W_dy[c, dx * C_out + o] = w[o, c, dy, dx]
    y[x, o] = bias[o] + P[x-1, o] + P[x, C_out + o] + P[x+1, 2 * C_out + o]

so each input row is one TMA box of whole image rows (W <= 256, zero filled past W and above/below the image: the
padding) and the three dy taps accumulate in the tensor core (N = 16 for 3 * 3 columns). The epilogue sums each
needed column out of the fp32 accumulator into a [W] vector and shifts the dx = 0 and dx = 2 vectors by one pixel
with a gather (zero outside the row: the padding). One program owns TH whole output rows of one image: TH + 2
boxes, one barrier each, so the first row's MMAs start on the first three boxes. Gathering per column vector, not
the whole [W, N] accumulator: a whole-accumulator gather whose source pixel varied along the columns gave wrong
values for some shapes (Triton 3.6: 128-pixel rows with 3 outputs and a bias).

Covers C_in = 64, C_out <= 7 (3 * C_out columns in N = 16 or 32), stride 1, no upsample, residual or pre_clamp,
W <= 256, bias and ReLU optional, sm_90 with Gluon, grids of one program per SM (rows_per_program). This module packs
its own weight (`pack`). x must start 16-byte aligned (TMA): a view that does not is copied first.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason, spec_launched
from .conv_pack import packed_weight, plan
from .conv_schedule import one_wave_reason
from .device import sm_count
from .gluon_import import GLUON_ERROR as _GLUON_ERROR
from .gluon_import import TensorDescriptor, gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from .tma_pdl import nhwc_desc, pdl_wait

NAME = "gluon_conv_narrow"

C = 64  # input channels
MAX_C_OUT = 7  # 3 * C_out columns fit one wgmma of N = 32
MAX_W = 256  # one TMA box spans a whole row (box dimensions are at most 256)
SMEM = 220 * 1024  # at most per program: input rows, weights, the gathers' scratch
MAX_ROWS = 4  # output rows per program at most
WARPS = 4  # warps per program at most: one warpgroup per 64 pixels of the row


def n_pad(c_out: int) -> int:
    """wgmma N for 3 * c_out columns (dx, o): 16 or 32."""
    return 16 if 3 * c_out <= 16 else 32


def row_width(W: int) -> int:
    """Pixels per row tile (the wgmma M and the TMA box width): W rounded up to a power of two, at least 64."""
    return max(64, 1 << (W - 1).bit_length())


def rows_per_program(B: int, H: int, W: int, c_out: int, sms: int) -> int | None:
    """Output rows per program: the fewest that keep the grid to one program per SM (the decode's convs are a chain;
    a second wave would double this conv's latency) within SMEM, or None. One program per SM: two one-row programs
    per SM where they fit (256^2) measured slower."""
    bw, n = row_width(W), n_pad(c_out)
    for th in (1, 2, 4):
        smem = (th + 2) * bw * C * 2 + 3 * C * n * 2 + bw * 4
        if th <= MAX_ROWS and smem <= SMEM and B * -(-H // th) <= sms:
            return th
    return None


def shape_reason(c_in: int, c_out: int, W: int, stride: int, upsample: int, pre_clamp: bool,
                 residual: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract, the GPU and one wave), or None."""
    if c_in != C or c_out > MAX_C_OUT:
        return f"{c_in}->{c_out} channels (the narrow kernel does {C}->{MAX_C_OUT} or fewer)"
    if stride != 1 or upsample != 1 or pre_clamp or residual:
        return "stride 2, the upsample fold, pre_clamp or a residual (the narrow kernel does plain stride-1 convs)"
    if W > MAX_W:
        return f"W={W} (> {MAX_W}: the narrow kernel loads whole rows as one TMA box)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90 with Gluon, the conv contract, shape_reason, one wave on this GPU."""
    B, c_in, H, W = spec.x_shape
    c_out = spec.w_shape[0]
    return (sm90_spec_reason(spec, _GLUON_ERROR)
            or shape_reason(c_in, c_out, W, spec.stride, spec.upsample,
                            spec.pre_clamp, spec.residual)
            or one_wave_reason(spec.x_shape, lambda sms: rows_per_program(B, H, W, c_out, sms),
                               sm_count(spec.device)))


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (Gluon specialises on the sizes)."""
    return spec_launched(NAME, spec, tuple(spec.x_shape))


def pack(w: Tensor) -> Tensor:
    """[C_out, 64, 3, 3] -> f16 [3 * 64, n_pad]: row dy * 64 + c, column dx * C_out + o (zero padded)."""
    c_out = w.shape[0]
    wt = w.float().permute(2, 1, 3, 0).reshape(3 * C, 3 * c_out)  # [dy, c, dx, o]
    return torch.nn.functional.pad(wt, (0, n_pad(c_out) - 3 * c_out)).to(torch.float16).contiguous()


if gluon is not None:

    @gluon.jit
    def _row_mmas(x_smem, w_smem, bars, acc, r: gl.constexpr, BW: gl.constexpr):
        # Output row r of the tile: tap row dy reads input box r + dy. Each box is waited on by the first row that
        # reads it (a completed barrier stays completed for the same phase, so a second wait returns at once).
        for dy in gl.static_range(3):
            mbarrier.wait(bars.index(1 + r + dy), 0)
            acc = warpgroup_mma(x_smem.index(r + dy).reshape([BW, 64]), w_smem.index(dy), acc, is_async=True)
        return acc

    @gluon.jit
    def _store_row(acc, bias, y_ptr, img, row, H, W, mma: gl.constexpr, C_OUT: gl.constexpr,
                   HAS_BIAS: gl.constexpr, RELU: gl.constexpr, BW: gl.constexpr):
        # y[x, o] = bias[o] + P[x-1, o] + P[x, C_OUT + o] + P[x+1, 2 * C_OUT + o]. Each column is first summed out
        # of the accumulator ([BW] vectors), then the dx = 0 and dx = 2 vectors are shifted by one pixel with a
        # gather (zero outside the row: the padding). Gathers of the whole [BW, N] accumulator cost ~0.7 us each, and
        # one whose source pixel varied along the columns gave wrong values for some shapes (Triton 3.6).
        px = gl.arange(0, BW, layout=gl.SliceLayout(1, mma))
        n = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, mma))
        base = ((img * H + row).to(gl.int64) * W + px) * C_OUT
        ok = (px < W) & (row < H)
        left = gl.maximum(px - 1, 0)
        right = gl.minimum(px + 1, BW - 1)
        for o in gl.static_range(C_OUT):
            out = gl.sum(gl.where((n == C_OUT + o)[None, :], acc, 0.0), axis=1)
            if HAS_BIAS:
                out = out + gl.sum(gl.where(n == C_OUT + o, bias, 0.0), axis=0)
            p0 = gl.sum(gl.where((n == o)[None, :], acc, 0.0), axis=1)
            p2 = gl.sum(gl.where((n == 2 * C_OUT + o)[None, :], acc, 0.0), axis=1)
            out += gl.where(px > 0, gl.gather(p0, left, 0), 0.0)
            out += gl.where(px < BW - 1, gl.gather(p2, right, 0), 0.0)
            if RELU:
                out = gl.maximum(out, 0.0)
            gl.store(y_ptr + base + o, out.to(gl.float16), mask=ok)

    @gluon.jit
    def _narrow_conv_kernel(x_desc, w_desc, b_ptr, y_ptr, H, W, TILES_H, C_OUT: gl.constexpr, N_PAD: gl.constexpr,
                            HAS_BIAS: gl.constexpr, RELU: gl.constexpr, TH: gl.constexpr, BW: gl.constexpr,
                            PDL: gl.constexpr):
        img = gl.program_id(0) // TILES_H
        y0 = (gl.program_id(0) % TILES_H) * TH

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, N_PAD, 16])
        x_smem = gl.allocate_shared_memory(gl.float16, [TH + 2, 1, 1, BW, 64], x_desc.layout)  # rows y0-1 .. y0+TH
        w_smem = gl.allocate_shared_memory(gl.float16, [3, 64, N_PAD], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [TH + 3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(TH + 3):
            mbarrier.init(bars.index(i), count=1)
        w_bar = bars.index(0)

        # Weights first: the previous kernel does not write them, so they load while it drains.
        mbarrier.expect(w_bar, 3 * 64 * N_PAD * 2)
        for dy in gl.static_range(3):
            tma.async_copy_global_to_shared(w_desc, [dy * 64, 0], w_bar, w_smem.index(dy))
        # The bias at columns C_OUT + o (where _store_row picks it up), loaded while the previous kernel drains.
        n = gl.arange(0, N_PAD, layout=gl.SliceLayout(0, mma))
        is_bias = (n >= C_OUT) & (n < 2 * C_OUT)
        if HAS_BIAS:
            bias = gl.load(b_ptr + (n - C_OUT), mask=is_bias, other=0.0).to(gl.float32)
        else:
            bias = n  # unused
        if PDL:  # see tma_pdl: activations are read only after the previous kernel's writes are visible
            pdl_wait()
        for j in gl.static_range(TH + 2):
            mbarrier.expect(bars.index(1 + j), BW * 64 * 2)
            tma.async_copy_global_to_shared(x_desc, [img, y0 - 1 + j, 0, 0], bars.index(1 + j), x_smem.index(j))

        zero = gl.zeros([BW, N_PAD], gl.float32, mma)
        mbarrier.wait(w_bar, 0)
        acc = _row_mmas(x_smem, w_smem, bars, zero, 0, BW)
        for r in gl.static_range(1, TH):
            # Row r's MMAs go in before row r - 1's epilogue, which then overlaps them.
            nxt = _row_mmas(x_smem, w_smem, bars, zero, r, BW)
            # The operands among the deps: else the gather's scratch may be placed over them while MMAs read them.
            acc, _, _ = warpgroup_mma_wait(3, deps=[acc, x_smem, w_smem])
            _store_row(acc, bias, y_ptr, img, y0 + r - 1, H, W, mma, C_OUT, HAS_BIAS, RELU, BW)
            acc = nxt
        acc, _, _ = warpgroup_mma_wait(0, deps=[acc, x_smem, w_smem])
        _store_row(acc, bias, y_ptr, img, y0 + TH - 1, H, W, mma, C_OUT, HAS_BIAS, RELU, BW)
        for i in gl.static_range(TH + 3):
            mbarrier.invalidate(bars.index(i))


@functools.cache
def _layout(rank: int):
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=rank)


def launch(x: Tensor, wn: Tensor, b: Tensor | None, out: Tensor, relu: bool, pdl: dict | None = None) -> None:
    """x: channels_last f16 [B, 64, H, W], 16-byte aligned; out: channels_last f16 [B, C_out, H, W]; wn: `pack`'s
    weight; pdl: tma_pdl.pdl_args(x)."""
    B, _, H, W = x.shape
    c_out = out.shape[1]
    th, bw = rows_per_program(B, H, W, c_out, sm_count(x.device)), row_width(W)
    x_desc = nhwc_desc(x, [1, 1, bw, C], _layout(4))
    w_desc = TensorDescriptor.from_tensor(wn, [C, wn.shape[1]],
                                          gl.NVMMASharedLayout.get_default_for([C, wn.shape[1]], gl.float16))
    tiles_h = -(-H // th)
    _narrow_conv_kernel[(B * tiles_h,)](
        x_desc, w_desc, b if b is not None else wn, out, H, W, tiles_h,
        C_OUT=c_out, N_PAD=wn.shape[1], HAS_BIAS=b is not None, RELU=bool(relu), TH=th, BW=bw,
        num_warps=min(WARPS, bw // 16), **(pdl or {"PDL": False}),
    )


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    B, c_in, H, W = x.shape
    c_out = w.shape[0]
    refuse = shape_reason(c_in, c_out, W, stride, upsample, pre_clamp, residual is not None)
    if refuse is None and x.is_cuda:
        refuse = one_wave_reason(x.shape, lambda sms: rows_per_program(B, H, W, c_out, sms), sm_count(x.device))
    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, upsample, plan(C, c_out, upsample), tag=NAME,
                                                build=lambda: pack(w.detach())),
                          lambda c, wp, pdl: launch(c.x, wp, c.b, c.out, relu, pdl), tuple(x.shape))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
