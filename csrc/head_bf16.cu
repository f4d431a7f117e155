// head_stencil: second half of the split Wan-head conv (see taesd_fast/kernels/split_bf16.py and head_stencil.py).
//
//   out[b, t, r, w, c] = clamp(bias[c] + sum_{i,j} g[b, t, h+i-1 (as g row), w+j-1, (i*3+j)*NCH + c], -1, 1)
//
// with h = lo + r the global row. Taps that fall outside the true image (row < 0, row >= H_global,
// col < 0, col >= W) are the conv's zero padding and are masked to 0. g holds global rows
// [g_start, g_start + rows_g); the Python wrapper has already checked that every in-image row a band
// needs is in there; the clamps below only keep a bad call from reading out of bounds. g may be strided
// (pixel-major from the GEMM form of conv_n128): strides must be multiples of 4 elements.
//
// Defines: NCH (output channels, e.g. 12), GC (g channel stride, e.g. 112 >= 9*NCH), G_F32 (1: g and
// out are f32; 0: bf16), PATCH (0: out is [B, T, rows, W, NCH]; p >= 1: out is the unpatchified video
// [B, NCH/p^2, T, rows*p, W*p] contiguous, channel (c*p + s)*p + q going to row offset q and column
// offset s, so OutputHead's rearrange, a copy of the whole output, is not needed). One thread per output
// pixel: the 9 taps of one pixel are 9 short segments of 9 neighbouring g pixels, and neighbouring
// threads reuse each other's sectors through L1/L2, so DRAM sees g about once.
// Grid: (ceil(rows*W / 256), T, B).

#ifndef NCH
#define NCH 12
#endif
#ifndef GC
#define GC 112
#endif
#ifndef G_F32
#define G_F32 0
#endif
#ifndef PATCH
#define PATCH 0
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

__device__ __forceinline__ void hs_load4(float* v4, const gtype* p) {
#if G_F32
  hs_v4f v = *reinterpret_cast<const hs_v4f*>(p);
  v4[0] = v.a; v4[1] = v.b; v4[2] = v.c; v4[3] = v.d;
#else
  hs_v4bf v = *reinterpret_cast<const hs_v4bf*>(p);
  v4[0] = u2f(v.a << 16); v4[1] = u2f(v.a & 0xffff0000u);
  v4[2] = u2f(v.b << 16); v4[3] = u2f(v.b & 0xffff0000u);
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

#if PATCH
// out[b, c, t, r*PATCH + q, w*PATCH + s] = acc[(c*PATCH + s)*PATCH + q] (the rearrange
// "b (c s q) t h w -> b c t (h q) (w s)"). With PATCH 2 the two column offsets of a row are one 4- or
// 8-byte store, and a warp's 32 pixels write 128 or 256 contiguous bytes per (c, q).
__device__ __forceinline__ void store_video(gtype* out, const float* acc, int b, int t, int r, int w, int rows,
                                            int W) {
  constexpr int P = PATCH, COUT = NCH / (PATCH * PATCH);
  const int T = gridDim.y;
  const i64 row_len = (i64)W * P, frame = (i64)rows * P * row_len;
#pragma unroll
  for (int c = 0; c < COUT; ++c) {
#pragma unroll
    for (int q = 0; q < P; ++q) {
      gtype* o = out + ((i64)b * COUT + c) * T * frame + t * frame + (i64)(r * P + q) * row_len + (i64)w * P;
#if PATCH == 2
      const float left = hs_clamp(acc[(c * P) * P + q]), right = hs_clamp(acc[(c * P + 1) * P + q]);
#if G_F32
      *reinterpret_cast<float2*>(o) = make_float2(left, right);
#else
      *reinterpret_cast<u32*>(o) = pack_bf16x2(left, right);
#endif
#else
#pragma unroll
      for (int s = 0; s < P; ++s) {
#if G_F32
        o[s] = hs_clamp(acc[(c * P + s) * P + q]);
#else
        o[s] = f2bf(hs_clamp(acc[(c * P + s) * P + q]));
#endif
      }
#endif
    }
  }
}
#endif

extern "C" __global__ void __launch_bounds__(256) head_stencil(
    const gtype* __restrict__ g,     // [B, T, rows_g, W, GC], strides gs_* in elements, channels dense
    const float* __restrict__ bias,  // [NCH] f32
    gtype* __restrict__ out,         // [B, T, rows, W, NCH] dense, or the video (PATCH)
    int rows, int W, int rows_g, int lo, int H_global, int g_start,
    i64 gs_b, i64 gs_t, i64 gs_row, i64 gs_w) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;  // pixel inside one frame's band
  if (p >= rows * W) return;
  const int t = blockIdx.y, b = blockIdx.z;
  const int r = p / W;
  const int w = p - r * W;
  const int h = lo + r;

  float acc[NCH];
#pragma unroll
  for (int c = 0; c < NCH; ++c) acc[c] = bias[c];

  // Every tap loads from an in-bounds (clamped) address and is masked afterwards: no branches around
  // the loads, so all 9 taps' loads can be in flight at once.
  const gtype* gbt = g + b * gs_b + t * gs_t;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const int hs = h + i - 1;
    const int gr = hs - g_start;
    const bool vr = hs >= 0 && hs < H_global && gr >= 0 && gr < rows_g;
    const gtype* grow = gbt + (i64)min(max(gr, 0), rows_g - 1) * gs_row;
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const int ws = w + j - 1;
      const bool v = vr && ws >= 0 && ws < W;
      const gtype* src = grow + (i64)min(max(ws, 0), W - 1) * gs_w + (i * 3 + j) * NCH;
      float tap[NCH];
#if HS_VEC
#pragma unroll
      for (int c = 0; c < NCH; c += 4) hs_load4(tap + c, src + c);
#else
#pragma unroll
      for (int c = 0; c < NCH; ++c) tap[c] = hs_load1(src + c);
#endif
#pragma unroll
      for (int c = 0; c < NCH; ++c) acc[c] += v ? tap[c] : 0.f;
    }
  }

#if PATCH
  store_video(out, acc, b, t, r, w, rows, W);
#else
  gtype* o = out + ((i64)(b * gridDim.y + t) * rows * W + p) * NCH;
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
    v.a = pack_bf16x2(hs_clamp(acc[c]), hs_clamp(acc[c + 1]));
    v.b = pack_bf16x2(hs_clamp(acc[c + 2]), hs_clamp(acc[c + 3]));
    *reinterpret_cast<hs_v4bf*>(o + c) = v;
  }
#else
#pragma unroll
  for (int c = 0; c < NCH; ++c) o[c] = f2bf(hs_clamp(acc[c]));
#endif
#endif
}
