// The fused head's g kernel for Hopper (sm_90a): RMS norm + SiLU of the raw features, then the causal temporal GEMM
// into g's 112 spatial-tap channels (head_stencil does the rest), and the new cache. The contract of
// kernels/gluon_fused.py's Gluon kernel; the difference is the MMA: one m64n112k16 wgmma per tap and k-step with both
// operands in shared memory (Gluon's power-of-two shapes cut g's 112 columns into 64 + 32 + 16 wgmmas, with the
// activated frame loaded into registers for each).
//
// A persistent program per SM walks 64-pixel tiles. The weights W^T [3 taps][112][C] stay in shared memory (168 KB
// at C = 256, K-major, 128-byte swizzled as the TMA writes them). Every window frame of a tile (the 2 cached frames,
// then the T feature frames) streams through shared memory in chunks, one TMA box [64 channels][64 pixels] each,
// through two rings of 8 KB slots: SLOTS - ACT_SLOTS raw slots (TMA loads) and ACT_SLOTS activated ones (the MMAs'
// operands). The activated box is the wgmma A operand as it lies: pixel-major ("MN-major", transposed), so nothing is
// reshuffled. 512 threads in four warpgroups, handing slots on through full/empty mbarriers:
//   * warpgroup 0, thread 0: the producer (TMA loads into free raw slots);
//   * warpgroups 1-2 (8 warps): RMS norm + SiLU of each feature frame (the reference's two bf16 roundings); a warp
//     owns 8 pixels, a lane 2 channels of each chunk, so a pixel's sum of squares is in-thread plus one
//     reduce-scatter across the warp per frame. The norm needs the whole frame: the warps hold it in registers and
//     free each raw slot as soon as it is read, then write the activated chunks into the other ring. (One ring,
//     activated in place, kept each slot from its load through the frame's last chunk and the MMAs: 0.45 vs 0.41 ms
//     on an H200);
//   * warpgroup 3: the MMAs, from the activated ring. Window frame s feeds output frames s-2, s-1, s (taps 2, 1,
//     0) in three fp32 accumulators [64 px][112] (168 registers); output s-2 is complete after frame s and leaves
//     as bf16 g. The frames go in a 3-frame loop body, so the accumulators rotate by renaming and the code stays
//     small (a form that unrolled every frame, a 740 KB cubin at T=4, missed the instruction cache).
//     Frames s >= T_OUT also leave, from their activated slot, as the new cache (TMA stores).
//
// On an H200 at the Wan chunk (T=4 + 2 cached, 352x640) it takes 0.41 ms against the Gluon kernel's 0.66; the MMA
// warpgroup sets the pace (kernels/cuda_fused.py says why; docs/lab-notes.md records the forms that were slower).
//
// Defines (names NVRTC's built-in headers do not use): CHUNKS = C / 64 (1..4), SLOTS (slots in all), ACT_SLOTS
// (activated slots, >= 2: the MMAs hold one chunk's slot while the next one's MMAs are issued). T_OUT and
// whether a cache exists are arguments (S0 = 0 with a cache, else 2: window frames 0 and 1 are zeros and skipped; the
// caller zeroes the new cache's frame 0 when T_OUT = 1).

#define G 112                    // g channels: 9 spatial taps x 12 outputs, padded
#define CHUNK_BYTES 8192         // one slot: 64 channels x 64 pixels of one frame
#define W_BOX_BYTES (G * 128)    // one weight box: 112 rows of W^T_k x 64 channels
#define W_BYTES (3 * CHUNKS * W_BOX_BYTES)
#define ACT_WARPS 8

// d (+)= A[64 px, 16 c] x B[16 c, 112]: A from an activated slot (pixel-major, transposed), B from the weights
// (K-major).
// accumulate = 0 overwrites d.
__device__ __forceinline__ void mma(float (&d)[56], unsigned long long a, unsigned long long b, u32 accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %58, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n112k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55}, "
      "%56, %57, p, 1, 1, 1, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <int N>
__device__ __forceinline__ void mma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

#define RAW_SLOTS (SLOTS - ACT_SLOTS)

