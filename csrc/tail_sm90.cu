// The TAEHV decoder's tail in one kernel for Hopper (sm_90a): TGrow + nearest 2x upsample + 3x3 conv 64 -> 64 +
// bias + ReLU (h), then the last 3x3 conv 64 -> C2 (C2 = 3 p^2 <= 16) + bias, rounded to f16 as that conv's output
// would be, clamped to [0, 1], unpatchified by p and written as uint8 (round(255 v), as triton_frames rounds it) or
// f16 frames. h, 84 MB at taew2_1's step, never leaves shared memory.
//
// One program owns an output frame f (input image f / S, folded weight set f % S), a run of output rows
// r0 .. r_end - 1 and a strip of 126 output columns X0 = 126 * strip ... It walks down the h rows Y = r0 - 1 ..
// r_end. For each:
// - h row Y: output row parity py = Y % 2 of low-res row Y / 2. Warpgroup wg computes column phase px = wg for 64
//   low-res columns: warpgroup 0 the even h columns X0, X0 + 2, .. X0 + 126 (low-res columns x0 .. x0 + 63),
//   warpgroup 1 the odd ones X0 - 1, .. X0 + 125 (low-res x0 - 1 .. x0 + 62); x0 = X0 / 2. Phase (py, px) tap
//   (ty, tx) reads low-res row Y / 2 + py - 1 + ty = ceil(Y / 2) - 1 + ty at column x + px - 1 + tx, which for both
//   warpgroups is pixel m + tx of the input row box (low-res columns x0 - 1 .. x0 + 63, 65 pixels): 16 m64n64k16
//   wgmmas. Bias, ReLU, f16, then into the h row buffer at column X - (X0 - 1) (zero where X is outside the image:
//   the last conv's padding).
// - the last conv: h row Y feeds output rows Y + 1, Y and Y - 1 (kernel rows 0, 1, 2) through three m64n16
//   accumulators (the row-streaming schedule of conv_row_sm90.cu); warpgroup wg owns output columns
//   X0 + 64 wg .. + 63, whose tap kx reads h buffer pixel m + kx: 36 m64n16k16 wgmmas. Row Y - 1 is then complete
//   and is written (columns past X0 + 125 or the image are not).
// The 126-column strips overlap their neighbours by two h columns, so no program needs another's h.
// PROJECT = 1 (3 output channels, no unpatchify): the last conv in the projection form instead. P = the h row times
// the 27 (kernel row, column, channel) weights, 4 m64n32k16 wgmmas per warpgroup, goes to shared memory in fp32;
// each thread then sums the three kx taps of each kernel row for its (column, channel) pairs into the output rows'
// fp32 sums in registers. That is 4.5x fewer MACs than the direct form's 64 -> 16, whose N would be 81% padding.
//
// Rows are kept without swizzle, channel-chunk major ([8 chunks of 8 channels][pixels][16 bytes]), wgmma's
// canonical layout, so an operand may start at any pixel (conv_row_sm90.cu says why the TMA's swizzle cannot).
// Shared memory (dynamic, 1024-byte aligned): the frame's folded weights [16 blocks (py, px, ty, tx)][64 c_out]
// [64 c_in] (128 KB) and the last conv's [9 taps][16 c_out][64 c_in] (18 KB), 128-byte swizzled, loaded once;
// IN_STAGES input rows (9 KB each); one h row (17 KB); barriers. 256 threads: two warpgroups; thread 0 issues every
// TMA.

#define IN_STAGES 4
#define IN_W 65                        // low-res input columns per program: x0 - 1 .. x0 + 63
#define IN_CHUNK 1152                  // one 8-channel chunk of an input row: 65 x 16 bytes, rounded up to 128
#define IN_ROW (8 * IN_CHUNK)
#define H_CHUNK 2176                   // one 8-channel chunk of the h row: 130 x 16 bytes, rounded up to 128
#define H_ROW (8 * H_CHUNK)
#define W1_BYTES (16 * 8192)
#define STRIP 126                      // output columns per program
#ifndef PROJECT
#define PROJECT 0
#endif
#if PROJECT
// The projection form (3 output channels): the last conv's 27 taps x channels as one [32][64 c_in] weight; P, the
// h row times it, in fp32 [128 pixels][P_STRIDE].
#define W2_BYTES (32 * 128)
#define P_STRIDE 33
#define P_BYTES (128 * P_STRIDE * 4)
#else
#define W2_BYTES (9 * 2048)
#define P_BYTES 0
#endif
#define SMEM_BYTES (W1_BYTES + W2_BYTES + IN_STAGES * IN_ROW + H_ROW + P_BYTES + 8 * (IN_STAGES + 1))

