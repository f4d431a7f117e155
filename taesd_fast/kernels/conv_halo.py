"""The tensor-core conv's row-streaming variant for 64->64 stride-1 3x3 convs on Hopper (Gluon: explicit shared
memory, TMA and asynchronous wgmma).

Why: the Triton kernels (conv_tc, conv_tc_tma) load each tap's input box and a [64, 64] weight slice for every
output tile: 9 input boxes plus 72 KB of weights per 128 output pixels, ~4.8 GB of L2 -> SM traffic per 256^2 B=64
conv, and run at 52-54% of the GEMM ceiling (BENCHMARKS.md, "Issue 5 continued").

How: one program owns a strip of BLOCK_W output columns (64 per warpgroup) and a run of ROWS output rows of one
image. The 9 weight taps stay in shared memory for the whole run (loaded once). The program walks down the input
rows j = r0-1 .. r0+ROWS: each row arrives as three TMA boxes [BLOCK_W, 64] shifted by dx = -1, 0, +1 columns (TMA
zero-fills outside the image: the conv's padding), is loaded once into registers as the MMA's A operand per dx, and
feeds three output rows at once: row j+1 (tap dy=0), row j (dy=1) and row j-1 (dy=2), each with its own fp32
accumulator. Row j-1 is then complete: bias, residual and ReLU are applied in registers and the row leaves through a
TMA store. Input traffic is ~3 boxes per output row (plus 2 halo rows per run) instead of 9 per tile, weights once
per program, and every A fragment is read from shared memory once for three MMAs.

Predicted (written before it ran; H200): MMA-bound at N=64, 70-80% of the 689 TFLOP/s ceiling: 64->64 256^2 B=64
0.55-0.65 ms (from 0.83-0.87 with conv_tc_tma).

Covers C_in = C_out = 64, stride 1, no upsample, no pre_clamp, sm_90+ with Gluon; conv_tc does the checks, the
weight packing (rows tap * 64 + c_in, 64 columns) and the epilogue semantics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON_ERROR: str | None = None
except Exception as e:  # older Triton without Gluon's Hopper API, or no Triton at all
    gluon = gl = None
    _GLUON_ERROR = f"Gluon (Triton's Hopper API) not importable ({type(e).__name__}: {e})"

C = 64  # channels in and out
STAGES = 2  # input rows in flight (shared memory: weights 72 KB + STAGES x (3 + residual) boxes)


def unsupported_reason(x: Tensor, c_in: int, c_out: int, stride: int, upsample: int, pre_clamp: bool) -> str | None:
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    if c_in != C or c_out != C:
        return f"{c_in}->{c_out} channels (the row-streaming kernel is for {C}->{C})"
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the row-streaming kernel does plain stride-1 convs)"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "needs an sm_90 GPU (wgmma)"
    if x.data_ptr() % 16:
        return "x is not 16-byte aligned (TMA)"
    return None


if gluon is not None:

    @gluon.jit
    def _load_row(x_desc, r_desc, x_smem, r_smem, bar, stage, img, row, col0, pred,
                  HAS_RES: gl.constexpr, BLOCK_W: gl.constexpr):
        # Input row `row` as three boxes shifted by dx - 1 columns, and (with a residual) output row row - 1's
        # residual, which the epilogue of the step that consumes this stage needs.
        nbytes: gl.constexpr = (4 if HAS_RES else 3) * BLOCK_W * 64 * 2
        mbarrier.expect(bar, nbytes, pred=pred)
        for dx in gl.static_range(3):
            tma.async_copy_global_to_shared(x_desc, [img, row, col0 - 1 + dx, 0], bar, x_smem.index(stage * 3 + dx),
                                            pred=pred)
        if HAS_RES:
            tma.async_copy_global_to_shared(r_desc, [img, row - 1, col0, 0], bar, r_smem.index(stage), pred=pred)

    @gluon.jit
    def _halo_conv_kernel(x_desc, w_desc, r_desc, y_desc, b_ptr, H, ROWS, CHUNKS, STRIPS,
                          HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr,
                          BLOCK_W: gl.constexpr, NUM_STAGES: gl.constexpr):
        pid = gl.program_id(0)
        strip = pid % STRIPS
        t = pid // STRIPS
        img = t // CHUNKS
        r0 = (t % CHUNKS) * ROWS
        r_end = gl.minimum(r0 + ROWS, H)
        col0 = strip * BLOCK_W
        # Input rows r0-1 .. r_end, rounded up to whole groups of three steps (the accumulator roles rotate with
        # period 3); the extra rows produce output rows past r_end, which are not stored.
        n_groups = (r_end - r0 + 4) // 3

        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, 64, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

        x_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES * 3, 1, 1, BLOCK_W, 64], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.float16, [9, 64, 64], w_desc.layout)
        o_smem = gl.allocate_shared_memory(gl.float16, [1, 1, BLOCK_W, 64], y_desc.layout)
        if HAS_RES:
            r_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, 1, 1, BLOCK_W, 64], r_desc.layout)
        else:
            r_smem = o_smem  # never read
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES + 1):
            mbarrier.init(bars.index(i), count=1)

        w_bar = bars.index(NUM_STAGES)
        mbarrier.expect(w_bar, 9 * 64 * 64 * 2)
        for tap in gl.static_range(9):
            tma.async_copy_global_to_shared(w_desc, [tap * 64, 0], w_bar, w_smem.index(tap))
        for s in gl.static_range(NUM_STAGES):
            _load_row(x_desc, r_desc, x_smem, r_smem, bars.index(s), s, img, r0 - 1 + s, col0, True,
                      HAS_RES, BLOCK_W)

        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            bias = gl.load(b_ptr + cols).to(gl.float32)
        acc0 = gl.zeros([BLOCK_W, 64], gl.float32, mma)
        acc1 = gl.zeros([BLOCK_W, 64], gl.float32, mma)
        acc2 = gl.zeros([BLOCK_W, 64], gl.float32, mma)
        mbarrier.wait(w_bar, 0)

        for g in range(n_groups):
            # Step i = 3g + k reads input row j = r0 - 1 + i; output row r lives in accumulator (r - r0 + 1) % 3, so
            # row j+1 (first contribution) is in acc (k+1)%3, row j in acc k, row j-1 (completes) in acc (k+2)%3.
            acc1, acc0, acc2 = _row_step(3 * g + 0, acc1, acc0, acc2, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias if HAS_BIAS else cols, img, r0, r_end, col0,
                                         n_groups, dot_a, mma, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
            acc2, acc1, acc0 = _row_step(3 * g + 1, acc2, acc1, acc0, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias if HAS_BIAS else cols, img, r0, r_end, col0,
                                         n_groups, dot_a, mma, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
            acc0, acc2, acc1 = _row_step(3 * g + 2, acc0, acc2, acc1, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias if HAS_BIAS else cols, img, r0, r_end, col0,
                                         n_groups, dot_a, mma, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
        tma.store_wait(0)
        for i in gl.static_range(NUM_STAGES + 1):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _row_step(i, acc_next, acc_cur, acc_done, x_desc, r_desc, y_desc, x_smem, r_smem, w_smem, o_smem, bars, bias,
                  img, r0, r_end, col0, n_groups, dot_a: gl.constexpr, mma: gl.constexpr, HAS_BIAS: gl.constexpr,
                  HAS_RES: gl.constexpr, RELU: gl.constexpr, BLOCK_W: gl.constexpr, NUM_STAGES: gl.constexpr):
        stage = i % NUM_STAGES
        bar = bars.index(stage)
        mbarrier.wait(bar, (i // NUM_STAGES) & 1)
        a0 = x_smem.index(stage * 3 + 0).reshape([BLOCK_W, 64]).load(dot_a)
        a1 = x_smem.index(stage * 3 + 1).reshape([BLOCK_W, 64]).load(dot_a)
        a2 = x_smem.index(stage * 3 + 2).reshape([BLOCK_W, 64]).load(dot_a)
        if HAS_RES:
            res = r_smem.index(stage).reshape([BLOCK_W, 64]).load(mma)
        gl.thread_barrier()  # every warp has its operands in registers: the stage can be refilled
        nxt = i + NUM_STAGES
        _load_row(x_desc, r_desc, x_smem, r_smem, bar, stage, img, r0 - 1 + nxt, col0, nxt < 3 * n_groups,
                  HAS_RES, BLOCK_W)

        # Row j-1 (acc_done) first, so it can be drained while the other six MMAs run.
        acc_done = warpgroup_mma(a0, w_smem.index(6), acc_done, is_async=True)
        acc_cur = warpgroup_mma(a0, w_smem.index(3), acc_cur, is_async=True)
        acc_next = warpgroup_mma(a0, w_smem.index(0), acc_next, use_acc=False, is_async=True)
        acc_done = warpgroup_mma(a1, w_smem.index(7), acc_done, is_async=True)
        acc_cur = warpgroup_mma(a1, w_smem.index(4), acc_cur, is_async=True)
        acc_next = warpgroup_mma(a1, w_smem.index(1), acc_next, is_async=True)
        acc_done = warpgroup_mma(a2, w_smem.index(8), acc_done, is_async=True)
        acc_cur = warpgroup_mma(a2, w_smem.index(5), acc_cur, is_async=True)
        acc_next = warpgroup_mma(a2, w_smem.index(2), acc_next, is_async=True)
        acc_done, acc_cur, acc_next = warpgroup_mma_wait(2, deps=[acc_done, acc_cur, acc_next])

        out = acc_done
        if HAS_BIAS:
            out = out + bias[None, :]
        if HAS_RES:
            out = out + res.to(gl.float32)
        if RELU:
            out = gl.maximum(out, 0.0)
        row = r0 - 2 + i
        tma.store_wait(0)
        gl.thread_barrier()  # the previous row's store has left o_smem
        o_smem.reshape([BLOCK_W, 64]).store(out.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        if (row >= r0) & (row < r_end):
            tma.async_copy_shared_to_global(y_desc, [img, row, col0, 0], o_smem)
        acc_cur, acc_next = warpgroup_mma_wait(0, deps=[acc_cur, acc_next])
        return acc_next, acc_cur, acc_done


def _rows_per_program(B: int, H: int, strips: int, sms: int) -> int:
    """Rows per program: whole columns where that fills the GPU, else enough row chunks for ~one wave (each chunk
    re-reads 2 halo rows, so fewer, longer chunks are cheaper)."""
    best = None
    for chunks in range(1, H + 1):
        rows = -(-H // chunks)
        programs = B * strips * -(-H // rows)
        cost = -(-programs // sms) * (rows + 2)
        if best is None or cost < best[0]:
            best = (cost, rows)
    return best[1]


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           block_w: int = 128) -> None:
    """x, residual, out: channels_last f16 [B, 64, H, W]; wp: conv_tc's packed weight [576, 64] (tap-major rows)."""
    B, _, H, W = x.shape
    act_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    box = [1, 1, block_w, C]
    x_desc = TensorDescriptor.from_tensor(x.permute(0, 2, 3, 1), box, act_layout)
    y_desc = TensorDescriptor.from_tensor(out.permute(0, 2, 3, 1), box, act_layout)
    r_desc = TensorDescriptor.from_tensor(residual.permute(0, 2, 3, 1), box, act_layout) if residual is not None \
        else y_desc
    w_desc = TensorDescriptor.from_tensor(wp.reshape(9 * C, C), [C, C],
                                          gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    strips = -(-W // block_w)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    rows = _rows_per_program(B, H, strips, sms)
    chunks = -(-H // rows)
    grid = (B * chunks * strips,)
    _halo_conv_kernel[grid](
        x_desc, w_desc, r_desc, y_desc, b if b is not None else wp, H, rows, chunks, strips,
        HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu), BLOCK_W=block_w,
        NUM_STAGES=STAGES, num_warps=block_w // 16,
    )
