"""The row-streaming conv (row "gluon_conv_rows"): 64->64 and 64->3 stride-1 3x3 convs on Hopper (Gluon: explicit
shared memory, TMA and asynchronous wgmma).

Why: the Triton kernels (triton_conv, triton_conv_tma) load each tap's input box and a [64, 64] weight slice for every
output tile: 9 input boxes plus 72 KB of weights per 128 output pixels, so they are bound by L2 -> SM traffic.

How: one program owns a strip of BLOCK_W output columns (64 per warpgroup) and a run of ROWS output rows of one
image. The 9 weight taps stay in shared memory for the whole run (loaded once). The program walks down the input
rows j = r0-1 .. r0+ROWS: each row arrives as three TMA boxes [BLOCK_W, 64] shifted by dx = -1, 0, +1 columns (TMA
zero-fills outside the image: the conv's padding), is loaded once into registers as the MMA's A operand per dx, and
feeds three output rows at once: row j+1 (tap dy=0), row j (dy=1) and row j-1 (dy=2), each with its own fp32
accumulator. Row j-1 is then complete: bias, residual and ReLU are applied in registers and the row leaves through a
TMA store. Input traffic is ~3 boxes per output row (plus 2 halo rows per run) instead of 9 per tile, weights once
per program, and every A fragment is read from shared memory once for three MMAs. A run's first two and last steps
skip the MMAs whose rows lie outside the run (the halo rows above it, the rows past its end).

cuda_conv_rows.py is the same schedule in CUDA C++ (its own row, faster on short runs in one wave).

Covers C_in = 64 with C_out = 64, or C_out <= 16 without a residual (the decoder's 64->3: N padded to 16, masked
stores); stride 1, no upsample, no pre_clamp, W >= 64, sm_90 with Gluon. The weight is conv_pack's (rows
tap * 64 + c_in). With PDL (tma_pdl) the weights load while the previous kernel drains; activations are touched only
after griddepcontrol.wait. x and the residual must start 16-byte aligned (TMA): views that do not are copied first.
"""

from __future__ import annotations

from torch import Tensor

from .conv_launch import conv_row_run, launch_checked, sm90_spec_reason, spec_launched
from .conv_pack import packed_weight, plan
from .conv_schedule import rows_per_program
from .device import sm_count
from .gluon_import import GLUON_ERROR as _GLUON_ERROR
from .gluon_import import (TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                           warpgroup_mma_wait)
from .tma_pdl import nhwc_desc, pdl_wait

NAME = "gluon_conv_rows"

C = 64  # channels in and out
STAGES = 2  # input rows in flight for 64->64 (shared memory: weights 72 KB + STAGES x (3 + residual) boxes of 16 KB)
# Programs per SM for narrow outputs (64->3: weights 18 KB + 3 stages x 3 boxes of 8 KB = ~92 KB of shared memory,
# so two fit). Row runs are sized for that many resident programs: at B=1 a run's rows are walked one after another,
# so shorter runs cut latency. 64->64 programs (144-216 KB) fit one per SM.
NARROW_PER_SM = 2


def shape_reason(c_in: int, c_out: int, W: int, stride: int, upsample: int, pre_clamp: bool,
                 residual: bool) -> str | None:
    """Why the kernel does not cover this conv (beyond the conv contract and the GPU), or None."""
    if c_in != C or not (c_out == C or (c_out <= 16 and not residual)):
        return (f"{c_in}->{c_out} channels{' with a residual' if residual else ''} (the row-streaming kernel does "
                f"{C}->{C}, and {C}->16 or fewer without a residual)")
    if stride != 1 or upsample != 1 or pre_clamp:
        return "stride 2, the upsample fold or pre_clamp (the row-streaming kernel does plain stride-1 convs)"
    if W < 64:
        return f"W={W} (< 64: strips of 64 columns would be mostly padding)"
    return None


def spec_unsupported_reason(spec) -> str | None:
    """The row's support rule: CUDA sm_90 with Gluon, the conv contract, then shape_reason."""
    return sm90_spec_reason(spec, _GLUON_ERROR) or shape_reason(
        spec.w_shape[1], spec.w_shape[0], spec.x_shape[3], spec.stride, spec.upsample,
        spec.pre_clamp, spec.residual)


