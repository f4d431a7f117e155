// The fused head's g kernel for Hopper (sm_90a): RMS norm + SiLU of the raw features, then the causal temporal GEMM
// into g's 112 spatial-tap channels (head_stencil does the rest); the new cache leaves from the same registers.
// The contract of kernels/head_wgmma.py's Gluon kernel, laid out differently:
//
//   * Each 64-pixel tile of a frame arrives as CHUNKS TMA boxes [64 channels][64 pixels] (128-byte swizzled) in a ring
//     of SLOTS slots; each box is read once into registers (ldmatrix.trans, straight into the wgmma A-fragment layout)
//     and its slot is freed at once. Shared memory is nearly full of the resident weights (W^T_OUT, 168 KB at C = 256),
//     so the ring is shallow (7 slots); registers, not slots, hold a frame while it is normalised, activated and
//     multiplied, and the loads keep flowing.
//   * The activation happens in the MMA warpgroups, in registers (wgmma with A from registers): the activated
//     frame never goes back to shared memory (the Gluon kernel's activation warps write it back, and its MMA
//     warpgroups read it again).
//   * Two consumer warpgroups share every tile: each activates the whole frame (duplicated: cheap next to the
//     bytes) and multiplies it by its own 56 of g's 112 columns (m64n56k16). With all 112 columns, one warpgroup's
//     accumulators and frame would need ~250 registers (ptxas spilled and serialised the wgmmas).
//
// 384 threads: warpgroup 0's thread 0 issues the TMA loads; warpgroups 1 and 2 consume. Per tile a consumer walks
// the window frames s (cached frames 0 and 1, then feature frame s - 2); frame s feeds output frames s-2, s-1 and s
// (taps 2, 1, 0) in three fp32 accumulators [64 px][56]; output s-2 is complete after frame s and leaves as bf16 g.
// Frames s >= T_OUT are also the new cache's frame s - T_OUT, stored from registers (each warpgroup half the channels).
//
// Defines (names that NVRTC's built-in headers do not use): CHUNKS = C / 64 (1..4), T_OUT (output frames),
// HAS_CACHE (0: the first chunk, window frames 0 and 1 are zeros and skipped; the caller zeroes the new cache's
// frame 0 when T_OUT = 1), SLOTS (ring slots).

#define G 112                      // g channels: 9 spatial taps x 12 outputs, padded
#define CHUNK_BYTES 8192           // one ring slot: 64 channels x 64 pixels of one frame
#define W_BOX_BYTES (G * 128)      // one weight box: 112 rows of W^T_OUT x 64 channels
#define W_BYTES (3 * CHUNKS * W_BOX_BYTES)
#define S0 (HAS_CACHE ? 0 : 2)

// acc (+)= A[64 px, 16 c] (registers) x B[16 c, 56] (shared memory, descriptor b_base + OFF). The offset is added
// inside the asm: as plain C++ the compiler hoisted all 48 descriptors (64-bit each) out of the tile loop and
// spilled them. mma_first overwrites d (write-only operands: d's old value is dead).
template <int OFF>
__device__ __forceinline__ void mma_first(float (&d)[28], const u32 (&a)[4], unsigned long long b_base) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 b;\n setp.ne.b32 p, %34, 0;\n add.s64 b, %32, %33;\n"
      "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, "
      "%7, %8, %9, %10, %11, %12, %13, "
      "%14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27"
      "}, {%28, %29, %30, %31}, b, p, 1, 1, 0;\n}"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
        "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
        "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]),
        "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_base), "n"(OFF), "r"(0));
}
template <int OFF>
__device__ __forceinline__ void mma_acc(float (&d)[28], const u32 (&a)[4], unsigned long long b_base) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 b;\n setp.ne.b32 p, %34, 0;\n add.s64 b, %32, %33;\n"
      "wgmma.mma_async.sync.aligned.m64n56k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, "
      "%7, %8, %9, %10, %11, %12, %13, "
      "%14, %15, %16, %17, %18, %19, %20, "
      "%21, %22, %23, %24, %25, %26, %27"
      "}, {%28, %29, %30, %31}, b, p, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_base), "n"(OFF), "r"(1));
}

struct Consumer {
  u32 ring, full, empty;      // the ring's slots and their barriers (8 bytes apart)
  unsigned long long w_desc;  // descriptor of this warpgroup's part of the first weight box
  int col0;                   // this warpgroup's first g column (0 or 56)
  int cache_chunk0, cache_chunk1;  // the chunks of the new cache this warpgroup stores
  u32 gs_base;
  u32 lane_off;           // this lane's ldmatrix row address inside a slot (before the k-step offset)
  int q;                  // chunks consumed so far
  u16 *g, *new_cache;
  int HW;
  float eps;
};