// acc (+)= A[64 px, 16 c] x B[16 c, 16 c_out] (the last conv, its C2 outputs padded to 16); scale_d = 0 overwrites.
__device__ __forceinline__ void mma16(float (&d)[8], unsigned long long a, unsigned long long b, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "r"(scale_d));
}

// acc (+)= A[64 px, 16 c] x B[16 c, 32 n] (the projection form's 27 taps x channels, padded to 32).
__device__ __forceinline__ void mma32(float (&d)[16], unsigned long long a, unsigned long long b, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(scale_d));
}

struct Tail {
  const TmaMap* x_map;
  unsigned char* out;
  u32 w1, w2, in, hb, pb, bars;
  int img, Hh, Wh, X0, x0, r0, r_end, l_first, l_last, relu, C2, P, out_u8, frame_ok;
  long long fo;
  int so_c, so_h, so_w;
};

__device__ __forceinline__ u32 in_row(const Tail& t, int l) { return t.in + ((l - t.l_first) % IN_STAGES) * IN_ROW; }

__device__ __forceinline__ void load_in(const Tail& t, int l) {
  int k = l - t.l_first;
  u32 bar = t.bars + 8 * (k % IN_STAGES);
  mbar_expect_tx(bar, IN_W * 128);
  for (int c = 0; c < 8; ++c) tma_load_4d(in_row(t, l) + c * IN_CHUNK, t.x_map, bar, 8 * c, t.x0 - 1, l, t.img);
}

__device__ __forceinline__ void wait_in(const Tail& t, int l) {
  int k = l - t.l_first;
  mbar_wait(t.bars + 8 * (k % IN_STAGES), (k / IN_STAGES) & 1);
}

// h row Y into the h buffer (both warpgroups; the caller syncs after).
__device__ __forceinline__ void h_row(const Tail& t, const float (&b1)[8][2], int Y) {
  int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  int hi = (Y + 1) >> 1, py = Y & 1;
  wait_in(t, hi - 1);
  wait_in(t, hi);
  float acc[32];
  mma_fence();
#pragma unroll
  for (int ty = 0; ty < 2; ++ty)
#pragma unroll
    for (int tx = 0; tx < 2; ++tx)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_m64n64(acc, desc_chunks(in_row(t, hi - 1 + ty) + 2 * k * IN_CHUNK + tx * 16, IN_CHUNK),
                   desc(t.w1 + ((py * 2 + wg) * 4 + ty * 2 + tx) * 8192 + k * 32), ty + tx + k > 0);
  mma_commit();
  mma_wait_tied<0>(acc);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int m = warp * 16 + lane / 4 + 8 * half;  // the warpgroup's low-res column
    int i = 2 * m + 1 - wg;                   // its h buffer column: h column X0 - 1 + i
    int X = t.X0 - 1 + i;
    bool inside = X >= 0 && X < t.Wh;
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
      float v0 = acc[4 * n8 + 2 * half] + b1[n8][0], v1 = acc[4 * n8 + 2 * half + 1] + b1[n8][1];
      if (t.relu) {
        v0 = fmaxf(v0, 0.f);
        v1 = fmaxf(v1, 0.f);
      }
      u32 packed = inside ? ((u32)f2h(v0) | ((u32)f2h(v1) << 16)) : 0u;
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(t.hb + n8 * H_CHUNK + i * 16 + (lane % 4) * 4), "r"(packed)
                   : "memory");
    }
  }
}

