// The TAEHV decoder's tail in one kernel for Hopper (sm_90a), for 3 output channels (patch 1): TGrow + nearest 2x
// upsample + 3x3 conv 64 -> 64 + bias + ReLU (h), then the last 3x3 conv 64 -> 3 + bias, rounded to f16 as that
// conv's output would be, clamped to [0, 1] and written as uint8 (round(255 v), as triton_frames rounds it) or f16
// frames. h, 84 MB at taew2_1's step, never leaves shared memory.
//
// One program owns an output frame f (input image f / S, folded weight set f % S), a run of output rows
// r0 .. r_end - 1 and a strip of 126 output columns X0 = 126 * strip ... It walks down the h rows Y = r0 - 1 ..
// r_end:
// - the up conv of h row Y: output row parity py = Y % 2 of low-res row Y / 2. Warpgroup wg computes column phase
//   px = wg for 64 low-res columns: warpgroup 0 the even h columns X0, X0 + 2, .. X0 + 126 (low-res columns
//   x0 .. x0 + 63), warpgroup 1 the odd ones X0 - 1, .. X0 + 125 (low-res x0 - 1 .. x0 + 62); x0 = X0 / 2. Phase
//   (py, px) tap (ty, tx) reads low-res row ceil(Y / 2) - 1 + ty at column x + px - 1 + tx, which for both
//   warpgroups is pixel m + tx of the input row box (low-res columns x0 - 1 .. x0 + 63, 65 pixels): 16 m64n64k16
//   wgmmas. Bias, ReLU, f16, then into the h row buffer at column X - (X0 - 1) (zero where X is outside the image:
//   the last conv's padding).
// - the last conv as a projection: P = the h row times the 27 (kernel row ky, column kx, channel c) weights, 4
//   m64n32k16 wgmmas per warpgroup, to shared memory in fp32. Thread j then adds, for its (channel, column) pairs,
//   the three kx taps of each kernel row into output rows Y + 1, Y and Y - 1 (fp32 sums in registers); row Y - 1 is
//   then complete and is written. 4.5x fewer MACs than a 64 -> 16 (padded) direct conv.
// The 126-column strips overlap their neighbours by two h columns, so no program needs another's h.
//
// The tensor cores are kept fed by running the up conv two rows ahead in two accumulators: step Y issues P's
// wgmmas on h row Y, then the up conv of h row Y + 2; once P and the up conv of h row Y + 1 (issued a step earlier)
// are done, it puts h row Y + 1 into the (single) h buffer, stores P, sums the taps and writes output row Y - 1,
// all while the up conv of h row Y + 2 runs.
//
// Rows are kept without swizzle, channel-chunk major ([8 chunks of 8 channels][pixels][16 bytes]), wgmma's
// canonical layout, so an operand may start at any pixel (conv_row_sm90.cu says why the TMA's swizzle cannot).
// Shared memory (dynamic, 1024-byte aligned): the frame's folded weights [16 blocks (py, ty, tx, px)][64 c_out]
// [64 c_in] (128 KB) and the projection weight [32][64 c_in] (4 KB), 128-byte swizzled, loaded once; IN_STAGES
// input rows (9 KB each); one h row (16 KB); P (16.5 KB); barriers. 256 threads: two warpgroups; thread 0 issues
// every TMA.

#define IN_STAGES 4
#define IN_W 65                        // low-res input columns per program: x0 - 1 .. x0 + 63
#define IN_CHUNK 1152                  // one 8-channel chunk of an input row: 65 x 16 bytes, rounded up to 128
#define IN_ROW (8 * IN_CHUNK)
#define H_CHUNK 2048                   // one 8-channel chunk of the h row: 128 x 16 bytes
#define H_ROW (8 * H_CHUNK)
#define W1_BYTES (16 * 8192)
#define W2_BYTES (32 * 128)            // the 27 taps x channels, padded to 32 rows
#define STRIP 126                      // output columns per program
#define P_STRIDE 33                    // P: fp32 [128 h columns][33] (27 used); odd, so column reads spread banks
#define P_BYTES (128 * P_STRIDE * 4)
#define SMEM_BYTES (W1_BYTES + W2_BYTES + IN_STAGES * IN_ROW + H_ROW + P_BYTES + 8 * (IN_STAGES + 1))