// N slots of one chunk each, at slots + i * CHUNK_BYTES, with a full and an empty barrier each (8 bytes apart).
template <int N>
struct Ring {
  u32 slots, full, empty;
  __device__ u32 slot(u32 q) const { return slots + (q % N) * CHUNK_BYTES; }
  __device__ u32 full_bar(u32 q) const { return full + 8 * (q % N); }
  __device__ u32 empty_bar(u32 q) const { return empty + 8 * (q % N); }
  __device__ u32 parity(u32 q) const { return (q / N) & 1; }
};
using RawRing = Ring<RAW_SLOTS>;  // TMA loads -> the activation warps' registers
using ActRing = Ring<ACT_SLOTS>;  // activated chunks -> the MMAs (and the new cache's TMA stores)

struct Tiles {  // this program's tiles: pid, pid + nprog, ...
  int pid, nprog, count, per_img;
  __device__ int img(int i) const { return (pid + i * nprog) / per_img; }
  __device__ int p0(int i) const { return ((pid + i * nprog) % per_img) * 64; }
};

// ---- producer -------------------------------------------------------------------------------------------------

__device__ void produce(const RawRing& ring, const Tiles& tiles, const TmaMap* x_map, const TmaMap* c_map, int t_out,
                        int s0) {
  u32 q = 0;
  for (int i = 0; i < tiles.count; ++i)
    for (int s = s0; s < t_out + 2; ++s)
      for (int kc = 0; kc < CHUNKS; ++kc, ++q) {
        mbar_wait(ring.empty_bar(q), ring.parity(q) ^ 1);  // fresh barriers count as freed
        u32 full = ring.full_bar(q);
        mbar_expect_tx(full, CHUNK_BYTES);
        if (s < 2) tma_load_4d(ring.slot(q), c_map, full, tiles.p0(i), s, kc * 64, tiles.img(i));
        else tma_load_4d(ring.slot(q), x_map, full, tiles.p0(i), s - 2, kc * 64, tiles.img(i));
      }
}

// ---- activation -----------------------------------------------------------------------------------------------

