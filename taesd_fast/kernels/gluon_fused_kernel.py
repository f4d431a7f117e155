"""The Gluon g kernel of row "gluon_fused" (gluon_fused.py holds its design, limits and launch): four partitions
synchronised by mbarriers per ring slot, a loader (1 warp), an activator (8 warps) and two MMA warpgroups (g's
columns 0-95 and 96-111), over weights resident in shared memory."""

from __future__ import annotations

from .gluon_import import fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from .head_g_layout import GC as G  # g channels: 9 spatial taps x 12 outputs, padded

MAXNREG = 96  # 20 warps in all (4 + 4 MMA, 8 activation, 1 loader, rounded up to warpgroups): 60K registers
NARROW_REGS = 88  # the 16-column MMA warpgroup
ACT_REGS = 56  # the 8 activation warps

__all__ = ["MAXNREG", "head_g_kernel"]

if gluon is None:
    head_g_kernel = None
else:
    _G = gl.constexpr(G)  # read inside the kernels
    NARROW_REGS = gl.constexpr(NARROW_REGS)
    ACT_REGS = gl.constexpr(ACT_REGS)

    @gluon.jit
    def _chunk(q, QT, pid, nprog, tiles_per_img, KC: gl.constexpr, S0: gl.constexpr):
        # Chunk q of a program's stream: (window frame s, first channel, image, first pixel). Tile q // QT, frame
        # S0 + (q % QT) // KC, channel block (q % QT) % KC. Window frames 0, 1 are the cache, s >= 2 feature s - 2.
        r = q % QT
        tile = pid + (q // QT) * nprog
        return S0 + r // KC, (r % KC) * 64, tile // tiles_per_img, (tile % tiles_per_img) * 64

    @gluon.jit
    def _loader(x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar, gs_ptr, g_ptr, nc_ptr, eps, pid,
                nprog, my_tiles, tiles_per_img, HW, T: gl.constexpr, C: gl.constexpr, HAS_CACHE: gl.constexpr,
                NSLOT: gl.constexpr):
        # 1 warp: TMA-loads every chunk of the stream into slot q % NSLOT once both MMA warpgroups have freed it.
        # (Worker partitions share one signature: most arguments are the other workers'.)
        KC: gl.constexpr = C // 64
        S0: gl.constexpr = 0 if HAS_CACHE else 2  # without a cache, window frames 0 and 1 are zeros: skipped
        QT = (T + 2 - S0) * KC
        for q in range(my_tiles * QT):
            s, ch0, img, p0 = _chunk(q, QT, pid, nprog, tiles_per_img, KC, S0)
            mbarrier.wait(free.index(q % NSLOT), ((q // NSLOT) & 1) ^ 1)  # fresh barriers count as freed
            bar = ready.index(q % NSLOT)
            slot = slots.index(q % NSLOT)
            mbarrier.expect(bar, 64 * 64 * 2)
            if HAS_CACHE:
                tma.async_copy_global_to_shared(c_desc, [img, ch0, s, p0], bar, slot, pred=s < 2)
            tma.async_copy_global_to_shared(x_desc, [img, ch0, s - 2, p0], bar, slot, pred=s >= 2)

    @gluon.jit
    def _inv_norm(slots, ready, qf, eps, KC: gl.constexpr, NSLOT: gl.constexpr, blk: gl.constexpr):
        # 1 / max(||x||_2, eps) per pixel over all channels of the frame whose chunks start at qf (F.normalize).
        ss = gl.zeros([64], gl.float32, gl.SliceLayout(0, blk))
        for kc in gl.static_range(KC):
            q = qf + kc
            mbarrier.wait(ready.index(q % NSLOT), (q // NSLOT) & 1)
            x = slots.index(q % NSLOT).reshape([64, 64]).load(blk).to(gl.float32)
            ss += gl.sum(x * x, axis=0)
        return gl.div_rn(gl.full([64], 1.0, gl.float32, gl.SliceLayout(0, blk)), gl.maximum(gl.sqrt_rn(ss), eps))

    @gluon.jit
    def _silu(y):
        # y * sigmoid(y) = h + h * tanh(h), h = y / 2: one MUFU op per element where exp and a division take two
        # (the same error against fp32 as the exp form).
        h = 0.5 * y
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=gl.float32, is_pure=True, pack=1)
        return h + h * t

    @gluon.jit
    def _activator(x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar, gs_ptr, g_ptr, nc_ptr, eps, pid,
                   nprog, my_tiles, tiles_per_img, HW, T: gl.constexpr, C: gl.constexpr, HAS_CACHE: gl.constexpr,
                   NSLOT: gl.constexpr):
        # 8 warps: RMS norm + SiLU of each feature frame, written back in place (the reference's two bf16
        # roundings); cached frames pass through. Signals each chunk on `act`.
        KC: gl.constexpr = C // 64
        S0: gl.constexpr = 0 if HAS_CACHE else 2
        QT = (T + 2 - S0) * KC
        # [64 channels, 64 pixels] chunk: a thread holds 8 consecutive pixels (16-byte shared loads), a warp 32
        # channels, so the per-pixel channel sum stays inside each warp.
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, gl.num_warps()], [1, 0])
        ch = gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
        for i in range(my_tiles):
            tile = pid + i * nprog
            if not HAS_CACHE:
                if T == 1:
                    _store_zero_frame(nc_ptr, tile // tiles_per_img, (tile % tiles_per_img) * 64, HW, C, blk)
            for s in range(S0, T + 2):
                qf = i * QT + (s - S0) * KC
                if s >= 2:
                    inv = _inv_norm(slots, ready, qf, eps, KC, NSLOT, blk)
                    for kc in gl.static_range(KC):
                        q = qf + kc
                        view = slots.index(q % NSLOT).reshape([64, 64])
                        gs = gl.load(gs_ptr + kc * 64 + ch)
                        y = (view.load(blk).to(gl.float32) * inv[None, :] * gs[:, None]).to(gl.bfloat16)
                        view.store(_silu(y.to(gl.float32)).to(gl.bfloat16))
                        fence_async_shared()  # the MMA partition's TMA store reads it through the async proxy
                        gl.thread_barrier()  # every warp's part is written (arrive is one thread's)
                        mbarrier.arrive(act.index(q % NSLOT), count=1)
                else:
                    for kc in gl.static_range(KC):
                        q = qf + kc
                        mbarrier.wait(ready.index(q % NSLOT), (q // NSLOT) & 1)
                        mbarrier.arrive(act.index(q % NSLOT), count=1)

    @gluon.jit
    def _mma(a, w_smem, idx: gl.constexpr, acc, WIDE: gl.constexpr):
        # acc += a @ W[idx] for this warpgroup's column pieces of g: 64 + 32 for the wide one, the last 16 for the
        # narrow one (tensor shapes are powers of two). The weight index goes through an opaque zero: with constant
        # indices the compiler hoisted all the wgmma descriptors (64-bit each) out of the loops and spilled them.
        i = idx + gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if WIDE:
            a0 = warpgroup_mma(a, w_smem[0].index(i).permute((1, 0)), acc[0], is_async=True)
            a1 = warpgroup_mma(gl.convert_layout(a, gl.DotOperandLayout(0, acc[1].type.layout, 2),
                                                 assert_trivial=True),
                               w_smem[1].index(i).permute((1, 0)), acc[1], is_async=True)
            out = (a0, a1)
        else:
            out = (warpgroup_mma(a, w_smem[2].index(i).permute((1, 0)), acc[0], is_async=True),)
        return out

    @gluon.jit
    def _drain(p, q, r, a, WIDE: gl.constexpr):
        # Wait for every MMA in flight; `a` (their register operand) stays allocated until then.
        if WIDE:
            d = warpgroup_mma_wait(0, deps=[p[0], p[1], q[0], q[1], r[0], r[1], a])
            out = (d[0], d[1]), (d[2], d[3]), (d[4], d[5])
        else:
            d = warpgroup_mma_wait(0, deps=[p[0], q[0], r[0], a])
            out = (d[0],), (d[1],), (d[2],)
        return out

    @gluon.jit
    def _store_g_part(part, n0: gl.constexpr, base, n_px):
        # A scalar 64-bit base and int32 offsets: per-element 64-bit addresses for every frame cost ~200 registers.
        lay: gl.constexpr = part.type.layout
        px = gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
        n = n0 + gl.arange(0, part.shape[1], layout=gl.SliceLayout(0, lay))
        gl.store(base + (px[:, None] * _G + n[None, :]), part.to(gl.bfloat16), mask=(px < n_px)[:, None])

    @gluon.jit
    def _store_g(acc, g_ptr, img, o, p0, HW, T, WIDE: gl.constexpr):
        # g[img, o, pixels p0.., this warpgroup's columns] (dense [B, T, H*W, 112])
        base = g_ptr + ((img * T + o).to(gl.int64) * HW + p0) * _G
        if WIDE:
            _store_g_part(acc[0], 0, base, HW - p0)
            _store_g_part(acc[1], 64, base, HW - p0)
        else:
            _store_g_part(acc[0], 96, base, HW - p0)

    @gluon.jit
    def _store_zero_frame(nc_ptr, img, p0, HW, C: gl.constexpr, blk: gl.constexpr):
        # First chunk with T = 1 and no cache: the new cache's first frame is a causal zero frame.
        px = p0 + gl.arange(0, 64, layout=gl.SliceLayout(0, blk))
        for kc in gl.static_range(C // 64):
            ch = kc * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, blk))
            offs = ((img * C + ch) * 2).to(gl.int64)[:, None] * HW + px[None, :]
            gl.store(nc_ptr + offs, gl.zeros([64, 64], gl.bfloat16, blk), mask=(px < HW)[None, :])

    @gluon.jit
    def _mma_frame(slots, act, free, w_smem, nc_desc, qf, img, p0, acc_p, acc_q, acc_r, s: gl.constexpr,
                   T: gl.constexpr, KC: gl.constexpr, NSLOT: gl.constexpr, WIDE: gl.constexpr):
        # Window frame s into output frames s-2 (acc_p, tap 2), s-1 (acc_q, tap 1) and s (acc_r, tap 0), for the
        # output frames that exist; frames s >= T are also the new cache's frame s - T. Returns the accumulators
        # drained.
        dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_p[0].type.layout, k_width=2)
        a = gl.zeros([64, 64], gl.bfloat16, dot_a)
        for kc in gl.static_range(KC):
            q = qf + kc
            slot = slots.index(q % NSLOT)
            mbarrier.wait(act.index(q % NSLOT), (q // NSLOT) & 1)
            a_next = slot.reshape([64, 64]).permute((1, 0)).load(dot_a)  # [pixels, channels]
            if WIDE and s >= T:
                tma.async_copy_shared_to_global(nc_desc, [img, kc * 64, s - T, p0], slot)
            acc_p, acc_q, acc_r = _drain(acc_p, acc_q, acc_r, a, WIDE)  # the previous chunk's MMAs
            a = a_next
            if s >= 2:
                acc_p = _mma(a, w_smem, 2 * KC + kc, acc_p, WIDE)
            if (s >= 1) & (s <= T):
                acc_q = _mma(a, w_smem, KC + kc, acc_q, WIDE)
            if s < T:
                acc_r = _mma(a, w_smem, kc, acc_r, WIDE)
            if WIDE and s >= T:
                tma.store_wait(0)  # the store has read the slot
            fence_async_shared()  # our shared loads before the loader's next TMA write
            gl.thread_barrier()
            mbarrier.arrive(free.index(q % NSLOT), count=1)
        return _drain(acc_p, acc_q, acc_r, a, WIDE)

    @gluon.jit
    def _narrow_mma(x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar, gs_ptr, g_ptr, nc_ptr, eps, pid,
                    nprog, my_tiles, tiles_per_img, HW, T: gl.constexpr, C: gl.constexpr, HAS_CACHE: gl.constexpr,
                    NSLOT: gl.constexpr):
        # A worker warpgroup for g's last 16 columns, beside the default partition's 64 + 32.
        _mma_partition(slots, act, free, w_smem, w_bar, nc_desc, g_ptr, pid, nprog, my_tiles, tiles_per_img, HW,
                       T, C, HAS_CACHE, NSLOT, False)

    @gluon.jit
    def _mma_partition(slots, act, free, w_smem, w_bar, nc_desc, g_ptr, pid, nprog, my_tiles, tiles_per_img, HW,
                       T: gl.constexpr, C: gl.constexpr, HAS_CACHE: gl.constexpr, NSLOT: gl.constexpr,
                       WIDE: gl.constexpr):
        # The default partition (one warpgroup): the GEMM and the g stores. It holds three output frames'
        # accumulators, [64, 112] fp32 each (168 registers per thread). The frames are unrolled (T is a compile-time
        # constant) so the accumulators change roles by renaming: register copies of an accumulator make ptxas
        # serialise every wgmma (C7514).
        KC: gl.constexpr = C // 64
        S0: gl.constexpr = 0 if HAS_CACHE else 2
        QT: gl.constexpr = (T + 2 - S0) * KC
        mma64: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        mma32: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
        mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        mbarrier.wait(w_bar, 0)
        for i in range(my_tiles):
            tile = pid + i * nprog
            img = tile // tiles_per_img
            p0 = (tile % tiles_per_img) * 64
            if WIDE:
                zero = (gl.zeros([64, 64], gl.float32, mma64), gl.zeros([64, 32], gl.float32, mma32))
            else:
                zero = (gl.zeros([64, 16], gl.float32, mma16),)
            # acc_p: output s-2 (tap 2, complete after frame s); acc_q: output s-1; acc_r: output s (tap 0)
            acc_p = zero
            acc_q = zero
            acc_r = zero
            for s in gl.static_range(S0, T + 2):
                acc_p, acc_q, acc_r = _mma_frame(slots, act, free, w_smem, nc_desc, i * QT + (s - S0) * KC, img, p0,
                                                 acc_p, acc_q, acc_r, s, T, KC, NSLOT, WIDE)
                if s >= 2:
                    _store_g(acc_p, g_ptr, img, s - 2, p0, HW, T, WIDE)
                acc_p = acc_q
                acc_q = acc_r
                acc_r = zero

    @gluon.jit
    def head_g_kernel(x_desc, c_desc, nc_desc, w64_desc, w32_desc, w16_desc, gs_ptr, g_ptr, nc_ptr,
                       HW, n_tiles, tiles_per_img, eps,
                       T: gl.constexpr, C: gl.constexpr, HAS_CACHE: gl.constexpr, NSLOT: gl.constexpr):
        KC: gl.constexpr = C // 64
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        my_tiles = (n_tiles - pid + nprog - 1) // nprog

        slots = gl.allocate_shared_memory(gl.bfloat16, [NSLOT, 1, 64, 1, 64], x_desc.layout)
        w_smem = (gl.allocate_shared_memory(gl.bfloat16, [3 * KC, 64, 64], w64_desc.layout),
                  gl.allocate_shared_memory(gl.bfloat16, [3 * KC, 32, 64], w32_desc.layout),
                  gl.allocate_shared_memory(gl.bfloat16, [3 * KC, 16, 64], w16_desc.layout))
        ready = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())  # TMA -> activator
        act = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())  # activator -> MMA
        free = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())  # MMA -> loader
        w_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSLOT):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(act.index(i), count=1)
            mbarrier.init(free.index(i), count=2)  # both MMA warpgroups
        mbarrier.init(w_bar.index(0), count=1)
        mbarrier.expect(w_bar.index(0), 3 * KC * _G * 64 * 2)
        for i in gl.static_range(3 * KC):  # box i: tap i // KC, channels (i % KC) * 64 ..; rows n0 .. of W^T[tap]
            tma.async_copy_global_to_shared(w64_desc, [(i // KC) * _G, (i % KC) * 64], w_bar.index(0),
                                            w_smem[0].index(i))
            tma.async_copy_global_to_shared(w32_desc, [(i // KC) * _G + 64, (i % KC) * 64], w_bar.index(0),
                                            w_smem[1].index(i))
            tma.async_copy_global_to_shared(w16_desc, [(i // KC) * _G + 96, (i % KC) * 64], w_bar.index(0),
                                            w_smem[2].index(i))
        gl.warp_specialize([
            (_mma_partition, (slots, act, free, w_smem, w_bar.index(0), nc_desc, g_ptr, pid, nprog, my_tiles,
                              tiles_per_img, HW, T, C, HAS_CACHE, NSLOT, True)),
            (_narrow_mma, (x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar.index(0), gs_ptr, g_ptr,
                           nc_ptr, eps, pid, nprog, my_tiles, tiles_per_img, HW, T, C, HAS_CACHE, NSLOT)),
            (_loader, (x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar.index(0), gs_ptr, g_ptr,
                       nc_ptr, eps, pid, nprog, my_tiles, tiles_per_img, HW, T, C, HAS_CACHE, NSLOT)),
            (_activator, (x_desc, c_desc, nc_desc, slots, ready, act, free, w_smem, w_bar.index(0), gs_ptr, g_ptr,
                          nc_ptr, eps, pid, nprog, my_tiles, tiles_per_img, HW, T, C, HAS_CACHE, NSLOT)),
        ], [4, 1, 8], [NARROW_REGS, 24, ACT_REGS])
