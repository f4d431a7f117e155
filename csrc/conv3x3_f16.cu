// Direct 3x3 conv, pad 1, NCHW, f16 storage, f32 accumulation (SIMT, no tensor cores).
//   y = conv(x, w) [+ bias] [+ residual]; [relu]       x: [B, CIN, H, W]  w: [COUT, CIN, 3, 3]
//   bias: [COUT] or null   residual/y: [B, COUT, Ho, Wo], Ho = (H - 1) / STRIDE + 1
// Compile-time: CIN, COUT (1..64), STRIDE (1 or 2). Runtime flags: 1 bias, 2 residual, 4 relu.
// Three variants, all staging an input halo (as f32) and a weight slab in shared memory, CK input
// channels at a time:
//   conv3x3_tile   one thread per output pixel, all COUT accumulators in registers
//   conv3x3_ocb4   one thread per output pixel x 4 output channels (more threads, fewer registers)
//   conv3x3_rb     one thread per 2x2 output pixels x 8 output channels (4 when COUT <= 4; stride 1 only)
// Batch (and output-channel groups) run on grid.z with a grid-stride loop, so B is unbounded.
// VARIANT (1 tile, 2 ocb4, 3 rb; 0 or unset = all) compiles one kernel only: NVRTC time is per kernel.

#ifndef CIN
#define CIN 64
#endif
#ifndef COUT
#define COUT 64
#endif
#ifndef STRIDE
#define STRIDE 1
#endif

#ifndef VARIANT
#define VARIANT 0
#endif

#define F_BIAS 1
#define F_RES 2
#define F_RELU 4

constexpr int imin(int a, int b) { return a < b ? a : b; }
constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Epilogue for one output element; idx indexes y / residual.
__device__ __forceinline__ void emit(u16* __restrict__ y, const u16* __restrict__ bias, const u16* __restrict__ res,
                                     int flags, i64 idx, int oc, float v) {
  if (flags & F_BIAS) v += h2f(ldg_u16(bias + oc));
  if (flags & F_RES) v += h2f(ldg_u16(res + idx));
  if (flags & F_RELU) v = v < 0.f ? 0.f : v;  // keeps NaN, like torch.relu
  y[idx] = f2h(v);
}

// Stage input channels [c0, c0+NC) of one image, rows iy0.., cols ix0.. into sh[NC][HT][HTP] (f32,
// zero outside the image = the conv's padding, zero past CIN).
template <int NC, int HT, int WT, int HTP>
__device__ __forceinline__ void stage_input(float* sh, const u16* __restrict__ xb, int c0, int H, int W, int iy0,
                                            int ix0, int tid, int nthr) {
  const int n = NC * HT * WT;
#pragma unroll 1
  for (int i = tid; i < n; i += nthr) {
    int c = i / (HT * WT), r = i - c * (HT * WT);
    int yy = r / WT, xx = r - yy * WT;
    int gy = iy0 + yy, gx = ix0 + xx;
    float v = 0.f;
    if (c0 + c < CIN && gy >= 0 && gy < H && gx >= 0 && gx < W) v = h2f(ldg_u16(xb + (i64)(c0 + c) * H * W + gy * W + gx));
    sh[(c * HT + yy) * HTP + xx] = v;
  }
}

// Stage weights of output channels [oc0, oc0+NO) and input channels [c0, c0+NC) into sw[NC][9][NO]
// (f32, zero past COUT / CIN) so that a thread reads its output channels as float4s.
template <int NC, int NO>
__device__ __forceinline__ void stage_weights(float* sw, const u16* __restrict__ w, int c0, int oc0, int tid, int nthr) {
#pragma unroll 1
  for (int i = tid; i < NC * 9 * NO; i += nthr) {
    int o = i % NO, t = i / NO, k = t % 9, c = t / 9;
    float v = 0.f;
    if (oc0 + o < COUT && c0 + c < CIN) v = h2f(ldg_u16(w + ((i64)(oc0 + o) * CIN + c0 + c) * 9 + k));
    sw[i] = v;
  }
}

// ------------------------------------------------------------------------------------------ tile
#if VARIANT == 0 || VARIANT == 1
namespace tile {
constexpr int T = 16;                              // 16x16 output pixels per block, 256 threads
constexpr int CK = imin(STRIDE == 1 ? 8 : 4, CIN); // input channels per smem stage
constexpr int HT = (T - 1) * STRIDE + 3;           // halo rows/cols
constexpr int OCP = cdiv(COUT, 4) * 4;             // output channels padded to float4
}  // namespace tile

