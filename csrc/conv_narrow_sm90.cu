// The decoder's last conv of TAEHV, 3x3 from 64 channels to 3 p^2 (p = PATCH: 3 or 12 channels), for Hopper
// (sm_90a): TMA + asynchronous wgmma, optionally writing the video frames directly (bias, f16 rounding, clamp to
// [0, 1], pixel shuffle by p, optionally uint8), so that the conv's output is never stored.
//
// A narrow output makes a direct conv's MMAs tiny (N = 3), so the GEMM is a projection instead: for every pixel of
// an input row, P = W' h with W' [(tap r, s, channel o) rows, 64 c_in], 27 p^2 rows padded to 64 p (PATCH M blocks
// of 64, one consumer warpgroup each, the weights as the A operand), and the row's pixels as B (m64n136k16: a strip
// of 136 input columns, 128 output columns plus the two halo columns, rounded up to 8). Then each output is a sum of
// 9 projections: out(y, x, o) = bias(o) + sum_{r,s} P_{y - 1 + r}(r, s, o; x - 1 + s). A program walks a run of
// input rows of one strip of one frame: each row's P goes through shared memory (f32), and every thread adds its
// (x, o) outputs' three column taps of each tap row to the running sums of output rows y + 1, y and y - 1; row y - 1
// is then complete and written. The input's zero padding is the TMA's out-of-bounds fill (P of a zero row is zero).
// A producer warp streams the rows STAGES ahead. The input is read once (plus two halo rows a run and 8 of 136
// columns a strip), which is what bounds the kernel: 84 MB at taew2_1's step.
//
// Dynamic shared memory: W_BYTES + STAGES * ROW_BYTES + P_BYTES + barriers (cuda_conv_narrow.smem).

#define C_OUT (3 * PATCH * PATCH)
#define N_PX 136                          // input columns a strip: 128 outputs + 2 halo, rounded up to 8
#define ROW_BYTES (N_PX * 128)            // one input row of a strip, 64 channels f16 (17 KB, 1024-aligned)
#define W_BYTES (PATCH * 64 * 128)        // W': PATCH blocks of 64 rows x 64 c_in
#define P_STRIDE 136                      // floats a P row (8 mod 32 words: the v2 stores hit every bank once)
#define P_BYTES (9 * C_OUT * P_STRIDE * 4)  // the 27 p^2 used rows of P, f32
#define CONSUMERS (PATCH * 128)
#define THREADS (CONSUMERS + 32)

// acc (+)= A[64 rows, 16 k] x B[16 k, 136 columns]; scale_d = 0 overwrites acc.
__device__ __forceinline__ void mma_m64n136(float (&d)[68], unsigned long long a, unsigned long long b, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n136k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67}, "
      "%68, %69, p, 1, 1, 0, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
      : "l"(a), "l"(b), "r"(scale_d));
}

// The frames (or plain output) a program writes to, and which input frame each work frame reads.
struct Target {
  u16* out;               // plain output, channels_last f16 [frames, H, W, C_OUT], or null
  unsigned char* frames;  // frames [samples, k_out, 3, H p, W p] (f16 or uint8 elements), or null
  long long sample_stride, frame_stride;  // elements
  int k_in, k_out, skip, uint8;

  // The input frame of work frame wf: frame skip + wf % k_out of sample wf / k_out.
  __device__ __forceinline__ int input_frame(int wf) const { return wf / k_out * k_in + skip + wf % k_out; }
};

// One output row's values of this thread (column x of strip sx, sub-row dy; v = c * PATCH + dx), written.
__device__ __forceinline__ void write_row(const float (&s)[3 * PATCH], const float (&bias)[3 * PATCH],
                                          const Target& t, int wf, int y, int xg, int dy, int H, int W) {
  if (xg >= W) return;
  int sample = wf / t.k_out, f = wf % t.k_out, img = t.input_frame(wf);
#pragma unroll
  for (int c = 0; c < 3; ++c)
#pragma unroll
    for (int dx = 0; dx < PATCH; ++dx) {
      int v = c * PATCH + dx, o = c * PATCH * PATCH + dy * PATCH + dx;
      u16 h = f2h(s[v] + bias[v]);
      if (t.out) {
        t.out[((long long)(img * H + y) * W + xg) * C_OUT + o] = h;
        continue;
      }
      float val = h2f(h);
      if (!(val != val)) val = fminf(fmaxf(val, 0.f), 1.f);  // clamp; NaN stays NaN, as torch.clamp
      long long at = sample * t.sample_stride + f * t.frame_stride + (long long)c * H * PATCH * W * PATCH +
                     (long long)(y * PATCH + dy) * W * PATCH + xg * PATCH + dx;
      if (t.uint8) {
        float m = h2f(f2h(val * 255.f));  // the scaled value as f16 stores it (torch: clamp, mul, round in f16)
        t.frames[at] = (unsigned char)rintf(m);  // nearest, ties to even (torch.round)
      } else {
        ((u16*)t.frames)[at] = f2h(val);
      }
    }
}

