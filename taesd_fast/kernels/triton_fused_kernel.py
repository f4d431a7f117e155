"""The Triton g kernels of row "triton_fused" (triton_fused.py launches them; head_full_common.py has the maths).

Features are NCDHW, so a [BLOCK_M pixels, BK channels] tile of one frame is contiguous along the pixels. The norm
needs all C channels before any can be activated, so each frame is read twice in BK-channel chunks: once for the
sum of squares, once to activate and feed tl.dot (the second read mostly hits L2). Holding the whole
[BLOCK_M, 256] tile instead spilled registers heavily.

Two variants (same maths, same results up to fp32 summation order inside tl.dot):
  * "roll": one program per (pixel block, batch) walks the window frames once. Each frame is loaded and
    activated once and feeds three accumulators (output frames s-2, s-1, s); the finished one is stored.
  * "per_t": one program per (output frame, pixel block, batch), three taps each; the T programs of a pixel block
    are adjacent in the grid so their shared frames come from L2. Each feature frame is activated up to 3 times.
Both write the new cache from the tiles they already hold (no extra pass over the features). Wk [3, C, 128] bf16
(head_full_common.pack_weight_taps) is padded to 128 columns because tl.dot needs a power-of-two N; only the 112
columns of g are stored. The bf16 rounding and dots go through triton_bf16, so the kernels also run under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

from .triton_bf16 import bf16, dot
from .triton_import import tl, triton

__all__ = ["KERNELS"]

KERNELS: dict = {}  # variant -> kernel; empty without Triton

if triton is not None:

    @triton.jit
    def _inv_norm(x_fr, pm, sxc, eps, C: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr):
        """1 / max(||x||_2, eps) per pixel over all C channels (F.normalize's denominator), in BK-channel chunks.
        The activation pass reads the chunks again (from L1/L2): holding [BLOCK_M, C] in registers spilled."""
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for kc in range(0, C, BK):
            x = tl.load(x_fr + kc * sxc, mask=pm[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        return tl.div_rn(1.0, tl.maximum(tl.sqrt_rn(ss), eps))  # once per pixel; elementwise it is a multiply

    @triton.jit
    def _act(x, inv, gs, INTERP: tl.constexpr):
        """Raw bf16 chunk -> bf16(silu(bf16(x * inv * scale * gamma))): RMSNorm's rounding, then F.silu's."""
        y = bf16(x.to(tl.float32) * inv[:, None] * gs[None, :], INTERP).to(tl.float32)
        return bf16(y / (1.0 + tl.exp(-y)), INTERP)  # F.silu on bf16: fp32 math, one rounding

    @triton.jit
    def _roll_frame(x_fr, nc_fr, nc_cs, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps, pa, pb, pc,
                    C: tl.constexpr, N: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                    NDOT: tl.constexpr, STORE: tl.constexpr, INTERP: tl.constexpr):
        """One feature frame, activated chunk by chunk: tap 2 into pa (which it completes), tap 1 into pb, tap 0
        into pc (NDOT says how many of those output frames exist). STORE: it is a frame of the new cache."""
        inv = _inv_norm(x_fr, pm, sxc, eps, C, BK, BLOCK_M)
        for kc in range(0, C, BK):
            a = _act(tl.load(x_fr + kc * sxc, mask=pm[:, None], other=0.0), inv, tl.load(gs_ptr + kc + ck), INTERP)
            if STORE:
                tl.store(nc_fr + kc * nc_cs, a, mask=pm[:, None])
            wk = w_ptr + kc * N + w_tile
            pa = dot(a, tl.load(wk + 2 * C * N), pa, INTERP)
            if NDOT >= 2:
                pb = dot(a, tl.load(wk + C * N), pb, INTERP)
            if NDOT >= 3:
                pc = dot(a, tl.load(wk), pc, INTERP)
        return pa, pb, pc

    @triton.jit
    def _head_g_roll(x_ptr, c_ptr, gs_ptr, w_ptr, g_ptr, nc_ptr,
                     T, HW, sxb, sxc, sxt, scb, scc, sct, eps,
                     C: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                     HAS_CACHE: tl.constexpr, INTERP: tl.constexpr):
        """One program: BLOCK_M pixels of one image, all T output frames, each window frame read once.
        Carried: pa = output frame j (taps 0, 1 summed in), pb = output frame j+1 (tap 0)."""
        b = tl.program_id(1).to(tl.int64)
        p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        pm = p < HW
        ck = tl.arange(0, BK)
        n = tl.arange(0, N)
        w_tile = ck[:, None] * N + n[None, :]  # Wk [3, C, N]: chunk rows kc.. of tap k at w_ptr + (k*C + kc)*N
        x_fr = x_ptr + b * sxb + ck[None, :] * sxc + p[:, None]  # frame 0, channels 0..BK
        nc_fr = nc_ptr + b * (C * 2 * HW) + ck[None, :] * (2 * HW) + p[:, None]  # new cache: contiguous
        g_tile = g_ptr + (b * T * HW + p[:, None]) * G + n[None, :]  # g: dense [B, T, H*W, G]
        g_mask = pm[:, None] & (n[None, :] < G)
        zero = tl.zeros([BLOCK_M, N], dtype=tl.float32)

        pa = zero
        pb = zero
        if HAS_CACHE:
            c_fr = c_ptr + b * scb + ck[None, :] * scc + p[:, None]
            for kc in range(0, C, BK):
                a0 = tl.load(c_fr + kc * scc, mask=pm[:, None], other=0.0)
                a1 = tl.load(c_fr + kc * scc + sct, mask=pm[:, None], other=0.0)
                w0 = tl.load(w_ptr + kc * N + w_tile)
                pa = dot(a0, w0, pa, INTERP)
                pa = dot(a1, tl.load(w_ptr + (C + kc) * N + w_tile), pa, INTERP)
                pb = dot(a1, w0, pb, INTERP)
                if T == 1:  # window frame 1 is the first frame of the new cache
                    tl.store(nc_fr + kc * (2 * HW), a1, mask=pm[:, None])
        else:
            if T == 1:  # ... and it is a causal zero frame
                for kc in range(0, C, BK):
                    tl.store(nc_fr + kc * (2 * HW), tl.zeros([BLOCK_M, BK], dtype=tl.bfloat16), mask=pm[:, None])

        # Feature frame j = window frame j+2. The last two frames do fewer dots (their later output frames do
        # not exist) and are the new cache, so they are peeled off the loop: no branches inside it.
        for j in range(T - 2):
            pa, pb, pc = _roll_frame(x_fr + j * sxt, nc_fr, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                     pa, pb, zero, C, N, BK, BLOCK_M, 3, False, INTERP)
            tl.store(g_tile + j * (HW * G), bf16(pa, INTERP), mask=g_mask)
            pa = pb
            pb = pc
        if T >= 2:
            pa, pb, pc = _roll_frame(x_fr + (T - 2) * sxt, nc_fr, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                     pa, pb, zero, C, N, BK, BLOCK_M, 2, True, INTERP)
            tl.store(g_tile + (T - 2) * (HW * G), bf16(pa, INTERP), mask=g_mask)
            pa = pb
        pa, pb, pc = _roll_frame(x_fr + (T - 1) * sxt, nc_fr + HW, 2 * HW, pm, ck, w_tile, gs_ptr, w_ptr, sxc, eps,
                                 pa, zero, zero, C, N, BK, BLOCK_M, 1, True, INTERP)
        tl.store(g_tile + (T - 1) * (HW * G), bf16(pa, INTERP), mask=g_mask)

    @triton.jit
    def _head_g_per_t(x_ptr, c_ptr, gs_ptr, w_ptr, g_ptr, nc_ptr,
                      T, HW, sxb, sxc, sxt, scb, scc, sct, eps,
                      C: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr,
                      HAS_CACHE: tl.constexpr, INTERP: tl.constexpr):
        """One program: BLOCK_M pixels of output frame t. t varies fastest in the grid, so the T programs of a
        pixel block run together and the frames they share are read from L2."""
        pid = tl.program_id(0)
        t = pid % T
        b = tl.program_id(1).to(tl.int64)
        p = (pid // T) * BLOCK_M + tl.arange(0, BLOCK_M)
        pm = p < HW
        ck = tl.arange(0, BK)
        n = tl.arange(0, N)
        w_tile = w_ptr + ck[:, None] * N + n[None, :]
        x_fr = x_ptr + b * sxb + ck[None, :] * sxc + p[:, None]
        nc_fr = nc_ptr + b * (C * 2 * HW) + ck[None, :] * (2 * HW) + p[:, None]
        last = t == T - 1  # this program holds window frames T and T+1: the new cache
        # Below, `if k >= 1` is resolved at compile time (k is a static_range constant), `if last` at run time.
        acc = tl.zeros([BLOCK_M, N], dtype=tl.float32)
        for k in tl.static_range(3):
            s = t + k  # window frame
            w_k = w_tile + k * C * N
            if s < 2:
                if HAS_CACHE:
                    c_fr = c_ptr + b * scb + ck[None, :] * scc + p[:, None] + s * sct
                    for kc in range(0, C, BK):
                        a = tl.load(c_fr + kc * scc, mask=pm[:, None], other=0.0)
                        acc = dot(a, tl.load(w_k + kc * N), acc, INTERP)
                        if k >= 1:
                            if last:
                                tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW), a, mask=pm[:, None])
                else:  # causal zero frame: no dot
                    if k >= 1:
                        if last:
                            for kc in range(0, C, BK):
                                tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW),
                                         tl.zeros([BLOCK_M, BK], dtype=tl.bfloat16), mask=pm[:, None])
            else:
                xs = x_fr + (s - 2) * sxt
                inv = _inv_norm(xs, pm, sxc, eps, C, BK, BLOCK_M)
                for kc in range(0, C, BK):
                    a = _act(tl.load(xs + kc * sxc, mask=pm[:, None], other=0.0), inv, tl.load(gs_ptr + kc + ck),
                             INTERP)
                    acc = dot(a, tl.load(w_k + kc * N), acc, INTERP)
                    if k >= 1:
                        if last:
                            tl.store(nc_fr + (k - 1) * HW + kc * (2 * HW), a, mask=pm[:, None])
        g_ptrs = g_ptr + ((b * T + t) * HW + p[:, None]) * G + n[None, :]
        tl.store(g_ptrs, bf16(acc, INTERP), mask=pm[:, None] & (n[None, :] < G))

    KERNELS.update(roll=_head_g_roll, per_t=_head_g_per_t)
