// Nearest 2x upsample then a 3x3 conv, 64 -> 64 channels, for Hopper (sm_90a): TMA + asynchronous wgmma, with
// TAEHV's TGrow optionally folded in (G weight groups; output frame = input frame * G + group).
//
// The upsample is folded into the weights (kernels/conv_pack.py): output pixel (2i + py, 2j + px) is a 2x2 conv of
// the low-res input at rows i + py - 1 + r and columns j + px - 1 + s. A program's class is (group t, row phase py),
// blockIdx.x % (2 G). Its weights stay in shared memory for the whole launch (64 KB: both low-res rows r, each 256
// rows of 64 input channels, K-major, 128-byte swizzle: the column offset 0 for both column phases [px * 64 + c],
// then offset -1 (px 0 only), then offset +1 (px 1 only)). So each MMA does only the folded conv's taps, and the
// 4x larger upsampled tensor is never formed.
//
// The program walks its class's tiles of 8 x 8 low-res pixels. A tile's input is three TMA boxes of 9 rows x 8
// columns x 64 channels, at column offsets -1, 0, +1 (the TMA fills the padding with zeros); the operand of low-res
// row r is the box from row r on (8 r rows in, still 1024-byte aligned). Per tile, 8 m64n128k16 and 16 m64n64k16
// wgmmas give a 64-pixel x 128-column accumulator: the tile's output row phase py, both column phases, 64 channels.
// Two consumer warpgroups take alternate tiles and turns at the tensor cores, so one's epilogue runs beside the
// other's MMAs; a producer warp loads tiles STAGES ahead. Epilogue: bias, ReLU, f16 into the warpgroup's staging
// box (8 output rows of 16 pixels, as the output's 5-D TMA map lays out rows 2i + py), one TMA store.
//
// Dynamic shared memory: W_BYTES + STAGES * STAGE_BYTES + 2 * OUT_BYTES + barriers (cuda_conv_up.SMEM).

#define STAGES 4
#define X_BOX 9216                      // 9 rows x 8 columns x 64 channels, f16
#define STAGE_BYTES (3 * X_BOX)         // column offsets -1, 0, +1
#define W_ROWS 256                      // one low-res row's weights: 128 (offset 0) + 64 (-1) + 64 (+1)
#define W_BYTES (2 * W_ROWS * 128)
#define OUT_BYTES 16384                 // a warpgroup's staging box: 8 rows x 16 output pixels x 64 channels
#define CONSUMERS 256

