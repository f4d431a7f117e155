// Tiled implicit-GEMM 3x3 conv for Hopper (sm_90a) at 128 and more channels: TMA + asynchronous wgmma
// (m64n128k16), for the small grids of a one-frame step (TAEHV's 256- and 128-channel stages at latent resolution).
//
// A program computes WG x 64 output pixels by 128 output channels. Each consumer warpgroup's 64 pixels are one TMA
// box of BH rows x BW columns of one image (BH * BW = 64); its MMA operand is that box as the TMA writes it, 64 rows
// of 64 channels with the 128-byte swizzle. The K loop walks 9 taps x C_in / (64 NC) steps of NC channel chunks;
// step s loads, per warpgroup, the input box shifted by the tap (dy - 1, dx - 1) (the TMA fills the padding with
// zeros), and the tap's weight slices [128 c_out][64 c_in] (K-major, the same swizzle), NC chunks of each in one
// TMA instruction: the producer's instructions, not the bytes, pace these loads (BENCHMARKS.md, twenty-sixth
// session). A producer warp issues them, STAGES steps ahead, refilling a stage once the consumers release it (an
// "empty" barrier per stage).
// Epilogue: bias, residual (TMA boxes loaded at the start), ReLU, f16 in the residual's shared memory, TMA stores.
// With PDL the next kernel may launch once the K loop is done (griddepcontrol.launch_dependents there).
//
// Compile-time (NVRTC -D): WG (consumer warpgroups, 1 or 2), STAGES, BW (box columns; BH = 64 / BW), NC (channel
// chunks of 64 per K step; C_in / 64 must be a multiple).

#define BN 128                          // output channels per program
#define BH (64 / BW)
#define A_BYTES 8192                    // one warpgroup's box of one channel chunk: 64 px x 64 channels
#define B_BYTES (BN * 128)              // one weight slice: 128 c_out x 64 c_in
#define STAGE_BYTES (NC * (WG * A_BYTES + B_BYTES))  // NC chunks: [WG][NC] input boxes, then [NC] weight slices
#define R_BYTES (WG * (BN / 64) * 8192)  // residual / output boxes: per warpgroup, two of 64 channels
#define CONSUMERS (WG * 128)
// Dynamic shared memory: STAGES * STAGE_BYTES + R_BYTES + the barriers (cuda_conv_tiles.TileConfig.smem).

struct Tile {
  const TmaMap *x_map, *w_map;
  u32 base, full, empty;
  int x0, y0, img, n0, kg, c_out;
};

// Step s's loads into its stage (s % STAGES): tap s / kg, channel chunks NC (s % kg) .. + NC - 1 (kg = kc / NC).
// Each is one TMA instruction whatever NC (the maps' chunk dimension lies outside their rows): the weight slices
// (load_w, which sets the stage's barrier to expect the whole stage) and each warpgroup's input boxes (load_x).
__device__ __forceinline__ void load_w(const Tile& t, int s) {
  int stage = s % STAGES, tap = s / t.kg, cg = s % t.kg;
  u32 bar = t.full + 8 * stage;
  mbar_expect_tx(bar, STAGE_BYTES);
  tma_load_3d(t.base + stage * STAGE_BYTES + WG * NC * A_BYTES, t.w_map, bar, 0, tap * t.c_out + t.n0, NC * cg);
}
__device__ __forceinline__ void load_x(const Tile& t, int s) {
  int stage = s % STAGES, tap = s / t.kg, cg = s % t.kg;
#pragma unroll
  for (int g = 0; g < WG; ++g)
    tma_load_5d(t.base + stage * STAGE_BYTES + g * NC * A_BYTES, t.x_map, t.full + 8 * stage, 0, t.x0 + tap % 3 - 1,
                t.y0 + g * BH + tap / 3 - 1, NC * cg, t.img);
}

