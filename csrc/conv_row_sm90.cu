// Row-streaming 64->64 3x3 conv for Hopper (sm_90a): TMA + asynchronous wgmma, one shared-memory copy per input row.
//
// The same schedule as kernels/gluon_conv_rows.py (one program owns a strip of 128 output columns and a run of ROWS
// rows; it walks down the input rows, each feeding three output rows through three fp32 accumulators), written in
// CUDA C++ for one thing Gluon cannot express: the three dx taps of an input row are three views of ONE shared
// memory copy of the row, starting 0, 1 and 2 pixels into it. The row is kept without swizzle, channel-chunk major
// ([8 chunks of 8 channels][130 px][16 bytes]), wgmma's canonical layout, in which an operand may start at any
// pixel. (With the TMA's 128-byte swizzle it cannot: sm_90's wgmma takes the swizzle phase from the descriptor's
// start row and ignored the descriptor's base-offset field, as identity-weight probes showed.) So each row is 8 TMA
// loads of 130 pixels x 8 channels, 16.6 KB, instead of three dx-shifted boxes of 128 pixels, 48 KB.
//
// Shared memory (dynamic, 1024-byte aligned): weights [9 taps][64 c_out][64 c_in] (72 KB, K-major, loaded once),
// STAGES input rows [8][130 px][8 c] (17 KB each), STAGES residual boxes [128 px][64 c], one output box, barriers.
// The weight, residual and output boxes use the TMA's 128-byte swizzle: 16-byte chunk k of 128-byte row r sits at
// chunk k ^ (r % 8).
// 288 threads: two consumer warpgroups, each owning 64 of the strip's 128 output pixels, and a producer warp, one
// thread of which issues every row's loads, refilling a stage once both warpgroups have released it. (Loads issued
// by a consumer thread held its warpgroup up until the TMA unit had taken in the row's 8 boxes.) The
// warpgroups take turns at the tensor cores ("ping-pong"), so that one's epilogue runs beside the other's MMAs.
//
// Past mode (frames > 0; the memory-block conv's past half, kernels/cuda_mem_conv.py): output image i reads its
// input rows from the frame before it, image i - 1 of x, or, for a sample's first frame (i % frames == 0), from
// image i / frames of m_map (the carried memory). Without a memory (has_memory == 0) it reads image -1, which the
// TMA fills with zeros: the past before a video's first frame.

#define STAGES 3
#define CONSUMERS 256
#define BOX_W 130                                     // 128 output pixels + one halo pixel on each side
#define W_BYTES (9 * 64 * 64 * 2)
#define X_CHUNK_BYTES ((BOX_W * 16 + 127) / 128 * 128)  // one 8-channel chunk of the row (TMA writes at 128 B)
#define X_STAGE_BYTES (((BOX_W * 128) + 1023) / 1024 * 1024)
#define R_STAGE_BYTES (128 * 128)
#define SMEM_BYTES (W_BYTES + STAGES * (X_STAGE_BYTES + R_STAGE_BYTES) + 128 * 128 + 64)
// The 64 bytes at the end hold the barriers: STAGES full, the weights', STAGES empty.
static_assert(8 * (2 * STAGES + 1) <= 64, "the barriers outgrow SMEM_BYTES");

// The A operand of K step k, tap dx: 64 pixels of the row from pixel dx on (desc_chunks), channels 16k .. 16k + 15.
__device__ __forceinline__ unsigned long long x_desc(u32 x_box, int k, int dx) {
  return desc_chunks(x_box + 2 * k * X_CHUNK_BYTES + dx * 16, X_CHUNK_BYTES);
}

// A barrier of this thread's warpgroup alone (named barrier 1 or 2), which stores its output rows by itself.
__device__ __forceinline__ void warpgroup_sync() {
  if (threadIdx.x < 128)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;" ::: "memory");
}
// The thread that issues its warpgroup's TMA stores and releases its stages.
__device__ __forceinline__ bool wg_leader() { return threadIdx.x % 128 == 0; }

// One input row's nine taps into the accumulators they feed: tap (dy, dx) of row j goes to output row j + 1 - dy.
// Row `done` (dy = 2) is issued as its own group, so it can be drained while the other two run.
__device__ __forceinline__ void row_mmas(float (&done)[32], float (&cur)[32], float (&next)[32], u32 x_box,
                                         u32 w_base, bool has_done, bool has_cur, bool has_next) {
  mma_fence();
  if (has_done) {
#pragma unroll
    for (int dx = 0; dx < 3; ++dx)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_m64n64(done, x_desc(x_box, k, dx), desc(w_base + (6 + dx) * 8192 + k * 32), 1);
  }
  mma_commit();
  if (has_cur && has_next) {
#pragma unroll
    for (int dx = 0; dx < 3; ++dx)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        mma_m64n64(cur, x_desc(x_box, k, dx), desc(w_base + (3 + dx) * 8192 + k * 32), 1);
        mma_m64n64(next, x_desc(x_box, k, dx), desc(w_base + dx * 8192 + k * 32), dx + k > 0);
      }
  } else if (has_cur) {
#pragma unroll
    for (int dx = 0; dx < 3; ++dx)
#pragma unroll
      for (int k = 0; k < 4; ++k) mma_m64n64(cur, x_desc(x_box, k, dx), desc(w_base + (3 + dx) * 8192 + k * 32), 1);
  } else if (has_next) {
#pragma unroll
    for (int dx = 0; dx < 3; ++dx)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_m64n64(next, x_desc(x_box, k, dx), desc(w_base + dx * 8192 + k * 32), dx + k > 0);
  }
  mma_commit();
}