// f(Int<0>()), ..., f(Int<N-1>()): a loop whose index is a compile-time constant (template arguments).
template <int V> struct Int { static constexpr int value = V; };
template <int N, int I = 0, class F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < N) {
    f(Int<I>());
    static_for<N, I + 1>(f);
  }
}

__device__ __forceinline__ void ldmatrix_t(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ float lo_f(u32 v) { return u2f(v << 16); }
__device__ __forceinline__ float hi_f(u32 v) { return u2f(v & 0xFFFF0000u); }
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// bf16(silu(bf16(x * inv * gs))) for two channels of one pixel (the reference's two roundings); SiLU as
// h + h * tanh(h), h = y / 2: one MUFU op per element (as the Gluon kernel, BENCHMARKS.md run V1).
__device__ __forceinline__ u32 activate2(u32 x, float inv, float gs_lo, float gs_hi) {
  u32 y = pack_bf16(lo_f(x) * inv * gs_lo, hi_f(x) * inv * gs_hi);
  float h0 = 0.5f * lo_f(y), h1 = 0.5f * hi_f(y);
  return pack_bf16(fmaf(h0, tanh_approx(h0), h0), fmaf(h1, tanh_approx(h1), h1));
}

// The A fragments of one chunk: k-step ks (channels 16 ks .. + 15 of the chunk) in a[ks]. a[ks][0] holds pixel
// row gq of this warp's 16, channels 2 tq, 2 tq + 1; [1] row gq + 8; [2], [3] the same rows, channels + 8.
__device__ __forceinline__ void load_chunk(u32 (&a)[4][4], u32 slot, u32 lane_off) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) ldmatrix_t(a[ks], slot + ks * 2048 + lane_off);
}

// acc[(S - K) % 3] (+)= a x W_K (k-step ks of chunk kc), if output frame S - K exists.
template <int S, int K, int KC_, int KS>
__device__ __forceinline__ void tap_mma(const Consumer& c, float (&acc)[3][28], const u32 (&a)[4]) {
  constexpr int o = S - K;
  if (o >= 0 && o < T_OUT) {
    constexpr int OFF = ((K * CHUNKS + KC_) * W_BOX_BYTES + KS * 32) >> 4;  // descriptor units: 16 bytes
    if (S == (o > S0 ? o : S0) && KC_ == 0 && KS == 0) mma_first<OFF>(acc[o % 3], a, c.w_desc);
    else mma_acc<OFF>(acc[o % 3], a, c.w_desc);
  }
}

// Wait for every MMA in flight, tying the accumulators they write and the A registers they read to the wait:
// the former are read only after it, the latter not reused before it.
__device__ __forceinline__ void tie_chunk(u32 (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) asm volatile("" : "+r"(a[ks][0]), "+r"(a[ks][1]), "+r"(a[ks][2]), "+r"(a[ks][3])::"memory");
}
__device__ __forceinline__ void tie_a(u32 (&a)[CHUNKS][4][4]) {
#pragma unroll
  for (int kc = 0; kc < CHUNKS; ++kc) tie_chunk(a[kc]);
}
template <int S>
__device__ __forceinline__ void mma_wait_tie(float (&acc)[3][28], u32 (&a)[CHUNKS][4][4]) {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  static_for<3>([&](auto k) {  // the output frames this frame wrote: S - k
    constexpr int o = S - decltype(k)::value;
    if constexpr (o >= 0 && o < T_OUT) {
#pragma unroll
      for (int i = 0; i < 28; ++i) asm volatile("" : "+f"(acc[o % 3][i])::"memory");
    }
  });
  tie_a(a);
}

// New cache frame f ([B, C, 2, H*W] contiguous) from the activated registers: each holds one pixel's two channels.
__device__ __forceinline__ void store_cache(const Consumer& c, const u32 (&a)[CHUNKS][4][4], int img, int p0, int f) {
  const int tid = threadIdx.x % 128, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  int ch_stride = 2 * c.HW;  // one sample of the new cache is < 2^31 elements (checked by the launcher)
  // Opaque: computed from constants, the 64 addresses below are the same for every tile, and the compiler kept
  // them all in registers across the tile loop.
  asm volatile("" : "+r"(ch_stride));
  const int p_a = p0 + (tid / 32) * 16 + gq, p_b = p_a + 8;
  u16* base = c.new_cache + ((i64)img * CHUNKS * 64 * 2 + f) * c.HW + (i64)(2 * tq) * ch_stride;
#pragma unroll
  for (int kc = 0; kc < CHUNKS; ++kc) {
    if (kc < c.cache_chunk0 || kc >= c.cache_chunk1) continue;  // the other warpgroup's
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        int p = j % 2 ? p_b : p_a, ch = kc * 64 + ks * 16 + (j / 2) * 8;
        if (p < c.HW) {
          u16* dst = base + (ch * ch_stride + p);
          dst[0] = (u16)(a[kc][ks][j] & 0xFFFF);
          dst[ch_stride] = (u16)(a[kc][ks][j] >> 16);
        }
      }
  }
}