// Grid: output-channel blocks x pixel tiles, pixel tiles fastest. Tiles past the image's edge load zeros and store
// nothing (the TMA clips them).
extern "C" __global__ void __launch_bounds__(CONSUMERS + 32, 1)
    conv_tile_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map,
                   const __grid_constant__ TmaMap r_map, const __grid_constant__ TmaMap y_map, const u16* bias,
                   int c_in, int c_out, int tiles_w, int tiles_h, int m_tiles, int has_res, int relu, int pdl) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Tile t;
  t.base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  u32 r_base = t.base + STAGES * STAGE_BYTES;
  t.full = r_base + R_BYTES;
  t.empty = t.full + 8 * STAGES;
  u32 res_bar = t.empty + 8 * STAGES;
  t.x_map = &x_map;
  t.w_map = &w_map;
  t.kg = c_in / (64 * NC);
  t.c_out = c_out;
  int m = blockIdx.x % m_tiles;
  t.n0 = (blockIdx.x / m_tiles) * BN;
  t.x0 = (m % tiles_w) * BW;
  m /= tiles_w;
  t.y0 = (m % tiles_h) * (WG * BH);
  t.img = m / tiles_h;
  int steps = 9 * t.kg, tid = threadIdx.x;
  bool producer = tid == CONSUMERS;

  if (tid == 0) init_ring(t.full, t.empty, STAGES, res_bar);
  __syncthreads();
  // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
  if (producer)
    for (int s = 0; s < STAGES && s < steps; ++s) load_w(t, s);
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (producer) {
    for (int s = 0; s < STAGES && s < steps; ++s) load_x(t, s);
    if (has_res) {
      mbar_expect_tx(res_bar, R_BYTES);
      for (int g = 0; g < WG; ++g)
        for (int j = 0; j < BN / 64; ++j)
          tma_load_4d(r_base + (g * (BN / 64) + j) * 8192, &r_map, res_bar, t.n0 + 64 * j, t.x0, t.y0 + g * BH,
                      t.img);
    }
    for (int s = STAGES; s < steps; ++s) {  // refills, once the consumers have released the stage
      mbar_wait(t.empty + 8 * (s % STAGES), (s / STAGES - 1) & 1);
      load_w(t, s);
      load_x(t, s);
    }
    return;
  }
  if (tid >= CONSUMERS) return;

  // This thread's bias values for the epilogue (columns 8 n8 + 2 (lane % 4) + {0, 1}), read before the K loop so
  // that the epilogue waits on no global load.
  int lane = tid % 32, warp = (tid / 32) % 4;
  float bias_v[BN / 8][2];
#pragma unroll
  for (int n8 = 0; n8 < BN / 8; ++n8)
#pragma unroll
    for (int e = 0; e < 2; ++e) bias_v[n8][e] = bias ? h2f(ldg_u16(bias + t.n0 + n8 * 8 + 2 * (lane % 4) + e)) : 0.f;

  int wg = tid / 128;
  float acc[64];
  for (int s = 0; s < steps; ++s) {
    int stage = s % STAGES;
    mbar_wait(t.full + 8 * stage, (s / STAGES) & 1);
    u32 a = t.base + stage * STAGE_BYTES + wg * NC * A_BYTES, b = t.base + stage * STAGE_BYTES + WG * NC * A_BYTES;
    mma_fence();
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        mma_m64n128(acc, desc(a + j * A_BYTES + 32 * k), desc(b + j * B_BYTES + 32 * k), s + j + k > 0);
    mma_commit();
    mma_wait_tied<1>(acc);  // step s - 1's MMAs are done (this warp's)
    if (s >= 1 && s - 1 + STAGES < steps) {
      asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");  // ... and every consumer warp's
      if (tid == 0) mbar_arrive(t.empty + 8 * ((s - 1) % STAGES), 1);
    }
  }
  mma_wait_tied<0>(acc);
  // The next kernel (PDL) may launch from here on, not from this one's start: launched at the start, its programs
  // would sit on the SMs this small grid leaves free, waiting, where the step's side stream could run its convs.
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // Epilogue: accumulator element (row m, column c) -> the 128-byte swizzled box of columns 64j.., row m. Every
  // residual pair is read before the first store, so the reads overlap rather than wait one by one.
  if (has_res) mbar_wait(res_bar, 0);
  u32 res[2][BN / 8];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int px = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; ++n8) {
      u32 off = r_base + (wg * (BN / 64) + n8 / 8) * 8192 + px * 128 + (((n8 % 8) ^ (px % 8)) * 16) + (lane % 4) * 4;
      res[half][n8] = 0;
      if (has_res) asm volatile("ld.shared.b32 %0, [%1];" : "=r"(res[half][n8]) : "r"(off));
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int px = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
    for (int n8 = 0; n8 < BN / 8; ++n8) {
      u32 off = r_base + (wg * (BN / 64) + n8 / 8) * 8192 + px * 128 + (((n8 % 8) ^ (px % 8)) * 16) + (lane % 4) * 4;
      float v0 = acc[4 * n8 + 2 * half], v1 = acc[4 * n8 + 2 * half + 1];
      if (bias) {
        v0 += bias_v[n8][0];
        v1 += bias_v[n8][1];
      }
      if (has_res) {
        v0 += h2f((u16)(res[half][n8] & 0xFFFF));
        v1 += h2f((u16)(res[half][n8] >> 16));
      }
      if (relu) {
        v0 = fmaxf(v0, 0.f);
        v1 = fmaxf(v1, 0.f);
      }
      u32 packed = (u32)f2h(v0) | ((u32)f2h(v1) << 16);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(off), "r"(packed) : "memory");
    }
  }
  fence_async_shared();
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  if (tid == 0) {
    for (int g = 0; g < WG; ++g)
      for (int j = 0; j < BN / 64; ++j)
        tma_store_4d(&y_map, r_base + (g * (BN / 64) + j) * 8192, t.n0 + 64 * j, t.x0, t.y0 + g * BH, t.img);
    tma_store_wait_read();
  }
}