// acc (+)= A[64 px, 16 c] x B[16 c, 32 n] (the 27 taps x channels, padded to 32).
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
  int img, Hh, Wh, X0, x0, r0, r_end, l_first, l_last, relu, out_u8, frame_ok;
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

// Whether the program takes h row Y: inside the image and needed by its output rows.
__device__ __forceinline__ bool takes(const Tail& t, int Y) { return Y >= 0 && Y < t.Hh && Y >= t.r0 - 1 && Y <= t.r_end; }

// The three kx taps of kernel row ky at this thread's pair (column m, channel c) of one P.
__device__ __forceinline__ float taps(u32 pb, int m, int c, int ky) {
  float s = 0.f;
#pragma unroll
  for (int kx = 0; kx < 3; ++kx) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(pb + ((m + kx) * P_STRIDE + ky * 9 + kx * 3 + c) * 4));
    s += v;
  }
  return s;
}

// Write output row r of this thread's pair q from its fp32 sum.
__device__ __forceinline__ void store_out(const Tail& t, float sum, int r, int m, int c) {
  int X = t.X0 + m;
  if (r < t.r0 || r >= t.r_end || X >= t.Wh || !t.frame_ok) return;
  float v = h2f(f2h(sum));  // the last conv's f16 output
  if (v == v) v = fminf(fmaxf(v, 0.f), 1.f);  // clamp; NaN stays NaN, as torch.clamp
  long long off = t.fo + (long long)c * t.so_c + (long long)r * t.so_h + (long long)X * t.so_w;
  if (t.out_u8)
    t.out[off] = (unsigned char)rintf(h2f(f2h(v * 255.f)));  // 255 v rounded to f16, as PyTorch stores it
  else
    ((u16*)t.out)[off] = f2h(v);
}

// Issue the up conv of h row Y (this warpgroup's column phase) into acc once its input rows are in (the caller
// fences and commits).
__device__ __forceinline__ void up_issue(const Tail& t, float (&acc)[32], int Y) {
  int px = threadIdx.x / 128, hi = (Y + 1) >> 1, py = Y & 1;
  wait_in(t, hi - 1);
  wait_in(t, hi);
#pragma unroll
  for (int ty = 0; ty < 2; ++ty)
#pragma unroll
    for (int tx = 0; tx < 2; ++tx)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_m64n64(acc, desc_chunks(in_row(t, hi - 1 + ty) + 2 * k * IN_CHUNK + tx * 16, IN_CHUNK),
                   desc(t.w1 + (((py * 2 + ty) * 2 + tx) * 2 + px) * 8192 + k * 32), ty + tx + k > 0);
}

// h row Y from the finished acc: bias, ReLU, f16 into the h buffer, made visible to the wgmmas (the caller syncs).
__device__ __forceinline__ void h_store(const Tail& t, const float (&b1)[8][2], const float (&acc)[32], int Y) {
  int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
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
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the h row's stores, for the wgmmas after
}

// Refill the input ring's slots of low-res rows below `free` (thread 0; no wgmma reads them any more).
__device__ __forceinline__ void refill(const Tail& t, int free, int& next_load) {
  if (threadIdx.x != 0) return;
  for (; next_load <= t.l_last && next_load - IN_STAGES < free; ++next_load) load_in(t, next_load);
}