// Output frame o of this tile, complete: g[img, o, pixel, this warpgroup's 56 columns] bf16 (dense [B, T_OUT, H*W, 112]).
__device__ __forceinline__ void store_g(const Consumer& c, const float (&d)[28], int img, int p0, int o) {
  const int tid = threadIdx.x % 128, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  const int p_a = p0 + (tid / 32) * 16 + gq, p_b = p_a + 8;
  u16* frame_g = c.g + ((i64)img * T_OUT + o) * c.HW * G;
#pragma unroll
  for (int n8 = 0; n8 < G / 16; ++n8) {
    int col = c.col0 + n8 * 8 + 2 * tq;
    if (p_a < c.HW) *(u32*)(frame_g + (i64)p_a * G + col) = pack_bf16(d[4 * n8], d[4 * n8 + 1]);
    if (p_b < c.HW) *(u32*)(frame_g + (i64)p_b * G + col) = pack_bf16(d[4 * n8 + 2], d[4 * n8 + 3]);
  }
}

template <int S>
__device__ __forceinline__ void frame(const Consumer& c, float (&acc)[3][28], int img, int p0) {
  constexpr bool ACT = S >= 2;      // a feature frame (else a cached, already activated one)
  constexpr bool CACHE_OUT = S >= T_OUT;
  const int tq = threadIdx.x % 4;  // the lane's place in its quad: channels 2 tq, 2 tq + 1 (and + 8)
  u32 a[CHUNKS][4][4];
  float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
  for (int kc = 0; kc < CHUNKS; ++kc) {
    int q = c.q + kc, slot = q % SLOTS;
    mbar_wait(c.full + 8 * slot, (q / SLOTS) & 1);
    load_chunk(a[kc], c.ring + slot * CHUNK_BYTES, c.lane_off);
    mbar_arrive(c.empty + 8 * slot, 1);  // the slot is in registers: once both warpgroups say so, refill it
    if (ACT) {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float x0 = lo_f(a[kc][ks][j]), x1 = hi_f(a[kc][ks][j]);
          if (j % 2 == 0) ss0 = fmaf(x0, x0, fmaf(x1, x1, ss0));
          else ss1 = fmaf(x0, x0, fmaf(x1, x1, ss1));
        }
    }
  }
  if (ACT) {
    // Opaque: else the compiler keeps pass one's unpacked fp32 values (twice the registers) for the activation.
    tie_a(a);
    // The four lanes of a quad hold the same two pixels: sum their channels. F.normalize: x / max(||x||, eps).
#pragma unroll
    for (int m = 1; m <= 2; m *= 2) {
      ss0 += __shfl_xor_sync(0xFFFFFFFFu, ss0, m);
      ss1 += __shfl_xor_sync(0xFFFFFFFFu, ss1, m);
    }
    float inv0 = __fdiv_rn(1.f, fmaxf(__fsqrt_rn(ss0), c.eps)), inv1 = __fdiv_rn(1.f, fmaxf(__fsqrt_rn(ss1), c.eps));
#pragma unroll
    for (int kc = 0; kc < CHUNKS; ++kc)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        float2 g_lo, g_hi;  // scale * gamma of channels 2 tq, 2 tq + 1 and those + 8
        u32 ga = c.gs_base + 4 * (kc * 64 + ks * 16 + 2 * tq);
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(g_lo.x), "=f"(g_lo.y) : "r"(ga));
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(g_hi.x), "=f"(g_hi.y) : "r"(ga + 32));
        a[kc][ks][0] = activate2(a[kc][ks][0], inv0, g_lo.x, g_lo.y);
        a[kc][ks][1] = activate2(a[kc][ks][1], inv1, g_lo.x, g_lo.y);
        a[kc][ks][2] = activate2(a[kc][ks][2], inv0, g_hi.x, g_hi.y);
        a[kc][ks][3] = activate2(a[kc][ks][3], inv1, g_hi.x, g_hi.y);
      }
  }
  // Tap k of this frame feeds output frame S - k, held in acc[(S - k) % 3]; an output's first MMA (at frame
  // max(o, S0)) overwrites its accumulator.
  mma_fence();
  static_for<4 * CHUNKS>([&](auto i) {
    constexpr int KC_ = decltype(i)::value / 4, KS = decltype(i)::value % 4;
    tap_mma<S, 2, KC_, KS>(c, acc, a[KC_][KS]);
    tap_mma<S, 1, KC_, KS>(c, acc, a[KC_][KS]);
    tap_mma<S, 0, KC_, KS>(c, acc, a[KC_][KS]);
  });
  mma_commit();
  if (CACHE_OUT) store_cache(c, a, img, p0, S - T_OUT);
  mma_wait_tie<S>(acc, a);
  if (S >= 2) store_g(c, acc[(S - 2) % 3], img, p0, S - 2);
}