struct Run {
  const TmaMap *x_map, *r_map, *y_map;  // x_map: where the input rows come from (x, or the memory in past mode)
  const u16* bias;
  u32 w_base, x_base, r_base, o_base, bars;
  int img, x_img, r0, r_end, col0, steps, has_res, relu;  // img: the output's image; x_img: the input rows'
};

__device__ __forceinline__ void load_row(const Run& run, int i) {
  // Step i's input row r0 - 1 + i (one box from column col0 - 1) and, with a residual, output row r0 - 2 + i's.
  int stage = i % STAGES;
  u32 bar = run.bars + 8 * stage;
  mbar_expect_tx(bar, BOX_W * 128 + (run.has_res ? 128 * 128 : 0));
  for (int k = 0; k < 8; ++k)  // chunk k: channels 8k .. 8k+7 of the row's 130 pixels
    tma_load_4d(run.x_base + stage * X_STAGE_BYTES + k * X_CHUNK_BYTES, run.x_map, bar, 8 * k, run.col0 - 1,
                run.r0 - 1 + i, run.x_img);
  if (run.has_res)
    tma_load_4d(run.r_base + stage * R_STAGE_BYTES, run.r_map, bar, 0, run.col0, run.r0 - 2 + i, run.img);
}

// Byte offset of accumulator pair (pixel px, columns 8 n8 + 2 (lane % 4) and the next) in a 128-byte swizzled box
// of 128 pixels x 64 channels.
__device__ __forceinline__ u32 pair_off(int n8, int px, int lane) {
  return px * 128 + ((n8 ^ (px % 8)) * 16) + (lane % 4) * 4;
}

// Output row `row` from acc: bias (bias_v: this thread's columns, read once per program), residual, ReLU, f16;
// through the output box and a TMA store (which clips columns past the image). Every residual pair is read before
// the first store, so the reads overlap rather than wait one by one.
__device__ __forceinline__ void store_row(const Run& run, const float (&bias_v)[8][2], const float (&acc)[32],
                                          int row, int stage) {
  int t = threadIdx.x, lane = t % 32, warp = t / 32;  // warp 0-7: pixels 16 * warp .. + 15 of the strip
  if (wg_leader()) tma_store_wait_read();           // the previous row's store has left the output box
  warpgroup_sync();
  u32 res[2][8];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int px = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
      res[half][n8] = 0;
      if (run.has_res)
        asm volatile("ld.shared.b32 %0, [%1];"
                     : "=r"(res[half][n8])
                     : "r"(run.r_base + stage * R_STAGE_BYTES + pair_off(n8, px, lane)));
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int px = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {
      u32 off = pair_off(n8, px, lane);
      float v0 = acc[4 * n8 + 2 * half], v1 = acc[4 * n8 + 2 * half + 1];
      if (run.bias) {
        v0 += bias_v[n8][0];
        v1 += bias_v[n8][1];
      }
      if (run.has_res) {
        v0 += h2f((u16)(res[half][n8] & 0xFFFF));
        v1 += h2f((u16)(res[half][n8] >> 16));
      }
      if (run.relu) {
        v0 = fmaxf(v0, 0.f);
        v1 = fmaxf(v1, 0.f);
      }
      u32 packed = (u32)f2h(v0) | ((u32)f2h(v1) << 16);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(run.o_base + off), "r"(packed) : "memory");
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  warpgroup_sync();
  if (wg_leader())  // the warpgroup's 64 pixels (y_map's box is 64 pixels wide)
    tma_store_4d(run.y_map, run.o_base + (t / 128) * 8192, 0, run.col0 + 64 * (t / 128), row, run.img);
}

