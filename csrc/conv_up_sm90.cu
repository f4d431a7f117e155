// Nearest 2x upsample then a 3x3 conv, 64 -> 64 channels, for Hopper (sm_90a): TMA + asynchronous wgmma, with
// TAEHV's TGrow optionally folded in (G weight groups; output frame = input frame * G + group).
//
// The upsample is folded into the weights (kernels/conv_pack.py): output pixel (2i + py, 2j + px) is a 2x2 conv of
// the low-res input, tap (r, s) at row i + py - 1 + r and column j + px - 1 + s. A program's class is (group t,
// output phase py, px), blockIdx.x % (4 G); its four taps' weights stay in shared memory for the whole launch (32 KB,
// [tap][64 c_out][64 c_in], 128-byte swizzle), so each MMA does only the folded conv's taps and the 4x larger
// upsampled tensor is never formed.
//
// The GEMM is transposed: the accumulator rows are the 64 output channels and its columns low-res pixels (the
// weights as the A operand, the pixels as B, m64n128k16). A program walks its class's tiles of 16 x 16 low-res
// pixels; a tile's input is two TMA boxes of 17 rows x 16 columns x 64 channels (column offsets px - 1 and px; the
// TMA fills the padding with zeros), and tap row r's operand is the box from row r on (2 KB in, 1024-byte aligned).
// A producer warp loads tiles STAGES ahead. The accumulator is two of 64 x 128 (the tile's low-res rows 0-7 and
// 8-15), so that each half's epilogue runs while the tensor cores take the other half's MMAs (the second half's
// beside the next tile's first). Epilogue: bias, ReLU, f16, stored transposed (stmatrix .trans: each pixel's 64
// channels become one 128-byte swizzled row) into its staging half, then one TMA store through the output's 5-D
// map of phase px (its rows 2i + py, columns 2j + px).
//
// Dynamic shared memory: W_BYTES + STAGES * STAGE_BYTES + OUT_BYTES + the barriers (cuda_conv_up.SMEM).

#define STAGES 2
#define X_BOX (17 * 16 * 128)           // 17 rows x 16 columns x 64 channels, f16
#define STAGE_BYTES (2 * X_BOX)         // column offsets px - 1 and px
#define W_BYTES (4 * 64 * 128)          // four taps x [64 c_out][64 c_in]
#define OUT_BYTES (256 * 128)           // 256 output pixels x 64 channels
#define THREADS (128 + 32)              // one consumer warpgroup and the producer warp

// One accumulator's MMAs for a tile: half h (its low-res rows 8h .. 8h + 7) of every tap (r, s) = (tap / 2,
// tap % 2), the weights (A) at w, the tile's boxes at xs (B: box s from row r + 8h on).
__device__ __forceinline__ void issue(float (&acc)[64], u32 w, u32 xs, int h) {
  mma_fence();
#pragma unroll
  for (int tap = 0; tap < 4; ++tap)
#pragma unroll
    for (int k = 0; k < 4; ++k)
      mma_m64n128(acc, desc(w + tap * 8192 + 32 * k),
                  desc(xs + (tap % 2) * X_BOX + (tap / 2) * 2048 + h * 16384 + 32 * k), tap + k > 0);
  mma_commit();
}

// One accumulator's epilogue: bias, ReLU, f16, stored transposed into the staging half at `staging`, then one TMA
// store of its 8 x 16 low-res pixels (rows 8 * row8 .. + 7 of phase py) into output frame `frame`. Accumulator
// element (channel c = row, pixel p = column 8 n8 + 2 (lane % 4) + e): stmatrix .trans stores each 8 x 8 block
// (8 channels of 8 pixels) as 8 pixel rows of 16 bytes; staging row p, 16-byte chunk c / 8, 128-byte swizzled. One
// x4 call: blocks (n8, channel half 0 / 1) and (n8 + 1, 0 / 1); lane L gives the row address of block L / 8, pixel
// L % 8. The store of this half from the last tile must have read the staging first (at most the other half's
// store still reading).
__device__ __forceinline__ void store_half(const float (&acc)[64], u32 staging, const TmaMap* y_map, float bias0,
                                           float bias1, int relu, int tx, int py, int row8, int frame) {
  int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, blk = lane / 8, p_in = lane % 8;
  if (tid == 0) tma_store_wait_read<1>();
  asm volatile("bar.sync 1, 128;" ::: "memory");
#pragma unroll
  for (int n8 = 0; n8 < 16; n8 += 2) {
    u32 v[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // block q: pixels of n8 + q / 2, channel half q % 2
      int e = 4 * (n8 + q / 2) + 2 * (q % 2);
      float b = q % 2 ? bias1 : bias0, v0 = acc[e] + b, v1 = acc[e + 1] + b;
      if (relu) {
        v0 = fmaxf(v0, 0.f);
        v1 = fmaxf(v1, 0.f);
      }
      v[q] = (u32)f2h(v0) | ((u32)f2h(v1) << 16);
    }
    int p = 8 * (n8 + blk / 2) + p_in, chunk = 2 * warp + blk % 2;
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     staging + p * 128 + ((chunk ^ (p % 8)) * 16)),
                 "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
  }
  fence_async_shared();
  asm volatile("bar.sync 1, 128;" ::: "memory");
  if (tid == 0) tma_store_5d(y_map, staging, 0, 16 * tx, py, 8 * row8, frame);
}