extern "C" __global__ void __launch_bounds__(256) conv3x3_tile(const u16* __restrict__ x, const u16* __restrict__ w,
                                                               const u16* __restrict__ bias, const u16* __restrict__ res,
                                                               u16* __restrict__ y, int B, int H, int W, int Ho, int Wo,
                                                               int flags) {
  using namespace tile;
  __shared__ float sh[CK * HT * HT];
  __shared__ __align__(16) float sw[CK * 9 * OCP];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * T + tx;
  const int ox = blockIdx.x * T + tx, oy = blockIdx.y * T + ty;
  const int iy0 = blockIdx.y * T * STRIDE - 1, ix0 = blockIdx.x * T * STRIDE - 1;
  for (int b = blockIdx.z; b < B; b += gridDim.z) {
    const u16* xb = x + (i64)b * CIN * H * W;
    float acc[OCP];
#pragma unroll
    for (int o = 0; o < OCP; ++o) acc[o] = 0.f;
    for (int c0 = 0; c0 < CIN; c0 += CK) {
      __syncthreads();  // previous stage fully consumed
      stage_input<CK, HT, HT, HT>(sh, xb, c0, H, W, iy0, ix0, tid, T * T);
      stage_weights<CK, OCP>(sw, w, c0, 0, tid, T * T);
      __syncthreads();
#pragma unroll 1
      for (int c = 0; c < CK; ++c) {
        const float* s = sh + (c * HT + ty * STRIDE) * HT + tx * STRIDE;
        const float4* wv = reinterpret_cast<const float4*>(sw + c * 9 * OCP);
#pragma unroll
        for (int k = 0; k < 9; ++k) {
          const float v = s[(k / 3) * HT + k % 3];
#pragma unroll
          for (int q = 0; q < OCP / 4; ++q) {
            const float4 wq = wv[k * (OCP / 4) + q];
            acc[4 * q + 0] += v * wq.x;
            acc[4 * q + 1] += v * wq.y;
            acc[4 * q + 2] += v * wq.z;
            acc[4 * q + 3] += v * wq.w;
          }
        }
      }
    }
    if (ox < Wo && oy < Ho) {
      const i64 base = (i64)b * COUT * Ho * Wo + (i64)oy * Wo + ox;
#pragma unroll
      for (int o = 0; o < COUT; ++o) emit(y, bias, res, flags, base + (i64)o * Ho * Wo, o, acc[o]);
    }
  }
}

#endif  // tile

// ------------------------------------------------------------------------------------------ ocb4
#if VARIANT == 0 || VARIANT == 2
namespace ocb4 {
constexpr int TW = 16, TH = 8;                      // 16x8 output pixels per block
constexpr int OGB = imin(2, cdiv(COUT, 4));         // groups of 4 output channels per block (threadIdx.z)
constexpr int NO = 4 * OGB;                         // output channels per block
constexpr int NG = cdiv(COUT, NO);                  // output-channel blocks
constexpr int CK = imin(STRIDE == 1 ? 16 : 8, CIN);
constexpr int HH = (TH - 1) * STRIDE + 3, HW = (TW - 1) * STRIDE + 3;
}  // namespace ocb4

extern "C" __global__ void __launch_bounds__(256) conv3x3_ocb4(const u16* __restrict__ x, const u16* __restrict__ w,
                                                               const u16* __restrict__ bias, const u16* __restrict__ res,
                                                               u16* __restrict__ y, int B, int H, int W, int Ho, int Wo,
                                                               int flags) {
  using namespace ocb4;
  __shared__ float sh[CK * HH * HW];
  __shared__ __align__(16) float sw[CK * 9 * NO];
  const int tx = threadIdx.x, ty = threadIdx.y, g = threadIdx.z;
  const int nthr = TW * TH * OGB, tid = (g * TH + ty) * TW + tx;
  const int ox = blockIdx.x * TW + tx, oy = blockIdx.y * TH + ty;
  const int iy0 = blockIdx.y * TH * STRIDE - 1, ix0 = blockIdx.x * TW * STRIDE - 1;
  for (int z = blockIdx.z; z < B * NG; z += gridDim.z) {
    const int b = z / NG, oc0 = (z - b * NG) * NO;
    const u16* xb = x + (i64)b * CIN * H * W;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = 0; c0 < CIN; c0 += CK) {
      __syncthreads();
      stage_input<CK, HH, HW, HW>(sh, xb, c0, H, W, iy0, ix0, tid, nthr);
      stage_weights<CK, NO>(sw, w, c0, oc0, tid, nthr);
      __syncthreads();
#pragma unroll 4
      for (int c = 0; c < CK; ++c) {
        const float* s = sh + (c * HH + ty * STRIDE) * HW + tx * STRIDE;
        const float4* wv = reinterpret_cast<const float4*>(sw + c * 9 * NO) + g;
#pragma unroll
        for (int k = 0; k < 9; ++k) {
          const float v = s[(k / 3) * HW + k % 3];
          const float4 wq = wv[k * OGB];
          acc[0] += v * wq.x;
          acc[1] += v * wq.y;
          acc[2] += v * wq.z;
          acc[3] += v * wq.w;
        }
      }
    }
    if (ox < Wo && oy < Ho) {
      const i64 base = (i64)b * COUT * Ho * Wo + (i64)oy * Wo + ox;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int o = oc0 + 4 * g + j;
        if (o < COUT) emit(y, bias, res, flags, base + (i64)o * Ho * Wo, o, acc[j]);
      }
    }
  }
}