// Step Y: h row Y is in the h buffer (if the program takes it) and the up conv of h row Y + 1 is under way in
// acc[A]. o = the fp32 sums of output rows Y - 1 (completed and written here), Y and Y + 1 (started here) for this
// thread's pairs j = tid and tid + 256: channel c = j / 128, column m = j % 128 (m < 126), so a warp's stores to a
// channel plane are consecutive bytes.
template <int A>
__device__ __forceinline__ void step(const Tail& t, const float (&b1)[8][2], const float (&b2)[2], int Y,
                                     float (&o)[3][2], float (&acc)[2][32], int& next_load) {
  int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid / 32) % 4;
  bool has = takes(t, Y), has1 = takes(t, Y + 1), has2 = takes(t, Y + 2);
  float p[16];
  // Two commit groups, each possibly empty, and unconditional waits: ptxas then sees every wgmma waited for on
  // every path and keeps them asynchronous.
  mma_fence();
  if (has) {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mma32(p, desc_chunks(t.hb + 2 * k * H_CHUNK + 64 * wg * 16, H_CHUNK), desc(t.w2 + k * 32), k > 0);
  }
  mma_commit();
  if (has2) up_issue(t, acc[1 - A], Y + 2);
  mma_commit();
  mma_wait_tied<1>(p);  // P, and before it the up conv of h row Y + 1
  mma_wait_tied<1>(acc[A]);
  if (has) {
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
  }
  __syncthreads();  // P is whole, and every wgmma reading h row Y is done: the h buffer is free
  if (has1) h_store(t, b1, acc[A], Y + 1);
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    int j = tid + 256 * q, c = j / 128, m = j % 128;
    if (j >= 384 || m >= STRIP) continue;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f;
    if (has) {
      s0 = taps(t.pb, m, c, 0);
      s1 = taps(t.pb, m, c, 1);
      s2 = taps(t.pb, m, c, 2);
    }
    // h row Y feeds output rows Y + 1 (kernel row 0), Y (1) and Y - 1 (2).
    store_out(t, o[0][q] + s2 + b2[q], Y - 1, m, c);
    o[0][q] = o[1][q] + s1;
    o[1][q] = o[2][q] + s0;
    o[2][q] = 0.f;
  }
  __syncthreads();  // h row Y + 1 is in, P is read
  refill(t, ((Y + 3) >> 1) - 1, next_load);  // the up conv of h row Y + 1 is done: rows below h row Y + 2's are free
}

extern "C" __global__ void __launch_bounds__(256, 1)
    tail_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w1_map,
              const __grid_constant__ TmaMap w2_map, const u16* b1, const u16* b2, unsigned char* out, int H,
              int W, int S, int rows, int chunks, int strips, int fps, int skip, int so_n, int so_f, int so_c,
              int so_h, int so_w, int out_u8, int relu, int pdl) {
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
  float b1v[8][2];
  int lane = threadIdx.x % 32;
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
    for (int e = 0; e < 2; ++e) b1v[n8][e] = b1 ? h2f(ldg_u16(b1 + n8 * 8 + 2 * (lane % 4) + e)) : 0.f;
  float b2p[2];  // this thread's pairs' channel biases
#pragma unroll
  for (int q2 = 0; q2 < 2; ++q2) {
    int c = (threadIdx.x + 256 * q2) / 128;
    b2p[q2] = (b2 && c < 3) ? h2f(ldg_u16(b2 + c)) : 0.f;
  }
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  int next_load = t.l_first;
  if (threadIdx.x == 0)
    for (; next_load <= t.l_last && next_load < t.l_first + IN_STAGES; ++next_load) load_in(t, next_load);
  __syncthreads();
  mbar_wait(w_bar, 0);
  // The first h row into the h buffer, and the up conv of the second under way, before the steps.
  float acc[2][32];
  int Y0 = t.r0 - 1;
  bool has0 = takes(t, Y0), has1 = takes(t, Y0 + 1);
  mma_fence();
  if (has0) up_issue(t, acc[1], Y0);
  mma_commit();
  mma_wait_tied<0>(acc[1]);
  if (has0) h_store(t, b1v, acc[1], Y0);
  __syncthreads();
  refill(t, ((Y0 + 2) >> 1) - 1, next_load);  // rows below h row Y0 + 1's are free
  mma_fence();
  if (has1) up_issue(t, acc[0], Y0 + 1);
  mma_commit();
  float o[3][2] = {};
  for (int Y = Y0; Y <= t.r_end; Y += 2) {
    step<0>(t, b1v, b2p, Y, o, acc, next_load);
    step<1>(t, b1v, b2p, Y + 1, o, acc, next_load);
  }
  mma_wait_tied<0>(acc[0]);
}