// One consumer warpgroup's barrier (named barriers 1 and 2; constant ids, so ptxas reserves only those).
__device__ __forceinline__ void wg_sync(int wg) {
  if (wg == 0)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;" ::: "memory");
}
// The warpgroups take turns at the tensor cores (named barriers 3 and 4: warpgroup g waits on 3 + g, and passes
// the turn with an arrive on the other's). Warpgroup 0 starts; warpgroup 1's first tile waits for it.
__device__ __forceinline__ void turn_wait(int wg) {
  if (wg == 0)
    asm volatile("bar.sync 3, 256;" ::: "memory");
  else
    asm volatile("bar.sync 4, 256;" ::: "memory");
}
__device__ __forceinline__ void turn_pass(int wg) {
  if (wg == 0)
    asm volatile("bar.arrive 4, 256;" ::: "memory");
  else
    asm volatile("bar.arrive 3, 256;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
    conv_up_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map,
                 const __grid_constant__ TmaMap y_map, const u16* bias, int groups, int tiles_w, int tiles_h,
                 int tiles, int relu, int pdl) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  u32 w_s = base, x_s = base + W_BYTES, out_s = x_s + STAGES * STAGE_BYTES;
  u32 full = out_s + 2 * OUT_BYTES, empty = full + 8 * STAGES, w_bar = empty + 8 * STAGES;
  u32 bias_s = w_bar + 8;  // 64 floats: the bias, read in the epilogue (as registers it would spill)
  int classes = 2 * groups, cls = blockIdx.x % classes, py = cls % 2, group = cls / 2;
  int first = blockIdx.x / classes, step = gridDim.x / classes;
  int n = first < tiles ? (tiles - 1 - first) / step + 1 : 0;  // this program's tiles: first + j * step
  int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, 1);
    }
    mbar_init(w_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tid < 64)
    reinterpret_cast<float*>(smem_raw + (bias_s - smem_u32(smem_raw)))[tid] = bias ? h2f(ldg_u16(bias + tid)) : 0.f;
  __syncthreads();
  if (tid == CONSUMERS) {
    // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
    mbar_expect_tx(w_bar, W_BYTES);
    for (int r = 0; r < 2; ++r) tma_load_2d(w_s + r * W_ROWS * 128, &w_map, w_bar, 0, (2 * cls + r) * W_ROWS);
  }
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (__shfl_sync(0xffffffffu, tid / 32, 0) == CONSUMERS / 32) {  // warp-uniform, so ptxas keeps the wgmmas async
    if (tid != CONSUMERS) return;
    for (int j = 0; j < n; ++j) {
      int stage = j % STAGES, i = first + j * step;
      if (j >= STAGES) mbar_wait(empty + 8 * stage, (j / STAGES - 1) & 1);
      int tx = i % tiles_w, rest = i / tiles_w, ty = rest % tiles_h, img = rest / tiles_h;
      u32 bar = full + 8 * stage;
      mbar_expect_tx(bar, STAGE_BYTES);
#pragma unroll
      for (int d = 0; d < 3; ++d)
        tma_load_4d(x_s + stage * STAGE_BYTES + d * X_BOX, &x_map, bar, 0, 8 * tx + d - 1, 8 * ty + py - 1, img);
    }
    return;
  }

  int wg = __shfl_sync(0xffffffffu, tid / 128, 0), lane = tid % 32, warp = (tid / 32) % 4;
  u32 staging = out_s + wg * OUT_BYTES;
  unsigned char* stage_out = smem_raw + (staging - smem_u32(smem_raw));  // the same bytes, as a pointer
  const float* bias_f = reinterpret_cast<const float*>(smem_raw + (bias_s - smem_u32(smem_raw)));
  mbar_wait(w_bar, 0);

  // acc: offset 0, both column phases (64 px + c); lo, hi: offsets -1 (phase 0) and +1 (phase 1), added in the
  // epilogue (a wgmma on part of another's accumulator makes ptxas serialize them all: C7511).
  float acc[64], lo[32], hi[32];
  for (int j = wg; j < n; j += 2) {
    int stage = j % STAGES, i = first + j * step;
    mbar_wait(full + 8 * stage, (j / STAGES) & 1);
    u32 xs = x_s + stage * STAGE_BYTES;
    if (j > 0) turn_wait(wg);  // the other warpgroup's MMAs are done: this one's run beside its epilogue
    mma_fence();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      u32 w = w_s + r * W_ROWS * 128, a = xs + r * 1024;
#pragma unroll
      for (int k = 0; k < 4; ++k) mma_m64n128(acc, desc(a + X_BOX + 32 * k), desc(w + 32 * k), r + k > 0);
#pragma unroll
      for (int k = 0; k < 4; ++k) mma_m64n64(lo, desc(a + 32 * k), desc(w + 128 * 128 + 32 * k), r + k > 0);
#pragma unroll
      for (int k = 0; k < 4; ++k) mma_m64n64(hi, desc(a + 2 * X_BOX + 32 * k), desc(w + 192 * 128 + 32 * k), r + k > 0);
    }
    mma_commit();
    mma_wait_tied<0>(acc);
    mma_wait_tied<0>(lo);
    mma_wait_tied<0>(hi);
    turn_pass(wg);
    // The warpgroup is done with the stage; its last TMA store has read the staging box.
    if (tid % 128 == 0) tma_store_wait_read();
    wg_sync(wg);
    if (tid % 128 == 0) mbar_arrive(empty + 8 * stage, 1);

    // Accumulator element (low-res pixel m = 8 yl + xl, column 64 px + c) -> output pixel (row 2 yl + py, column
    // 2 xl + px): staging row 16 yl + 2 xl + px, 128-byte swizzled. A thread holds both column phases of its pixels;
    // lanes with xl >= 4 store phase 1 first, so that each store's eight rows fill all eight 16-byte bank groups.
    // Plain C++ shared-memory accesses, so the compiler overlaps them (the fence below orders them for the TMA).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int xl = lane / 4, swap = xl >= 4, first_row = 16 * (2 * warp + half) + 2 * xl + swap;
#pragma unroll
      for (int n8 = 0; n8 < 8; ++n8) {
        int e = 4 * n8 + 2 * half;
        float b0 = bias_f[8 * n8 + 2 * (lane % 4)], b1 = bias_f[8 * n8 + 2 * (lane % 4) + 1];
        float v0 = acc[e] + lo[e] + b0, v1 = acc[e + 1] + lo[e + 1] + b1;                  // column phase 0
        float w0 = acc[32 + e] + hi[e] + b0, w1 = acc[32 + e + 1] + hi[e + 1] + b1;        // column phase 1
        if (relu) {
          v0 = fmaxf(v0, 0.f);
          v1 = fmaxf(v1, 0.f);
          w0 = fmaxf(w0, 0.f);
          w1 = fmaxf(w1, 0.f);
        }
        u32 p0 = (u32)f2h(v0) | ((u32)f2h(v1) << 16), p1 = (u32)f2h(w0) | ((u32)f2h(w1) << 16);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          int row = first_row ^ k;
          *reinterpret_cast<u32*>(stage_out + row * 128 + ((n8 ^ (row % 8)) * 16) + (lane % 4) * 4) =
              (swap ^ k) ? p1 : p0;
        }
      }
    }
    fence_async_shared();
    wg_sync(wg);
    if (tid % 128 == 0) {
      int tx = i % tiles_w, rest = i / tiles_w, ty = rest % tiles_h, img = rest / tiles_h;
      tma_store_5d(&y_map, staging, 0, 16 * tx, py, 8 * ty, img * groups + group);
    }
  }
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (tid % 128 == 0) tma_store_wait_read();
}