// Output row r from acc: bias, f16, clamp, unpatchify, uint8 or f16 into the frame.
__device__ __forceinline__ void store_out(const Tail& t, const float (&b2)[2][2], const float (&acc)[8], int r) {
  if (!t.frame_ok) return;
  int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  int pp = t.P * t.P;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int m = 64 * wg + warp * 16 + lane / 4 + 8 * half;
    int X = t.X0 + m;
    if (m >= STRIP || X >= t.Wh) continue;
#pragma unroll
    for (int n8 = 0; n8 < 2; ++n8)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int ch = 8 * n8 + 2 * (lane % 4) + e;
        if (ch >= t.C2) continue;
        float v = h2f(f2h(acc[4 * n8 + 2 * half + e] + b2[n8][e]));  // the last conv's f16 output
        if (v == v) v = fminf(fmaxf(v, 0.f), 1.f);                    // clamp; NaN stays NaN, as torch.clamp
        int c = ch / pp, sub = ch % pp;
        long long off = t.fo + (long long)c * t.so_c + (long long)(r * t.P + sub / t.P) * t.so_h +
                        (long long)(X * t.P + sub % t.P) * t.so_w;
        if (t.out_u8) {
          float s = h2f(f2h(v * 255.f));  // 255 v rounded to f16, as PyTorch stores it, then to even
          t.out[off] = (unsigned char)rintf(s);
        } else {
          ((u16*)t.out)[off] = f2h(v);
        }
      }
  }
}

// Kernel row ky of the last conv from the h row into acc (output row Y + 1 - ky): 3 taps x 4 K steps. `add` = 0
// overwrites acc on the first.
__device__ __forceinline__ void last_conv_mmas(float (&acc)[8], const Tail& t, int wg, int ky, int add) {
#pragma unroll
  for (int kx = 0; kx < 3; ++kx)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mma16(acc, desc_chunks(t.hb + 2 * k * H_CHUNK + (64 * wg + kx) * 16, H_CHUNK),
            desc(t.w2 + (ky * 3 + kx) * 2048 + k * 32), add || kx + k > 0);
}

// h row Y into the h buffer, visible to the wgmmas after; the input rows h row Y + 1 no longer reads refilled.
__device__ __forceinline__ void h_step(const Tail& t, const float (&b1)[8][2], int Y, int& next_load) {
  h_row(t, b1, Y);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the h row's stores, for the wgmmas after
  __syncthreads();  // and every wgmma of the up conv is done: its input rows may be refilled
  if (threadIdx.x == 0) {
    int lo_next = ((Y + 2) >> 1) - 1;  // the lowest input row h row Y + 1 reads
    for (; next_load <= t.l_last && next_load - IN_STAGES < lo_next; ++next_load) load_in(t, next_load);
  }
}

template <int K>
__device__ __forceinline__ void step(const Tail& t, const float (&b1)[8][2], const float (&b2)[2][2], int i,
                                     float (&acc)[3][8], int& next_load) {
  // Step i takes h row Y = r0 - 1 + i. Output row r lives in acc[(r - r0 + 1) % 3]: row Y + 1 in acc[(K+1)%3],
  // row Y in acc[K], row Y - 1 (completed here) in acc[(K+2)%3].
  float(&next)[8] = acc[(K + 1) % 3];
  float(&cur)[8] = acc[K];
  float(&done)[8] = acc[(K + 2) % 3];
  int Y = t.r0 - 1 + i, wg = threadIdx.x / 128;
  if (Y >= 0 && Y < t.Hh && Y <= t.r_end) {
    h_step(t, b1, Y, next_load);
    bool has_next = Y + 1 < t.r_end, has_cur = Y >= t.r0 && Y < t.r_end, has_done = Y - 1 >= t.r0 && Y - 1 < t.r_end;
    mma_fence();
    // One straight run of 12 wgmmas per accumulator (branches inside a run would make ptxas serialize them).
    // Output row r takes h rows r - 1, r, r + 1 in that order; its first valid one overwrites the accumulator
    // (scale_d = 0): h row r - 1 (as next), or h row r (as cur) where row r - 1 is the top padding. Zeroing an
    // accumulator instead would make ptxas serialize the wgmmas.
    if (has_done) last_conv_mmas(done, t, wg, 2, 1);
    if (has_cur) last_conv_mmas(cur, t, wg, 1, Y >= 1);
    if (has_next) last_conv_mmas(next, t, wg, 0, 0);
    mma_commit();
    mma_wait_tied<0>(next, cur, done);
  }
  if (Y - 1 >= t.r0 && Y - 1 < t.r_end) store_out(t, b2, done, Y - 1);
  __syncthreads();  // every wgmma reading the h row is done: the next step may overwrite it
}