template <int S>
__device__ __forceinline__ void frames(Consumer& c, float (&acc)[3][28], int img, int p0) {
  if constexpr (S < T_OUT + 2) {
    frame<S>(c, acc, img, p0);
    c.q += CHUNKS;
    frames<S + 1>(c, acc, img, p0);
  }
}

extern "C" __global__ void __launch_bounds__(384, 1)
    head_g_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap c_map,
                const __grid_constant__ TmaMap w_map, const float* gs, u16* g, u16* new_cache, int HW, int n_tiles,
                int tiles_per_img, float eps) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  const u32 w_base = base, ring = base + W_BYTES, gs_base = ring + SLOTS * CHUNK_BYTES;
  const u32 full = gs_base + CHUNKS * 256, empty = full + 8 * SLOTS, w_bar = empty + 8 * SLOTS;
  const int pid = blockIdx.x, nprog = gridDim.x, my_tiles = (n_tiles - pid + nprog - 1) / nprog;
  for (int i = threadIdx.x; i < CHUNKS * 64; i += blockDim.x)
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(gs_base + 4 * i), "f"(gs[i]) : "memory");
  if (threadIdx.x == 0) {
    for (int i = 0; i < SLOTS; ++i) {
      mbar_init(full + 8 * i, 1);
      mbar_init(empty + 8 * i, 256);  // every thread of both consumers has read the slot
    }
    mbar_init(w_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(w_bar, W_BYTES);
    for (int i = 0; i < 3 * CHUNKS; ++i)  // box i: tap i / CHUNKS, channels (i % CHUNKS) * 64 ..
      tma_load_2d(w_base + i * W_BOX_BYTES, &w_map, w_bar, (i % CHUNKS) * 64, (i / CHUNKS) * G);
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {  // the producer: every chunk of every tile of this program, in order
      int q = 0;
      for (int i = 0; i < my_tiles; ++i) {
        int tile = pid + i * nprog, img = tile / tiles_per_img, p0 = (tile % tiles_per_img) * 64;
        for (int s = S0; s < T_OUT + 2; ++s)
          for (int kc = 0; kc < CHUNKS; ++kc, ++q) {
            int slot = q % SLOTS;
            mbar_wait(empty + 8 * slot, ((q / SLOTS) & 1) ^ 1);  // fresh barriers count as freed
            mbar_expect_tx(full + 8 * slot, CHUNK_BYTES);
            if (s < 2) tma_load_4d(ring + slot * CHUNK_BYTES, &c_map, full + 8 * slot, p0, s, kc * 64, img);
            else tma_load_4d(ring + slot * CHUNK_BYTES, &x_map, full + 8 * slot, p0, s - 2, kc * 64, img);
          }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int r = wg - 1, lane = threadIdx.x % 32, wl = (threadIdx.x / 32) % 4, j = lane / 8, row = lane % 8;
    Consumer c;
    c.ring = ring;
    c.full = full;
    c.empty = empty;
    c.w_desc = desc(w_base + r * (G / 2) * 128);  // this warpgroup's 56 rows of W^T_OUT
    c.col0 = r * (G / 2);
    c.cache_chunk0 = r * ((CHUNKS + 1) / 2);
    c.cache_chunk1 = r ? CHUNKS : (CHUNKS + 1) / 2;
    c.gs_base = gs_base;
    // ldmatrix.trans matrix j of a k-step: channels +8 for j >= 2, pixels +8 for odd j; row `row` of it is
    // channel row, its 16-byte pixel chunk swizzled by the channel (row) index mod 8.
    c.lane_off = ((j / 2) * 8 + row) * 128 + (((2 * wl + (j % 2)) ^ row) << 4);
    c.q = 0;
    c.g = g;
    c.new_cache = new_cache;
    c.HW = HW;
    c.eps = eps;
    mbar_wait(w_bar, 0);
    float acc[3][28];
    for (int i = 0; i < my_tiles; ++i) {
      int tile = pid + i * nprog;
      frames<S0>(c, acc, tile / tiles_per_img, (tile % tiles_per_img) * 64);
    }
  }
}