#endif  // ocb4

// ------------------------------------------------------------------------------------------ rb
#if VARIANT == 0 || VARIANT == 3
// Register-blocked, stride 1: each thread owns 2x2 output pixels x OCT output channels, so each
// shared-memory input value feeds up to OCT x 4 FMAs and each weight float4 feeds 16.
namespace rb {
constexpr int T = 16;                               // 16x16 output pixels per block = 8x8 threads
constexpr int OCT = COUT <= 4 ? 4 : 8;              // output channels per thread (4: no waste for 64->3)
constexpr int OGB = imin(4, cdiv(COUT, OCT));       // groups of OCT output channels per block (threadIdx.z)
constexpr int NO = OCT * OGB;
constexpr int NG = cdiv(COUT, NO);
constexpr int CK = imin(8, CIN);
constexpr int HT = T + 2;                           // 18: even, so float2 halo reads stay aligned
}  // namespace rb

extern "C" __global__ void __launch_bounds__(256) conv3x3_rb(const u16* __restrict__ x, const u16* __restrict__ w,
                                                             const u16* __restrict__ bias, const u16* __restrict__ res,
                                                             u16* __restrict__ y, int B, int H, int W, int Ho, int Wo,
                                                             int flags) {
#if STRIDE == 1
  using namespace rb;
  __shared__ __align__(16) float sh[CK * HT * HT];
  __shared__ __align__(16) float sw[CK * 9 * NO];
  const int tx = threadIdx.x, ty = threadIdx.y, g = threadIdx.z;
  const int nthr = 64 * OGB, tid = (g * 8 + ty) * 8 + tx;
  const int ox = blockIdx.x * T + 2 * tx, oy = blockIdx.y * T + 2 * ty;
  const int iy0 = blockIdx.y * T - 1, ix0 = blockIdx.x * T - 1;
  for (int z = blockIdx.z; z < B * NG; z += gridDim.z) {
    const int b = z / NG, oc0 = (z - b * NG) * NO;
    const u16* xb = x + (i64)b * CIN * H * W;
    float acc[2][2][OCT];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int o = 0; o < OCT; ++o) acc[i][j][o] = 0.f;
    for (int c0 = 0; c0 < CIN; c0 += CK) {
      __syncthreads();
      stage_input<CK, HT, HT, HT>(sh, xb, c0, H, W, iy0, ix0, tid, nthr);
      stage_weights<CK, NO>(sw, w, c0, oc0, tid, nthr);
      __syncthreads();
#pragma unroll 1
      for (int c = 0; c < CK; ++c) {
        float in[4][4];  // the 4x4 input patch under this thread's 2x2 outputs
        const float* s = sh + (c * HT + 2 * ty) * HT + 2 * tx;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 a = *reinterpret_cast<const float2*>(s + r * HT);
          const float2 d = *reinterpret_cast<const float2*>(s + r * HT + 2);
          in[r][0] = a.x, in[r][1] = a.y, in[r][2] = d.x, in[r][3] = d.y;
        }
        const float4* wv = reinterpret_cast<const float4*>(sw + c * 9 * NO) + (OCT / 4) * g;
#pragma unroll
        for (int k = 0; k < 9; ++k) {
          float wk[OCT];
#pragma unroll
          for (int q = 0; q < OCT / 4; ++q) {
            const float4 wq = wv[k * (NO / 4) + q];
            wk[4 * q] = wq.x, wk[4 * q + 1] = wq.y, wk[4 * q + 2] = wq.z, wk[4 * q + 3] = wq.w;
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const float v = in[i + k / 3][j + k % 3];
#pragma unroll
              for (int o = 0; o < OCT; ++o) acc[i][j][o] += v * wk[o];
            }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (oy + i >= Ho || ox + j >= Wo) continue;
        const i64 base = (i64)b * COUT * Ho * Wo + (i64)(oy + i) * Wo + ox + j;
#pragma unroll
        for (int o = 0; o < OCT; ++o) {
          const int oc = oc0 + OCT * g + o;
          if (oc < COUT) emit(y, bias, res, flags, base + (i64)oc * Ho * Wo, oc, acc[i][j][o]);
        }
      }
  }
#endif
}
#endif  // rb