template <int K>
__device__ __forceinline__ void step(const Run& run, const float (&bias_v)[8][2], int i, float (&acc)[3][32]) {
  // Step i = 3g + K reads input row j = r0 - 1 + i. Output row r lives in acc[(r - r0 + 1) % 3]: row j+1 (its
  // first taps) in acc[(K+1)%3], row j in acc[K], row j-1 (completed here) in acc[(K+2)%3].
  float(&next)[32] = acc[(K + 1) % 3];
  float(&cur)[32] = acc[K];
  float(&done)[32] = acc[(K + 2) % 3];
  int stage = i % STAGES, row_done = run.r0 - 2 + i;
  mbar_wait(run.bars + 8 * stage, (i / STAGES) & 1);
  // Only the MMAs for rows this run stores (a run's first two and last steps skip the others).
  bool has_done = i >= 2 && row_done < run.r_end, has_cur = i >= 1 && row_done + 1 < run.r_end;
  bool has_next = row_done + 2 < run.r_end;
  // Warpgroup wg: pixels 64 * wg .. + 63 of the strip (through a shuffle, so that ptxas sees it warp-uniform).
  int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  // The warpgroups take turns at the tensor cores, so that one's epilogue runs beside the other's MMAs: warpgroup 1
  // issues step i's MMAs after warpgroup 0 has, warpgroup 0 step i + 1's after warpgroup 1 issued step i's.
  if (wg == 1)
    asm volatile("bar.sync 3, %0;" ::"n"(CONSUMERS) : "memory");
  else if (i > 0)
    asm volatile("bar.sync 4, %0;" ::"n"(CONSUMERS) : "memory");
  row_mmas(done, cur, next, run.x_base + stage * X_STAGE_BYTES + wg * 64 * 16, run.w_base, has_done, has_cur,
           has_next);
  if (wg == 0)
    asm volatile("bar.arrive 3, %0;" ::"n"(CONSUMERS) : "memory");
  else if (i + 1 < run.steps)
    asm volatile("bar.arrive 4, %0;" ::"n"(CONSUMERS) : "memory");
  mma_wait_tied<1>(done, cur, next);
  if (has_done) store_row(run, bias_v, done, row_done, stage);
  mma_wait_tied<0>(done, cur, next);
  warpgroup_sync();  // the warpgroup's MMAs and residual reads of this stage are done: release it to the producer
  if (wg_leader()) mbar_arrive(run.bars + 8 * (STAGES + 1 + stage), 1);
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
    conv_row_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map,
                  const __grid_constant__ TmaMap r_map, const __grid_constant__ TmaMap y_map,
                  const __grid_constant__ TmaMap m_map, const u16* bias, int H, int rows, int chunks, int strips,
                  int has_res, int relu, int pdl, int frames, int has_memory) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  Run run;
  run.x_map = &x_map;
  run.r_map = &r_map;
  run.y_map = &y_map;
  run.bias = bias;
  run.w_base = base;
  run.x_base = base + W_BYTES;
  run.r_base = run.x_base + STAGES * X_STAGE_BYTES;
  run.o_base = run.r_base + STAGES * R_STAGE_BYTES;
  run.bars = run.o_base + 128 * 128;
  int pid = blockIdx.x, strip = pid % strips, t = pid / strips;
  run.img = t / chunks;
  run.x_img = run.img;
  if (frames > 0) {  // past mode
    if (run.img % frames) {
      run.x_img = run.img - 1;
    } else if (has_memory) {
      run.x_map = &m_map;
      run.x_img = run.img / frames;
    } else {
      run.x_img = -1;
    }
  }
  run.r0 = (t % chunks) * rows;
  run.r_end = min(run.r0 + rows, H);
  run.col0 = strip * 128;
  run.has_res = has_res;
  run.relu = relu;
  // Input rows r0-1 .. r_end, rounded up to whole groups of three steps (the accumulators rotate with period 3).
  int n_groups = (run.r_end - run.r0 + 4) / 3;
  run.steps = 3 * n_groups;

  u32 w_bar = run.bars + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s <= STAGES; ++s) mbar_init(run.bars + 8 * s, 1);                   // full, weights
    for (int s = 0; s < STAGES; ++s) mbar_init(run.bars + 8 * (STAGES + 1 + s), 2);  // empty: one arrive per warpgroup
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
    mbar_expect_tx(w_bar, W_BYTES);
    for (int tap = 0; tap < 9; ++tap) tma_load_2d(run.w_base + tap * 8192, &w_map, w_bar, 0, tap * 64);
  }
  // This thread's bias values (columns 8 n8 + 2 (lane % 4) + {0, 1}), before the wait like the weights.
  float bias_v[8][2];
#pragma unroll
  for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      bias_v[n8][e] = bias ? h2f(ldg_u16(bias + n8 * 8 + 2 * (threadIdx.x % 4) + e)) : 0.f;
  if (pdl) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  __syncthreads();  // the barriers are initialised
  // The warp's index through a shuffle, so that ptxas sees the branch as warp-uniform (a divergent path before the
  // wgmmas makes it serialize them).
  if (__shfl_sync(0xffffffffu, threadIdx.x / 32, 0) >= CONSUMERS / 32) {
    // The producer warp: one thread issues every row's loads, refilling a stage once the consumers released it.
    if (threadIdx.x == CONSUMERS)
      for (int s = 0; s < run.steps; ++s) {
        if (s >= STAGES) mbar_wait(run.bars + 8 * (STAGES + 1 + s % STAGES), (s / STAGES - 1) & 1);
        load_row(run, s);
      }
    return;
  }
  float acc[3][32];
  mbar_wait(w_bar, 0);
  for (int g = 0; g < n_groups; ++g) {
    step<0>(run, bias_v, 3 * g + 0, acc);
    step<1>(run, bias_v, 3 * g + 1, acc);
    step<2>(run, bias_v, 3 * g + 2, acc);
  }
  if (wg_leader()) tma_store_wait_read();
}