// A program's runs: output rows [begin, end) of the linear order ((work frame * strips + strip) * H + y), cut at
// (frame, strip) boundaries.
__device__ __forceinline__ bool next_run(int& at, int end, int strips, int H, int& wf, int& sx, int& ya, int& yb) {
  if (at >= end) return false;
  int line = at / H;
  ya = at % H;
  yb = min(H, ya + (end - at));
  wf = line / strips;
  sx = line % strips;
  at += yb - ya;
  return true;
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
    conv_narrow_sm90(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map, const u16* bias,
                     u16* out, unsigned char* frames, long long sample_stride, long long frame_stride, int k_in,
                     int k_out, int skip, int uint8, int H, int W, int strips, int total, int pdl) {
  const Target target{out, frames, sample_stride, frame_stride, k_in, k_out, skip, uint8};
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  u32 base = (smem_u32(smem_raw) + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
  u32 w_s = base, x_s = base + W_BYTES, p_s = x_s + STAGES * ROW_BYTES;
  u32 full = p_s + P_BYTES, empty = full + 8 * STAGES, w_bar = empty + 8 * STAGES;
  float* p_f = (float*)(smem_raw + (p_s - smem_u32(smem_raw)));
  int tid = threadIdx.x;
  int begin = (int)((long long)total * blockIdx.x / gridDim.x);
  int end = (int)((long long)total * (blockIdx.x + 1) / gridDim.x);

  if (tid == 0) init_ring(full, empty, STAGES, w_bar);
  __syncthreads();
  if (tid == CONSUMERS) {
    // Weights first: the previous kernel does not write them, so they load while it drains (PDL).
    mbar_expect_tx(w_bar, W_BYTES);
    tma_load_2d(w_s, &w_map, w_bar, 0, 0);
  }
  if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (__shfl_sync(0xffffffffu, tid / 32, 0) == CONSUMERS / 32) {  // the producer warp (warp-uniform)
    if (tid != CONSUMERS) return;
    int at = begin, wf, sx, ya, yb, j = 0;
    while (next_run(at, end, strips, H, wf, sx, ya, yb)) {
      int img = target.input_frame(wf);
      for (int i = ya - 1; i <= yb; ++i, ++j) {
        int stage = j % STAGES;
        if (j >= STAGES) mbar_wait(empty + 8 * stage, (j / STAGES - 1) & 1);
        u32 bar = full + 8 * stage;
        mbar_expect_tx(bar, ROW_BYTES);
        tma_load_4d(x_s + stage * ROW_BYTES, &x_map, bar, 0, 128 * sx - 1, i, img);
      }
    }
    return;
  }

  int lane = tid % 32, warp = tid / 32, g = warp / 4;  // g: this warpgroup's M block of W' rows
  int x = tid % 128, dy = tid / 128;                   // the outputs this thread sums: column x, sub-row dy
  float b[3 * PATCH];
#pragma unroll
  for (int c = 0; c < 3; ++c)
#pragma unroll
    for (int dx = 0; dx < PATCH; ++dx)
      b[c * PATCH + dx] = bias ? h2f(ldg_u16(bias + c * PATCH * PATCH + dy * PATCH + dx)) : 0.f;
  mbar_wait(w_bar, 0);

  float acc[68];
  // The accumulator rows this thread holds: W' row m0 and m0 + 8 (of 27 p^2 used).
  int m0 = 64 * g + (warp % 4) * 16 + lane / 4;
  int at = begin, wf, sx, ya, yb, j = 0;
  while (next_run(at, end, strips, H, wf, sx, ya, yb)) {
    float s_a[3 * PATCH], s_b[3 * PATCH];  // running sums of output rows i - 1 and i
#pragma unroll
    for (int v = 0; v < 3 * PATCH; ++v) s_a[v] = s_b[v] = 0.f;
    for (int i = ya - 1; i <= yb; ++i, ++j) {
      int stage = j % STAGES;
      mbar_wait(full + 8 * stage, (j / STAGES) & 1);
      u32 xs = x_s + stage * ROW_BYTES;
      mma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) mma_m64n136(acc, desc(w_s + g * 8192 + 32 * k), desc(xs + 32 * k), k > 0);
      mma_commit();
      mma_wait_tied<0>(acc);
      // P rows to shared memory: accumulator element (row m0 (+ 8), column 8 n8 + 2 (lane % 4) + e).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int m = m0 + 8 * h;
        if (m < 9 * C_OUT) {
#pragma unroll
          for (int n8 = 0; n8 < 17; ++n8)
            *(float2*)(p_f + m * P_STRIDE + 8 * n8 + 2 * (lane % 4)) =
                make_float2(acc[4 * n8 + 2 * h], acc[4 * n8 + 2 * h + 1]);
        }
      }
      asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
      if (tid == 0) mbar_arrive(empty + 8 * stage, 1);  // every warpgroup's MMAs of this stage are done
      float s_c[3 * PATCH];
#pragma unroll
      for (int c = 0; c < 3; ++c)
#pragma unroll
        for (int dx = 0; dx < PATCH; ++dx) {
          int v = c * PATCH + dx, o = c * PATCH * PATCH + dy * PATCH + dx;
          float r_sum[3];
#pragma unroll
          for (int r = 0; r < 3; ++r) {
            const float* row = p_f + ((3 * r) * C_OUT + o) * P_STRIDE + x;
            r_sum[r] = row[0] + row[C_OUT * P_STRIDE + 1] + row[2 * C_OUT * P_STRIDE + 2];
          }
          s_a[v] += r_sum[2];  // output row i - 1: complete
          s_b[v] += r_sum[1];
          s_c[v] = r_sum[0];
        }
      if (i - 1 >= ya) write_row(s_a, b, target, wf, i - 1, 128 * sx + x, dy, H, W);
#pragma unroll
      for (int v = 0; v < 3 * PATCH; ++v) {
        s_a[v] = s_b[v];
        s_b[v] = s_c[v];
      }
      asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");  // P is read: the next row may overwrite it
    }
  }
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
