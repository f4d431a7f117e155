// head_stencil: second half of the split Wan-head conv (see taesd_fast/kernels/head.py).
//
//   out[d, r, w, c] = clamp(bias[c] + sum_{i,j} g[d, h+i-1 (as g row), w+j-1, (i*3+j)*NCH + c], -1, 1)
//
// with h = lo + r the global row. Taps that fall outside the true image (row < 0, row >= H_global,
// col < 0, col >= W) are the conv's zero padding and are skipped. g holds global rows
// [g_start, g_start + rows_g); the Python wrapper has already checked that every in-image row a band
// needs is in there, the row guard below only keeps a bad call from reading out of bounds.
//
// Defines: NCH (output channels, e.g. 12), GC (g channel stride, e.g. 112 >= 9*NCH), G_F32 (1: g and
// out are f32; 0: bf16). One thread per output pixel: the 9 taps of one pixel are 9 short segments of
// 9 neighbouring g pixels, and neighbouring threads reuse each other's sectors through L1, so DRAM sees
// g about once.

#ifndef NCH
#define NCH 12
#endif
#ifndef GC
#define GC 112
#endif
#ifndef G_F32
#define G_F32 0
#endif

#if G_F32
typedef float gtype;
#else
typedef u16 gtype;
#endif

// 4 channels per vector when the segments allow it: 8 bytes (bf16) / 16 bytes (f32).
#define HS_VEC ((NCH % 4 == 0) && (GC % 4 == 0))

struct alignas(8) hs_v4bf { u32 a, b; };
struct alignas(16) hs_v4f { float a, b, c, d; };

__device__ __forceinline__ void hs_add4(float* acc, const gtype* p) {
#if G_F32
  hs_v4f v = *reinterpret_cast<const hs_v4f*>(p);
  acc[0] += v.a; acc[1] += v.b; acc[2] += v.c; acc[3] += v.d;
#else
  hs_v4bf v = *reinterpret_cast<const hs_v4bf*>(p);
  acc[0] += u2f(v.a << 16); acc[1] += u2f(v.a & 0xffff0000u);
  acc[2] += u2f(v.b << 16); acc[3] += u2f(v.b & 0xffff0000u);
#endif
}

__device__ __forceinline__ float hs_load1(const gtype* p) {
#if G_F32
  return *p;
#else
  return bf2f(*p);
#endif
}

// NaN-propagating clamp, like torch.clamp.
__device__ __forceinline__ float hs_clamp(float v) { return v < -1.f ? -1.f : (v > 1.f ? 1.f : v); }

__device__ __forceinline__ u32 hs_pack_bf2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

extern "C" __global__ void __launch_bounds__(256) head_stencil(
    const gtype* __restrict__ g,     // [D, rows_g, W, GC]
    const float* __restrict__ bias,  // [NCH] f32
    gtype* __restrict__ out,         // [D, rows, W, NCH]
    int rows, int W, int rows_g, int lo, int H_global, int g_start) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;  // pixel inside one frame's band
  if (p >= rows * W) return;
  const int d = blockIdx.y;
  const int r = p / W;
  const int w = p - r * W;
  const int h = lo + r;

  float acc[NCH];
#pragma unroll
  for (int c = 0; c < NCH; ++c) acc[c] = bias[c];

  const gtype* gd = g + (i64)d * rows_g * W * GC;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const int hs = h + i - 1;
    const int gr = hs - g_start;
    if (hs < 0 || hs >= H_global || gr < 0 || gr >= rows_g) continue;
    const gtype* grow = gd + (i64)gr * W * GC;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int ws = w + j - 1;
      if (ws < 0 || ws >= W) continue;
      const gtype* src = grow + (i64)ws * GC + (i * 3 + j) * NCH;
#if HS_VEC
#pragma unroll
      for (int c = 0; c < NCH; c += 4) hs_add4(acc + c, src + c);
#else
#pragma unroll
      for (int c = 0; c < NCH; ++c) acc[c] += hs_load1(src + c);
#endif
    }
  }

  gtype* o = out + ((i64)d * rows * W + p) * NCH;
#if G_F32 && HS_VEC
#pragma unroll
  for (int c = 0; c < NCH; c += 4) {
    hs_v4f v = {hs_clamp(acc[c]), hs_clamp(acc[c + 1]), hs_clamp(acc[c + 2]), hs_clamp(acc[c + 3])};
    *reinterpret_cast<hs_v4f*>(o + c) = v;
  }
#elif G_F32
#pragma unroll
  for (int c = 0; c < NCH; ++c) o[c] = hs_clamp(acc[c]);
#elif HS_VEC
#pragma unroll
  for (int c = 0; c < NCH; c += 4) {
    hs_v4bf v;
    v.a = hs_pack_bf2(hs_clamp(acc[c]), hs_clamp(acc[c + 1]));
    v.b = hs_pack_bf2(hs_clamp(acc[c + 2]), hs_clamp(acc[c + 3]));
    *reinterpret_cast<hs_v4bf*>(o + c) = v;
  }
#else
#pragma unroll
  for (int c = 0; c < NCH; ++c) o[c] = f2bf(hs_clamp(acc[c]));
#endif
}
