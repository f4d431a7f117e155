"""The tensor-core conv's latency variant for small 64->64 stride-1 3x3 convs on Hopper (Gluon: TMA and wgmma with
both operands in shared memory): the 32^2-128^2 levels of a B=1 decode.

Why: a B=1 decode is ~35 dependent kernels. A chain of near-empty kernels costs 0.8-1.0 us per launch with
programmatic dependent launch (scripts/launch_floor.py, run W1), but the pointer kernel's 64->64 conv at 32^2 costs
~4.4 us from its predecessor's end to its own (scripts/decode_timeline.py, run W1): after griddepcontrol.wait it
walks 9 taps, each loading an input slice and a [64, 64] weight slice from L2 a few taps ahead of the MMA, so its
critical path is a chain of L2 round trips. The MMA work itself is 0.6 us per 64-pixel tile.

How: one program computes a tile of 64 output pixels (1 x 64, 2 x 32 or 4 x 16) of one image. The 9 weight taps
(72 KB) are loaded into shared memory by TMA *before* griddepcontrol.wait: weights are not written by the previous
kernel, so their load overlaps its drain. After the wait, one round of TMA loads brings the 9 input boxes, one per
tap, shifted by (dy - 1, dx - 1) (TMA zero-fills outside the image: the conv's padding), and the residual tile. (Three
taller boxes, one per dx, would carry fewer bytes, but a tap's operand would then be a slice at a row offset that is
not a multiple of the slice's length, which Gluon's shared-memory views reject.) The 9 wgmmas run back to back from
shared memory (152 KB in all); bias, residual and ReLU are applied in registers and the tile leaves through a TMA
store from the first input box's buffer (clipped at the image edge).

Predicted (written before it ran; H200): a conv's post-wait critical path = one TMA round trip (~0.6 us) + 9 wgmmas
(0.6 us) + epilogue and store (~0.4 us), plus the ~0.8 us launch link: ~2.4 us at 32^2 and 64^2 (from 4.4-4.6); at
128^2 (256 programs, two waves at one per SM) ~4 us (from 6.3); the 27 Block convs of a 256^2 B=1 decode ~55 us less:
0.216 -> ~0.16 ms.

Covers C_in = C_out = 64, stride 1, no upsample or pre_clamp, sm_90 with Gluon, 16-byte aligned tensors. conv_tc does
the checks, the weight packing (rows tap * 64 + c_in, tap = 3 * dy + dx) and the epilogue semantics.
"""

from __future__ import annotations

from torch import Tensor

from ._gluon import GLUON_ERROR as _GLUON_ERROR
from ._gluon import TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from .conv_halo import _nhwc_desc
from .conv_tc import _capability

C = 64  # channels in and out


def unsupported_reason(x: Tensor, c_out: int, stride: int, upsample: int, pre_clamp: bool) -> str | None:
    """Why conv_tc's launcher cannot hand this call to the tile kernel (it then takes another), or None."""
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if x.shape[1] != C or c_out != C:
        return f"{x.shape[1]}->{c_out} channels (the tile kernel does {C}->{C})"
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the tile kernel does plain stride-1 convs)"
    if x.shape[3] < 16:
        return f"W={x.shape[3]} (< 16: tiles would be mostly padding)"
    if not x.is_cuda or _capability(x.device) != 9:
        return "needs an sm_90 GPU (wgmma)"
    if x.data_ptr() % 16:
        return "x is not 16-byte aligned (TMA)"
    return None


def tile_shape(W: int) -> tuple[int, int]:
    """(TH, TW) of a 64-pixel tile: 64 columns, or 2 x 32 / 4 x 16 for narrower images."""
    tw = 64 if W > 32 else 32 if W > 16 else 16
    return 64 // tw, tw


