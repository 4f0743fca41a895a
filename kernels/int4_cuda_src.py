"""The CUDA C of the cuda_mma int4 kernel (kernels.int4_cuda: its layout, launch shapes and binding).

One template, w4a16<MT, NT, WARPS, U>; kernels.int4_cuda appends one extern "C" entry per compiled launch shape.
No headers: the few intrinsics it needs are inline PTX or NVRTC built-ins (atomicAdd, __threadfence, __ldg), so NVRTC
compiles it without a CUDA toolkit's include dir.
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
#define DEVI __device__ __forceinline__

DEVI uint4 ld_stream(const uint4* p) {  // weights: read once, keep L1 for x
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
DEVI u32 and_or(u32 a, u32 b, u32 c) {  // (a & b) | c
  u32 r; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
DEVI u32 bf2_fma(u32 a, u32 b, u32 c) {
  u32 r; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c)); return r;
}
DEVI float h2f(u32 h) {
  float f; u16 s = (u16)(h & 0xFFFF); asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s)); return f;
}
DEVI u16 f2bf(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
DEVI void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
DEVI u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }
DEVI float ld_l2(const float* p) {  // another block's partial: from L2, never a stale L1 line
  float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p)); return v;
}

// Word j of a lane's 16-byte weight load -> the A fragment of MMA j (16 k): nibble pairs to bf16 128 + u by one
// LOP3, then + z = -(128 + zq) by one bf16x2 FMA (exact); z_lo / z_hi for rows g / g + 8 from zero_of.
DEVI u32 zero_of(u32 meta) { return (0xC300u | (meta >> 16)) * 0x10001u; }  // meta = scale | zq << 16
DEVI void frag(u32 q, u32 z_lo, u32 z_hi, u32 (&a)[4]) {
  const u32 ONE = 0x3F803F80u;  // bf16x2 (1, 1)
  a[0] = bf2_fma(and_or(q, 0x000F000Fu, 0x43004300u), ONE, z_lo);
  a[1] = bf2_fma(and_or(q >> 4, 0x000F000Fu, 0x43004300u), ONE, z_hi);
  a[2] = bf2_fma(and_or(q >> 8, 0x000F000Fu, 0x43004300u), ONE, z_lo);
  a[3] = bf2_fma(and_or(q >> 12, 0x000F000Fu, 0x43004300u), ONE, z_hi);
}
// acc += part * the 64 k's scales (rows g: s_lo, g + 8: s_hi): the scale never rounds the weight.
DEVI void scale_into(float (&acc)[4], const float (&part)[4], float s_lo, float s_hi) {
  acc[0] += part[0] * s_lo;
  acc[1] += part[1] * s_lo;
  acc[2] += part[2] * s_hi;
  acc[3] += part[3] * s_hi;
}

// Row r of a block's partials (tile i, token tile mt, accumulator q) in lane l: its token and output feature.
template <int MT>
DEVI void out_at(int r, int l, int b0, int& tok, int& n) {
  const int q = r & 3, mt = (r >> 2) % MT, i = (r >> 2) / MT;
  tok = 8 * mt + 2 * (l & 3) + (q & 1);
  n = 16 * (b0 + i) + (l >> 2) + 8 * (q >> 1);
}

// qw [N/16, K/64, 32, 4]; meta [K/G, N] (fp16 scale | zq << 16); x [M, x_stride] bf16; y [M, N] bf16.
// A block: NT tiles of 16 features (x fragments reused across them), MT tiles of 8 tokens, WARPS shares of its
// split of K (blockIdx.y of `splits`). With splits > 1 each block parks its fp32 sums in ws [splits, M, N]; the
// last of a column's blocks to finish (counted in cnt[blockIdx.x], left at zero) adds them in split order.
template <int MT, int NT, int WARPS, int U>
DEVI void w4a16(const uint4* __restrict__ qw, const u32* __restrict__ meta, const u16* __restrict__ x,
                const u16* __restrict__ bias, u16* __restrict__ y, float* ws, int* cnt, int M, int K, int N,
                int x_stride, int group_shift, int has_bias, int splits) {
  __shared__ float red[WARPS][NT * MT * 4][32];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int chunks = K >> 6, b0 = blockIdx.x * NT, per_split = chunks / splits;
  const int c_begin = blockIdx.y * per_split, c_end = c_begin + per_split;
  const uint4* wp = qw + (size_t)b0 * chunks * 32 + lane;
  float acc[NT][MT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[i][mt][0] = acc[i][mt][1] = acc[i][mt][2] = acc[i][mt][3] = 0.f;

  for (int c0 = c_begin + warp * U; c0 < c_end; c0 += WARPS * U) {
    uint4 wv[U][NT], xv[U][MT][2];
    u32 m_lo[U][NT], m_hi[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u;
      const u32* mrow = meta + (size_t)((unsigned)c >> group_shift) * N + 16 * b0 + g;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        wv[u][i] = ld_stream(wp + ((size_t)i * chunks + c) * 32);
        m_lo[u][i] = __ldg(mrow + 16 * i);
        m_hi[u][i] = __ldg(mrow + 16 * i + 8);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int tok = 8 * mt + g;
        if (tok < M) {
          const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)tok * x_stride + 64 * c + 16 * t);
          xv[u][mt][0] = __ldg(xp);
          xv[u][mt][1] = __ldg(xp + 1);
        } else {
          xv[u][mt][0] = xv[u][mt][1] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const u32 z_lo = zero_of(m_lo[u][i]), z_hi = zero_of(m_hi[u][i]);
        float part[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) part[mt][0] = part[mt][1] = part[mt][2] = part[mt][3] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          u32 a[4];
          frag(word(wv[u][i], j), z_lo, z_hi, a);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint4& xa = xv[u][mt][j >> 1];
            mma(part[mt], a[0], a[1], a[2], a[3], word(xa, 2 * (j & 1)), word(xa, 2 * (j & 1) + 1));
          }
        }
        const float s_lo = h2f(m_lo[u][i]), s_hi = h2f(m_hi[u][i]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) scale_into(acc[i][mt], part[mt], s_lo, s_hi);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) red[warp][(i * MT + mt) * 4 + q][lane] = acc[i][mt][q];
  __syncthreads();
  for (int e = threadIdx.x; e < NT * MT * 4 * 32; e += WARPS * 32) {
    const int r = e >> 5, l = e & 31;
    int tok, n;
    out_at<MT>(r, l, b0, tok, n);
    if (tok < M) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) s += red[w][r][l];
      if (splits > 1) {
        ws[((size_t)blockIdx.y * M + tok) * N + n] = s;
      } else {
        if (has_bias) s += __uint_as_float(((u32)bias[n]) << 16);
        y[(size_t)tok * N + n] = f2bf(s);
      }
    }
  }
  if (splits == 1) return;
  __threadfence();  // this thread's partials reach L2 before the counter says so
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(cnt + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e < NT * MT * 4 * 32; e += WARPS * 32) {
    int tok, n;
    out_at<MT>(e >> 5, e & 31, b0, tok, n);
    if (tok < M) {
      float s = 0.f;
      for (int sp = 0; sp < splits; ++sp) s += ld_l2(ws + ((size_t)sp * M + tok) * N + n);  // fixed order
      if (has_bias) s += __uint_as_float(((u32)bias[n]) << 16);
      y[(size_t)tok * N + n] = f2bf(s);
    }
  }
  if (threadIdx.x == 0) cnt[blockIdx.x] = 0;  // ready for the next launch
}
"""