#if PROJECT
// The projection form's step: P = h row Y x the 27 taps (4 m64n32k16 wgmmas per warpgroup) into shared memory,
// then each thread sums, for its (column, channel) pairs j = tid and tid + 256 of the 126 x 3, the three taps kx
// of each kernel row into output rows Y + 1 (o[(K+1)%3], which starts here), Y and Y - 1 (completed: written).
template <int K>
__device__ __forceinline__ void step_p(const Tail& t, const float (&b1)[8][2], const float (&b2)[2], int i,
                                       float (&o)[3][2], int& next_load) {
  float(&next)[2] = o[(K + 1) % 3];
  float(&cur)[2] = o[K];
  float(&done)[2] = o[(K + 2) % 3];
  int Y = t.r0 - 1 + i, tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  bool valid = Y >= 0 && Y < t.Hh && Y <= t.r_end;
  if (valid) {
    h_step(t, b1, Y, next_load);
    float p[16];
    mma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mma32(p, desc_chunks(t.hb + 2 * k * H_CHUNK + 64 * wg * 16, H_CHUNK), desc(t.w2 + k * 32), k > 0);
    mma_commit();
    mma_wait_tied<0>(p);
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int n8 = 0; n8 < 4; ++n8)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          int px = 64 * wg + warp * 16 + lane / 4 + 8 * half, n = 8 * n8 + 2 * (lane % 4) + e;
          asm volatile("st.shared.f32 [%0], %1;" ::"r"(t.pb + (px * P_STRIDE + n) * 4), "f"(p[4 * n8 + 2 * half + e])
                       : "memory");
        }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    int j = tid + 256 * q, m = j / 3, c = j % 3;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f;
    if (valid && j < 3 * STRIP) {
#pragma unroll
      for (int kx = 0; kx < 3; ++kx) {
        u32 a = t.pb + ((m + kx) * P_STRIDE + kx * 3 + c) * 4;
        float v0, v1, v2;
        asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v0) : "r"(a));
        asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v1) : "r"(a + 9 * 4));
        asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v2) : "r"(a + 18 * 4));
        s0 += v0;
        s1 += v1;
        s2 += v2;
      }
    }
    next[q] = s0;  // an h row of padding gives zero: row Y + 1 starts from zero
    cur[q] += s1;
    done[q] += s2;
    int r = Y - 1, X = t.X0 + m;
    if (r >= t.r0 && r < t.r_end && j < 3 * STRIP && X < t.Wh && t.frame_ok) {
      float v = h2f(f2h(done[q] + b2[q]));  // the last conv's f16 output
      if (v == v) v = fminf(fmaxf(v, 0.f), 1.f);
      long long off = t.fo + (long long)c * t.so_c + (long long)r * t.so_h + (long long)X * t.so_w;
      if (t.out_u8)
        t.out[off] = (unsigned char)rintf(h2f(f2h(v * 255.f)));
      else
        ((u16*)t.out)[off] = f2h(v);
    }
  }
  __syncthreads();  // P and the h row are read: the next step may overwrite them
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1)
    tail_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w1_map,
              const __grid_constant__ TmaMap w2_map, const u16* b1, const u16* b2, unsigned char* out, int H,
              int W, int S, int C2, int P, int rows, int chunks, int strips, int fps, int skip, int so_n, int so_f,
              int so_c, int so_h, int so_w, int out_u8, int relu, int pdl) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  Tail t;
  t.x_map = &x_map;
  t.out = out;
  t.w1 = base;
  t.w2 = base + W1_BYTES;
  t.in = t.w2 + W2_BYTES;
  t.hb = t.in + IN_STAGES * IN_ROW;
  t.pb = t.hb + H_ROW;
  t.bars = t.pb + P_BYTES;
  int pid = blockIdx.x, strip = pid % strips, q = pid / strips;
  int f = q / chunks, s = f % S;
  t.img = f / S;
  t.Hh = 2 * H;
  t.Wh = 2 * W;
  t.X0 = strip * STRIP;
  t.x0 = t.X0 / 2;
  t.r0 = (q % chunks) * rows;
  t.r_end = min(t.r0 + rows, t.Hh);
  t.l_first = ((max(t.r0 - 1, 0) + 1) >> 1) - 1;
  t.l_last = (min(t.r_end, t.Hh - 1) + 1) >> 1;
  t.relu = relu;
  t.C2 = C2;
  t.P = P;
  t.out_u8 = out_u8;
  int fi = f % fps - skip;  // this frame's index among its sample's frames written
  t.frame_ok = fi >= 0;
  t.fo = (long long)(f / fps) * so_n + (long long)fi * so_f;
  t.so_c = so_c;
  t.so_h = so_h;
  t.so_w = so_w;

  u32 w_bar = t.bars + 8 * IN_STAGES;
  if (threadIdx.x == 0) {
    for (int i = 0; i <= IN_STAGES; ++i) mbar_init(t.bars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
    mbar_expect_tx(w_bar, W1_BYTES + W2_BYTES);
    for (int blk = 0; blk < 16; ++blk) tma_load_2d(t.w1 + blk * 8192, &w1_map, w_bar, 0, (s * 16 + blk) * 64);
    tma_load_2d(t.w2, &w2_map, w_bar, 0, 0);
  }
  // The h row's last two columns are read only for output columns that are not written: zero them once.
  if (threadIdx.x < 16) {
    u32 a = t.hb + (threadIdx.x % 8) * H_CHUNK + (128 + threadIdx.x / 8) * 16;
    asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(a), "r"(0) : "memory");
  }
  float b1v[8][2];
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
    for (int e = 0; e < 2; ++e) b1v[n8][e] = b1 ? h2f(ldg_u16(b1 + n8 * 8 + 2 * (lane % 4) + e)) : 0.f;