if gluon is not None:

    @gluon.jit
    def _tile_conv_kernel(x_desc, w_desc, r_desc, y_desc, b_ptr, TILES_H, TILES_W,
                          HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr, TH: gl.constexpr,
                          TW: gl.constexpr, PDL: gl.constexpr):
        M: gl.constexpr = TH * TW
        pid = gl.program_id(0)
        tx = pid % TILES_W
        t = pid // TILES_W
        img = t // TILES_H
        y0 = (t % TILES_H) * TH
        x0 = tx * TW

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, 64, 16])
        x_smem = gl.allocate_shared_memory(gl.float16, [9, 1, TH, TW, 64], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.float16, [9, 64, 64], w_desc.layout)
        if HAS_RES:
            r_smem = gl.allocate_shared_memory(gl.float16, [1, TH, TW, 64], r_desc.layout)
        else:
            r_smem = x_smem.index(0)  # never read
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        w_bar = bars.index(0)
        x_bar = bars.index(1)
        mbarrier.init(w_bar, count=1)
        mbarrier.init(x_bar, count=1)

        # Weights and bias first: the previous kernel does not write them, so they load while it drains.
        mbarrier.expect(w_bar, 9 * 64 * 64 * 2)
        for tap in gl.static_range(9):
            tma.async_copy_global_to_shared(w_desc, [tap * 64, 0], w_bar, w_smem.index(tap))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            bias = gl.load(b_ptr + cols).to(gl.float32)
        else:
            bias = cols  # unused
        if PDL:  # see conv_tc.pdl_args: activations are read only after the previous kernel's writes are visible
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        # One box per tap (a slice of a taller box could not start at a row offset that is not a multiple of M).
        mbarrier.expect(x_bar, (9 + HAS_RES) * M * 64 * 2)
        for tap in gl.static_range(9):
            tma.async_copy_global_to_shared(x_desc, [img, y0 - 1 + tap // 3, x0 - 1 + tap % 3, 0], x_bar,
                                            x_smem.index(tap))
        if HAS_RES:
            tma.async_copy_global_to_shared(r_desc, [img, y0, x0, 0], x_bar, r_smem)

        acc = gl.zeros([M, 64], gl.float32, mma)
        mbarrier.wait(w_bar, 0)
        mbarrier.wait(x_bar, 0)
        for tap in gl.static_range(9):
            acc = warpgroup_mma(x_smem.index(tap).reshape([M, 64]), w_smem.index(tap), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])

        if HAS_BIAS:
            acc = acc + bias[None, :]
        if HAS_RES:
            acc = acc + r_smem.reshape([M, 64]).load(mma).to(gl.float32)
        if RELU:
            acc = gl.maximum(acc, 0.0)
        o_smem = x_smem.index(0)  # the MMAs are done with the input boxes
        o_smem.reshape([M, 64]).store(acc.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(y_desc, [img, y0, x0, 0], o_smem)
        tma.store_wait(0)
        mbarrier.invalidate(w_bar)
        mbarrier.invalidate(x_bar)


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           pdl: dict | None = None) -> None:
    """x, residual, out: channels_last f16 [B, 64, H, W]; wp: conv_tc's packed weight [1, 576, 64] (rows tap * 64 +
    c_in); pdl: conv_tc.pdl_args(x)."""
    B, _, H, W = x.shape
    th, tw = tile_shape(W)
    act = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    box = [1, th, tw, C]
    x_desc = _nhwc_desc(x, box, act)
    y_desc = _nhwc_desc(out, box, act)
    r_desc = _nhwc_desc(residual, box, act) if residual is not None else y_desc
    w_desc = TensorDescriptor.from_tensor(wp.reshape(9 * C, C), [C, C],
                                          gl.NVMMASharedLayout.get_default_for([C, C], gl.float16))
    tiles_h, tiles_w = -(-H // th), -(-W // tw)
    _tile_conv_kernel[(B * tiles_h * tiles_w,)](
        x_desc, w_desc, r_desc, y_desc, b if b is not None else wp, tiles_h, tiles_w,
        HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu), TH=th, TW=tw,
        num_warps=4, **(pdl or {"PDL": False}),
    )