def spec_ready(spec) -> bool:
    """True once this exact call shape was launched in this process (Gluon specialises on the sizes)."""
    return spec_launched(NAME, spec, tuple(spec.x_shape))


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
    def _halo_conv_kernel(x_desc, w_desc, r_desc, y_desc, b_ptr, y_ptr, H, W, ROWS, CHUNKS, STRIPS,
                          C_OUT: gl.constexpr, N_PAD: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                          RELU: gl.constexpr, BLOCK_W: gl.constexpr, NUM_STAGES: gl.constexpr, PDL: gl.constexpr):
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
                                                      instr_shape=[16, N_PAD, 16])
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

        x_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES * 3, 1, 1, BLOCK_W, 64], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.float16, [9, 64, N_PAD], w_desc.layout)
        if C_OUT == 64:  # full rows leave through TMA stores; narrow outputs (64->3) through masked stores
            o_smem = gl.allocate_shared_memory(gl.float16, [1, 1, BLOCK_W, 64], y_desc.layout)
        else:
            o_smem = w_smem  # never written
        if HAS_RES:
            r_smem = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, 1, 1, BLOCK_W, 64], r_desc.layout)
        else:
            r_smem = w_smem  # never read
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES + 1):
            mbarrier.init(bars.index(i), count=1)

        w_bar = bars.index(NUM_STAGES)
        mbarrier.expect(w_bar, 9 * 64 * N_PAD * 2)
        for tap in gl.static_range(9):
            tma.async_copy_global_to_shared(w_desc, [tap * 64, 0], w_bar, w_smem.index(tap))
        if PDL:  # see tma_pdl: the weights load while the previous kernel drains; activations wait for it
            pdl_wait()
        for s in gl.static_range(NUM_STAGES):
            _load_row(x_desc, r_desc, x_smem, r_smem, bars.index(s), s, img, r0 - 1 + s, col0, True,
                      HAS_RES, BLOCK_W)

        cols = gl.arange(0, N_PAD, layout=gl.SliceLayout(0, mma))
        if HAS_BIAS:
            bias = gl.load(b_ptr + cols, mask=cols < C_OUT, other=0.0).to(gl.float32)
        else:
            bias = cols  # unused
        acc0 = gl.zeros([BLOCK_W, N_PAD], gl.float32, mma)
        acc1 = gl.zeros([BLOCK_W, N_PAD], gl.float32, mma)
        acc2 = gl.zeros([BLOCK_W, N_PAD], gl.float32, mma)
        mbarrier.wait(w_bar, 0)

        for g in range(n_groups):
            # Step i = 3g + k reads input row j = r0 - 1 + i; output row r lives in accumulator (r - r0 + 1) % 3, so
            # row j+1 (first contribution) is in acc (k+1)%3, row j in acc k, row j-1 (completes) in acc (k+2)%3.
            acc1, acc0, acc2 = _row_step(3 * g + 0, acc1, acc0, acc2, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias, y_ptr, img, r0, r_end, col0, H, W, n_groups,
                                         dot_a, mma, C_OUT, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
            acc2, acc1, acc0 = _row_step(3 * g + 1, acc2, acc1, acc0, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias, y_ptr, img, r0, r_end, col0, H, W, n_groups,
                                         dot_a, mma, C_OUT, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
            acc0, acc2, acc1 = _row_step(3 * g + 2, acc0, acc2, acc1, x_desc, r_desc, y_desc, x_smem, r_smem,
                                         w_smem, o_smem, bars, bias, y_ptr, img, r0, r_end, col0, H, W, n_groups,
                                         dot_a, mma, C_OUT, HAS_BIAS, HAS_RES, RELU, BLOCK_W, NUM_STAGES)
        tma.store_wait(0)
        for i in gl.static_range(NUM_STAGES + 1):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _store_row(acc, res, bias, y_desc, o_smem, y_ptr, img, row, r0, r_end, col0, H, W, mma: gl.constexpr,
                   C_OUT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr,
                   BLOCK_W: gl.constexpr):
        # Output row `row` from its accumulator: bias, residual, ReLU; stored only if the run owns the row.
        out = acc
        if HAS_BIAS:
            out = out + bias[None, :]
        if HAS_RES:
            out = out + res.to(gl.float32)
        if RELU:
            out = gl.maximum(out, 0.0)
        row_ok = (row >= r0) & (row < r_end)
        if C_OUT == 64:
            tma.store_wait(0)
            gl.thread_barrier()  # the previous row's store has left o_smem
            o_smem.reshape([BLOCK_W, 64]).store(out.to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            if row_ok:
                tma.async_copy_shared_to_global(y_desc, [img, row, col0, 0], o_smem)
        else:
            px = col0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, mma))
            n = gl.arange(0, out.shape[1], layout=gl.SliceLayout(0, mma))
            offs = ((img * H + row).to(gl.int64) * W + px)[:, None] * C_OUT + n[None, :]
            mask = ((px < W)[:, None] & (n < C_OUT)[None, :]) & row_ok
            gl.store(y_ptr + offs, out.to(gl.float16), mask=mask)

    @gluon.jit
    def _row_step(i, acc_next, acc_cur, acc_done, x_desc, r_desc, y_desc, x_smem, r_smem, w_smem, o_smem, bars, bias,
                  y_ptr, img, r0, r_end, col0, H, W, n_groups, dot_a: gl.constexpr, mma: gl.constexpr,
                  C_OUT: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr, RELU: gl.constexpr,
                  BLOCK_W: gl.constexpr, NUM_STAGES: gl.constexpr):
        stage = i % NUM_STAGES
        bar = bars.index(stage)
        mbarrier.wait(bar, (i // NUM_STAGES) & 1)
        a0 = x_smem.index(stage * 3 + 0).reshape([BLOCK_W, 64]).load(dot_a)
        a1 = x_smem.index(stage * 3 + 1).reshape([BLOCK_W, 64]).load(dot_a)
        a2 = x_smem.index(stage * 3 + 2).reshape([BLOCK_W, 64]).load(dot_a)
        if HAS_RES:
            res = r_smem.index(stage).reshape([BLOCK_W, 64]).load(mma)
        else:
            res = bias  # unused
        gl.thread_barrier()  # every warp has its operands in registers: the stage can be refilled
        nxt = i + NUM_STAGES
        _load_row(x_desc, r_desc, x_smem, r_smem, bar, stage, img, r0 - 1 + nxt, col0, nxt < 3 * n_groups,
                  HAS_RES, BLOCK_W)

        row_done = r0 - 2 + i  # the row acc_done completes; acc_cur and acc_next hold rows row_done + 1 and + 2
        if (i >= 2) & (row_done + 2 < r_end):  # every MMA of this step feeds a row of the run
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
            _store_row(acc_done, res, bias, y_desc, o_smem, y_ptr, img, row_done, r0, r_end, col0, H, W, mma,
                       C_OUT, HAS_BIAS, HAS_RES, RELU, BLOCK_W)
            # Drain the last two MMAs before the next step reloads the A registers they read.
            acc_cur, acc_next = warpgroup_mma_wait(0, deps=[acc_cur, acc_next])
        else:
            # A run's first two and last steps: only the MMAs for rows the run stores (the others would feed the
            # halo rows above it, or rows past its end). At 4 rows per program (B=1) that is a third of the MMAs.
            # Each group drains before the branch ends: asynchronous accumulators cannot leave a branch.
            if (i >= 2) & (row_done < r_end):
                acc_done = warpgroup_mma(a0, w_smem.index(6), acc_done, is_async=True)
                acc_done = warpgroup_mma(a1, w_smem.index(7), acc_done, is_async=True)
                acc_done = warpgroup_mma(a2, w_smem.index(8), acc_done, is_async=True)
                acc_done = warpgroup_mma_wait(0, deps=[acc_done])
            if (i >= 1) & (row_done + 1 < r_end):
                acc_cur = warpgroup_mma(a0, w_smem.index(3), acc_cur, is_async=True)
                acc_cur = warpgroup_mma(a1, w_smem.index(4), acc_cur, is_async=True)
                acc_cur = warpgroup_mma(a2, w_smem.index(5), acc_cur, is_async=True)
                acc_cur = warpgroup_mma_wait(0, deps=[acc_cur])
            if row_done + 2 < r_end:
                acc_next = warpgroup_mma(a0, w_smem.index(0), acc_next, use_acc=False, is_async=True)
                acc_next = warpgroup_mma(a1, w_smem.index(1), acc_next, is_async=True)
                acc_next = warpgroup_mma(a2, w_smem.index(2), acc_next, is_async=True)
                acc_next = warpgroup_mma_wait(0, deps=[acc_next])
            _store_row(acc_done, res, bias, y_desc, o_smem, y_ptr, img, row_done, r0, r_end, col0, H, W, mma,
                       C_OUT, HAS_BIAS, HAS_RES, RELU, BLOCK_W)
        return acc_next, acc_cur, acc_done


def strip_width(W: int, c_out: int) -> int:
    """Output columns per program: one warpgroup (64) where W <= 64 (a wider strip would be half padding) and for
    narrow outputs (memory-bound: twice the programs hide more latency), else two (128)."""
    return 64 if W <= 64 or c_out < C else 128


def launch(x: Tensor, wp: Tensor, b: Tensor | None, residual: Tensor | None, out: Tensor, relu: bool,
           pdl: dict | None = None) -> None:
    """x, residual, out: channels_last f16 [B, C, H, W], 16-byte aligned (C = 64; out may have fewer channels); wp:
    conv_pack's weight [1, 576, n_pad] (n_pad = 64, or 16 for narrow outputs); pdl: tma_pdl.pdl_args(x)."""
    B, _, H, W = x.shape
    c_out, n_pad = out.shape[1], wp.shape[-1]
    block_w = strip_width(W, c_out)
    strips = -(-W // block_w)
    per_sm = NARROW_PER_SM if n_pad < C else 1
    rows = rows_per_program(B, H, strips, sm_count(x.device) * per_sm)
    chunks = -(-H // rows)
    act_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    box = [1, 1, block_w, C]
    x_desc = nhwc_desc(x, box, act_layout)
    y_desc = nhwc_desc(out, box, act_layout) if c_out == C else x_desc  # narrow outputs use plain stores
    r_desc = nhwc_desc(residual, box, act_layout) if residual is not None else x_desc
    w_desc = TensorDescriptor.from_tensor(wp.reshape(9 * C, n_pad), [C, n_pad],
                                          gl.NVMMASharedLayout.get_default_for([C, n_pad], gl.float16))
    _halo_conv_kernel[(B * chunks * strips,)](
        x_desc, w_desc, r_desc, y_desc, b if b is not None else wp, out, H, W, rows, chunks, strips,
        C_OUT=c_out, N_PAD=n_pad, HAS_BIAS=b is not None, HAS_RES=residual is not None, RELU=bool(relu),
        BLOCK_W=block_w, NUM_STAGES=STAGES if n_pad == C else 3, num_warps=block_w // 16, **(pdl or {"PDL": False}),
    )


def launch_conv(x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor | None, stride: int, relu: bool,
                upsample: int = 1, pre_clamp: bool = False) -> Tensor:
    """Check the call against the row's rule (ValueError naming the limit), then launch. Returns channels_last y."""
    refuse = shape_reason(x.shape[1], w.shape[0], x.shape[3], stride, upsample, pre_clamp, residual is not None)
    return launch_checked(NAME, x, w, b, residual, stride, relu, upsample, pre_clamp, refuse,
                          lambda: packed_weight(w, upsample, plan(x.shape[1], w.shape[0], upsample)),
                          lambda c, wp, pdl: launch(c.x, wp, c.b, c.residual, c.out, relu, pdl), tuple(x.shape))


run = conv_row_run(NAME, launch_conv)  # the dispatcher's conv2d entry; registers launch_conv with the conv3x3_tc op