#if PROJECT
  // This thread's pairs' bias (channel j % 3).
  float b2p[2] = {b2 ? h2f(ldg_u16(b2 + threadIdx.x % 3)) : 0.f, b2 ? h2f(ldg_u16(b2 + (threadIdx.x + 256) % 3)) : 0.f};
#else
  float b2v[2][2];  // this thread's accumulator columns
#pragma unroll
  for (int n8 = 0; n8 < 2; ++n8)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      int ch = n8 * 8 + 2 * (lane % 4) + e;
      b2v[n8][e] = (b2 && ch < C2) ? h2f(ldg_u16(b2 + ch)) : 0.f;
    }
#endif
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  int next_load = t.l_first;
  if (threadIdx.x == 0)
    for (; next_load <= t.l_last && next_load < t.l_first + IN_STAGES; ++next_load) load_in(t, next_load);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the zeroed h columns, for the wgmmas
  __syncthreads();
  mbar_wait(w_bar, 0);
  int n_groups = (t.r_end - t.r0 + 4) / 3;  // steps for h rows r0 - 1 .. r_end, in whole groups of three
#if PROJECT
  float o[3][2] = {{0.f, 0.f}, {0.f, 0.f}, {0.f, 0.f}};
  for (int g = 0; g < n_groups; ++g) {
    step_p<0>(t, b1v, b2p, 3 * g + 0, o, next_load);
    step_p<1>(t, b1v, b2p, 3 * g + 1, o, next_load);
    step_p<2>(t, b1v, b2p, 3 * g + 2, o, next_load);
  }
#else
  float acc[3][8];
  for (int g = 0; g < n_groups; ++g) {
    step<0>(t, b1v, b2v, 3 * g + 0, acc, next_load);
    step<1>(t, b1v, b2v, 3 * g + 1, acc, next_load);
    step<2>(t, b1v, b2v, 3 * g + 2, acc, next_load);
  }
#endif
}