__device__ __forceinline__ float lo_f(u32 v) { return u2f(v << 16); }
__device__ __forceinline__ float hi_f(u32 v) { return u2f(v & 0xFFFF0000u); }
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_v4(u32 addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// Two pixels of one channel: bf16(silu(bf16(x * inv * gs))) with half_gs = gs / 2. SiLU as h + h * tanh(h), h =
// y / 2 (one MUFU op per element instead of two); h = bf16(x * inv * half_gs) is exactly bf16(y) / 2.
__device__ __forceinline__ u32 activate2(u32 x, float inv_lo, float inv_hi, float half_gs) {
  u32 h = pack_bf16x2(lo_f(x) * inv_lo * half_gs, hi_f(x) * inv_hi * half_gs);
  float h0 = lo_f(h), h1 = hi_f(h);
  return pack_bf16x2(fmaf(h0, tanh_approx(h0), h0), fmaf(h1, tanh_approx(h1), h1));
}

// ss[p]: this lane's partial sum of squares of pixel p (0..7); returns the warp's total of pixel 4 b0 + 2 b1 + b2,
// where b0, b1, b2 are the lane's bits 0, 1, 2 (owner_lane(p) is a lane holding pixel p's total). A reduce-scatter:
// each of the first three shuffle rounds sends half of the lane's remaining pixels to the partner and keeps the other
// half (4 + 2 + 1 shuffles), then two rounds add the last partial sums: 9 shuffles, not 40.
__device__ __forceinline__ int owner_lane(int p) { return ((p >> 2) & 1) | (((p >> 1) & 1) << 1) | ((p & 1) << 2); }
__device__ __forceinline__ float pixel_sum_of_squares(const float (&ss)[8], int lane) {
  float r4[4], r2[2];
  const bool b0 = lane & 1, b1 = lane & 2, b2 = lane & 4;
#pragma unroll
  for (int j = 0; j < 4; ++j)  // bit 0 of the lane picks pixels 4..7 (set) or 0..3
    r4[j] = (b0 ? ss[j + 4] : ss[j]) + __shfl_xor_sync(0xFFFFFFFFu, b0 ? ss[j] : ss[j + 4], 1);
#pragma unroll
  for (int j = 0; j < 2; ++j)  // bit 1: the upper or lower pair of those
    r2[j] = (b1 ? r4[j + 2] : r4[j]) + __shfl_xor_sync(0xFFFFFFFFu, b1 ? r4[j] : r4[j + 2], 2);
  float r = (b2 ? r2[1] : r2[0]) + __shfl_xor_sync(0xFFFFFFFFu, b2 ? r2[0] : r2[1], 4);  // bit 2: one pixel
  r += __shfl_xor_sync(0xFFFFFFFFu, r, 8);
  return r + __shfl_xor_sync(0xFFFFFFFFu, r, 16);
}

// Warp w of the activators owns pixels 8w .. 8w + 7 of the tile (one 16-byte unit of each 128-byte channel row);
// lane l owns rows (channels) l and l + 32 of every chunk. The TMA's 128-byte swizzle puts unit u of row r at
// u ^ (r % 8): eight lanes read eight rows without bank conflicts.
__device__ void activate(const RawRing& raw, const ActRing& act, const Tiles& tiles, const float* gs, float eps,
                         int t_out, int s0) {
  const int warp = (threadIdx.x / 32) % ACT_WARPS, lane = threadIdx.x % 32;
  float half_gs[CHUNKS][2];
#pragma unroll
  for (int kc = 0; kc < CHUNKS; ++kc)
#pragma unroll
    for (int h = 0; h < 2; ++h) half_gs[kc][h] = 0.5f * gs[kc * 64 + lane + 32 * h];
  u32 offs[2];  // this lane's two rows, inside a slot
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int row = lane + 32 * h;
    offs[h] = row * 128 + ((warp ^ (row % 8)) << 4);
  }
  u32 q = 0;
  for (int i = 0; i < tiles.count; ++i)
    for (int s = s0; s < t_out + 2; ++s, q += CHUNKS) {
      const bool cached = s < 2;  // a cached frame, already activated: copied on as it is
      uint4 x[CHUNKS][2];
      float ss[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kc = 0; kc < CHUNKS; ++kc) {
        // Every lane waits: a parity wait is only right for a waiter at most one phase behind.
        mbar_wait(raw.full_bar(q + kc), raw.parity(q + kc));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          x[kc][h] = ld_shared_v4(raw.slot(q + kc) + offs[h]);
          const u32 w[4] = {x[kc][h].x, x[kc][h].y, x[kc][h].z, x[kc][h].w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            ss[2 * j] = fmaf(lo_f(w[j]), lo_f(w[j]), ss[2 * j]);
            ss[2 * j + 1] = fmaf(hi_f(w[j]), hi_f(w[j]), ss[2 * j + 1]);
          }
        }
        // The chunk is in registers: its slot can take the next load. The arrive does not wait for the lane's
        // shared loads to return; the fence does (without it the next TMA load sometimes overwrote a slot that a
        // warp was still reading: 1-13 runs in 20 differed).
        asm volatile("fence.acq_rel.cta;" ::: "memory");
        __syncwarp();
        if (lane == 0) mbar_arrive(raw.empty_bar(q + kc), 1);
      }
      float inv[8];
      if (!cached) {
        // F.normalize: x / max(||x||, eps), as x * (1 / max(...)) like the Gluon kernel.
        const float mine = __fdiv_rn(1.f, fmaxf(__fsqrt_rn(pixel_sum_of_squares(ss, lane)), eps));
#pragma unroll
        for (int p = 0; p < 8; ++p) inv[p] = __shfl_sync(0xFFFFFFFFu, mine, owner_lane(p));
      }
#pragma unroll
      for (int kc = 0; kc < CHUNKS; ++kc) {
        mbar_wait(act.empty_bar(q + kc), act.parity(q + kc) ^ 1);  // fresh barriers count as freed
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint4 v = x[kc][h];
          if (!cached) {
            v.x = activate2(v.x, inv[0], inv[1], half_gs[kc][h]);
            v.y = activate2(v.y, inv[2], inv[3], half_gs[kc][h]);
            v.z = activate2(v.z, inv[4], inv[5], half_gs[kc][h]);
            v.w = activate2(v.w, inv[6], inv[7], half_gs[kc][h]);
          }
          st_shared_v4(act.slot(q + kc) + offs[h], v);
        }
        fence_async_shared();  // the wgmmas and the cache's TMA store read the slot through the async proxy
        __syncwarp();
        if (lane == 0) mbar_arrive(act.full_bar(q + kc), 1);
      }
    }
}