// Tile i of a class: column tx, row ty of tiles, input frame img.
__device__ __forceinline__ void tile_of(int i, int tiles_w, int tiles_h, int& tx, int& ty, int& img) {
  tx = i % tiles_w;
  ty = (i / tiles_w) % tiles_h;
  img = i / tiles_w / tiles_h;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    conv_up_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map,
                 const __grid_constant__ TmaMap y_map0, const __grid_constant__ TmaMap y_map1, const u16* bias,
                 int groups, int tiles_w, int tiles_h, int tiles, int relu, int pdl) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  u32 w_s = base, x_s = base + W_BYTES, out_s = x_s + STAGES * STAGE_BYTES;
  u32 full = out_s + OUT_BYTES, empty = full + 8 * STAGES, w_bar = empty + 8 * STAGES;
  int classes = 4 * groups, cls = blockIdx.x % classes, px = cls % 2, py = (cls / 2) % 2, group = cls / 4;
  int first = blockIdx.x / classes, step = gridDim.x / classes;
  int n = first < tiles ? (tiles - 1 - first) / step + 1 : 0;  // this program's tiles: first + j * step
  int tid = threadIdx.x;

  if (tid == 0) init_ring(full, empty, STAGES, w_bar);
  __syncthreads();
  if (tid == 128) {
    // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
    mbar_expect_tx(w_bar, W_BYTES);
    tma_load_2d(w_s, &w_map, w_bar, 0, 256 * cls);
  }
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (__shfl_sync(0xffffffffu, tid / 32, 0) == 4) {  // the producer warp (warp-uniform: the wgmmas stay async)
    if (tid != 128) return;
    for (int j = 0; j < n; ++j) {
      int stage = j % STAGES, i = first + j * step;
      if (j >= STAGES) mbar_wait(empty + 8 * stage, (j / STAGES - 1) & 1);
      int tx, ty, img;
      tile_of(i, tiles_w, tiles_h, tx, ty, img);
      u32 bar = full + 8 * stage;
      mbar_expect_tx(bar, STAGE_BYTES);
#pragma unroll
      for (int s = 0; s < 2; ++s)
        tma_load_4d(x_s + stage * STAGE_BYTES + s * X_BOX, &x_map, bar, 0, 16 * tx + px - 1 + s, 16 * ty + py - 1,
                    img);
    }
    return;
  }

  int lane = tid % 32, warp = tid / 32;
  // This thread's accumulator rows (output channels) are warp * 16 + lane / 4 + {0, 8}.
  float bias0 = bias ? h2f(ldg_u16(bias + warp * 16 + lane / 4)) : 0.f;
  float bias1 = bias ? h2f(ldg_u16(bias + warp * 16 + lane / 4 + 8)) : 0.f;
  const TmaMap* y_map = px ? &y_map1 : &y_map0;
  mbar_wait(w_bar, 0);

  // Two accumulators, each 64 channels x 128 pixels (a tile's low-res rows 0-7 and 8-15, two m64n128k16 chains):
  // one half's epilogue runs while the tensor cores take the other half's MMAs.
  float acc_a[64], acc_b[64];
  int last_tx = 0, last_ty = 0, last_frame = 0;  // the tile whose second half waits for its epilogue
  for (int j = 0; j < n; ++j) {
    int i = first + j * step, stage = j % STAGES;
    int tx, ty, img;
    tile_of(i, tiles_w, tiles_h, tx, ty, img);
    int frame = img * groups + group;
    mbar_wait(full + 8 * stage, (j / STAGES) & 1);
    issue(acc_a, w_s, x_s + stage * STAGE_BYTES, 0);
    if (j > 0) {  // the last tile's second half (retired: at most this tile's first half in flight)
      mma_wait_tied<1>(acc_b);
      store_half(acc_b, out_s + OUT_BYTES / 2, y_map, bias0, bias1, relu, last_tx, py, 2 * last_ty + 1, last_frame);
    }
    issue(acc_b, w_s, x_s + stage * STAGE_BYTES, 1);
    mma_wait_tied<1>(acc_a);
    store_half(acc_a, out_s, y_map, bias0, bias1, relu, tx, py, 2 * ty, frame);
    mma_wait_tied<0>(acc_b);
    asm volatile("bar.sync 1, 128;" ::: "memory");  // every warp is done with the stage
    if (tid == 0) mbar_arrive(empty + 8 * stage, 1);
    last_tx = tx, last_ty = ty, last_frame = frame;
  }
  if (n > 0)
    store_half(acc_b, out_s + OUT_BYTES / 2, y_map, bias0, bias1, relu, last_tx, py, 2 * last_ty + 1, last_frame);
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (tid == 0) tma_store_wait_read();
}