// ---- MMAs -----------------------------------------------------------------------------------------------------

struct Mma {
  ActRing ring;
  unsigned long long a0, w0;  // descriptors of slot 0 and of the first weight box
  u16* g;
  const TmaMap* nc_map;
  int HW, t_out, s0;
  u32 q;           // chunks consumed so far
  int pending;     // the chunk whose slot is still to be freed (its MMAs may be in flight), or -1
  bool pending_store;  // ... and whether the new cache's TMA store reads it
};

// The slot of m.pending is no longer read: free it. Every MMA thread arrives (and waits for the TMA store, a no-op
// where it issued none): an elected thread's branch here made ptxas serialise every wgmma (C7520).
__device__ __forceinline__ void release(Mma& m) {
  if (m.pending < 0) return;
  if (m.pending_store) tma_store_wait_read();
  mbar_arrive(m.ring.empty_bar(m.pending), 1);
  m.pending = -1;
}

// Output frame o of tile (img, p0), complete: g[img, o, pixel, 0..111] bf16 (dense [B, T_OUT, H*W, 112]). The lane
// holds pixels row and row + 8 of its warp's 16, columns 8 j + 2 (lane % 4) + {0, 1}. Lanes 2i and 2i + 1 swap one
// 4-byte pair per two column blocks, so each stores 8 bytes and a warp's store fills whole 32-byte sectors: 4-byte
// stores (half sectors, twice the instructions) took 0.50 ms per Wan chunk against 0.45-0.46 with 8-byte ones.
__device__ __forceinline__ void store_g(const Mma& m, const float (&d)[56], int img, int p0, int o) {
  const int tid = threadIdx.x % 128, lane = tid % 32;
  const int p_a = p0 + (tid / 32) * 16 + lane / 4, p_b = p_a + 8;
  const bool odd = lane & 1;
  // The even lane stores columns 8 j + 2 (lane % 4) + 0..3; the odd one 8 (j + 1) + 2 (lane % 4 - 1) + 0..3.
  u16* frame_g = m.g + ((i64)img * m.t_out + o) * m.HW * G + (odd ? 8 + 2 * (lane % 4 - 1) : 2 * (lane % 4));
  u32 v[G / 4];  // packed where every lane runs: reading wgmma results on a divergent path serialises the wgmmas
#pragma unroll
  for (int j = 0; j < G / 4; ++j) {
    v[j] = pack_bf16x2(d[2 * j], d[2 * j + 1]);
    asm volatile("" : "+r"(v[j]));
  }
  uint2 w[G / 8];  // w[j + r]: row r's (0: p_a, 1: p_b) 8 bytes of column blocks j, j + 1 (j even)
#pragma unroll
  for (int j = 0; j < G / 8; j += 2)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u32 mine = v[2 * j + r], next = v[2 * j + 2 + r];  // blocks j and j + 1 of row r
      const u32 got = __shfl_xor_sync(0xFFFFFFFFu, odd ? mine : next, 1);
      w[j + r] = odd ? make_uint2(got, next) : make_uint2(mine, got);
    }
#pragma unroll
  for (int j = 0; j < G / 8; j += 2) {
    if (p_a < m.HW) *(uint2*)(frame_g + (i64)p_a * G + 8 * j) = w[j];
    if (p_b < m.HW) *(uint2*)(frame_g + (i64)p_b * G + 8 * j) = w[j + 1];
  }
}

// Tap K of window frame s feeds output o = s - K (if it exists) through acc[(R - K) % 3]; its first MMA (at frame
// max(o, S0), chunk 0, k-step 0) overwrites the accumulator. Taps of outputs that do not exist are skipped by one
// warp-uniform branch around their four wgmmas: a predicate on each wgmma (the previous form) made ptxas put a
// branch, a warpgroup.arrive and a scoreboard group around every one of them. (Code that reads the accumulators or
// branches per thread between wgmmas made ptxas serialise them all, C7520: hence store_g packing before its
// branches.)
template <int R, int K>
__device__ __forceinline__ void tap(const Mma& m, float (&acc)[3][56], int s, int kc, unsigned long long a) {
  const int o = s - K;
  const bool run = o >= 0 && o < m.t_out;
  const u32 first = (s == (o > m.s0 ? o : m.s0)) && kc == 0;
  const unsigned long long w = m.w0 + (((K * CHUNKS + kc) * W_BOX_BYTES) >> 4);
  if (!run) return;
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)  // k-step: 16 channels, 2048 bytes down the slot, 32 bytes along a weight row
    mma(acc[(R - K + 3) % 3], a + ((ks * 2048) >> 4), w + ((ks * 32) >> 4), !(first && ks == 0));
}

template <int R>
__device__ __forceinline__ void mma_frame(Mma& m, float (&acc)[3][56], int s, int img, int p0) {
  for (int kc = 0; kc < CHUNKS; ++kc, ++m.q) {
    const u32 q = m.q;
    mbar_wait(m.ring.full_bar(q), m.ring.parity(q));
    const bool store = s >= m.t_out;  // window frames T_OUT, T_OUT + 1: the new cache's frames 0, 1
    if (store && threadIdx.x % 128 == 0) tma_store_4d(m.nc_map, m.ring.slot(q), p0, s - m.t_out, kc * 64, img);
    const unsigned long long a = m.a0 + (((q % ACT_SLOTS) * CHUNK_BYTES) >> 4);
    mma_fence();
    tap<R, 2>(m, acc, s, kc, a);
    tap<R, 1>(m, acc, s, kc, a);
    tap<R, 0>(m, acc, s, kc, a);
    mma_commit();
    mma_wait<1>();  // the previous chunk's MMAs are done: its slot can go
    release(m);
    m.pending = (int)q;
    m.pending_store = store;
  }
  if (s >= 2) {  // output s - 2 is complete
    mma_wait<0>();
    release(m);
    store_g(m, acc[(R + 1) % 3], img, p0, s - 2);
  }
}

__device__ void multiply(Mma& m, const Tiles& tiles) {
  float acc[3][56];
  for (int i = 0; i < tiles.count; ++i) {
    const int img = tiles.img(i), p0 = tiles.p0(i);
    for (int s = m.s0; s < m.t_out + 2; s += 3) {  // output o lives in acc[(o - S0) % 3]
      mma_frame<0>(m, acc, s, img, p0);
      if (s + 1 < m.t_out + 2) mma_frame<1>(m, acc, s + 1, img, p0);
      if (s + 2 < m.t_out + 2) mma_frame<2>(m, acc, s + 2, img, p0);
    }
  }
  mma_wait<0>();
  release(m);
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the new cache's stores are complete
}

extern "C" __global__ void __launch_bounds__(512, 1)
    head_g_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap c_map,
                const __grid_constant__ TmaMap w_map, const __grid_constant__ TmaMap nc_map, const float* gs, u16* g,
                int HW, int n_tiles, int tiles_per_img, int t_out, int has_cache, float eps) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  const u32 w_base = base, slots = base + W_BYTES, bars = slots + SLOTS * CHUNK_BYTES;
  const RawRing raw{slots, bars, bars + 8 * RAW_SLOTS};
  const ActRing act{slots + RAW_SLOTS * CHUNK_BYTES, bars + 16 * RAW_SLOTS, bars + 16 * RAW_SLOTS + 8 * ACT_SLOTS};
  const u32 w_bar = bars + 24 * SLOTS;
  const int pid = blockIdx.x, nprog = gridDim.x;
  const Tiles tiles{pid, nprog, (n_tiles - pid + nprog - 1) / nprog, tiles_per_img};
  const int s0 = has_cache ? 0 : 2;
  if (threadIdx.x == 0) {
    for (int i = 0; i < RAW_SLOTS; ++i) {
      mbar_init(raw.full + 8 * i, 1);
      mbar_init(raw.empty + 8 * i, ACT_WARPS);
    }
    for (int i = 0; i < ACT_SLOTS; ++i) {
      mbar_init(act.full + 8 * i, ACT_WARPS);
      mbar_init(act.empty + 8 * i, 128);  // every MMA thread
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
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
    if (threadIdx.x == 0) produce(raw, tiles, &x_map, &c_map, t_out, s0);
  } else if (wg <= 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 120;");
    activate(raw, act, tiles, gs, eps, t_out, s0);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    Mma m{act, desc(act.slots), desc(w_base), g, &nc_map, HW, t_out, s0, 0u, -1, false};
    mbar_wait(w_bar, 0);
    multiply(m, tiles);
  }
}
