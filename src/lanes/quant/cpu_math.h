// Vector math for the CPU kernels, the same instructions for every lane: a value's result never depends on
// where in a tensor it sits (unlike a vector loop with a scalar tail, or a split across threads).
#pragma once

#include <immintrin.h>
#include <cstdint>

#include "cpu_vec.h"

namespace lanes_quant {

// e^x for x <= 0: 2^n * p(r), r = x - n ln2, p of degree 7 (Taylor; its error is 5e-9 of the value).
inline V16 exp_nonpositive(V16 x) {
  x = vmax(x, vset(-104.0f));  // below this e^x is 0 in fp32 anyway
  const V16 n = vround(vmul(x, vset(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset(0.693145751953125f), x);
  r = vfnmadd(n, vset(1.428606765330187045e-06f), r);
  V16 p = vset(1.0f / 5040);
  p = vfmadd(p, r, vset(1.0f / 720));
  p = vfmadd(p, r, vset(1.0f / 120));
  p = vfmadd(p, r, vset(1.0f / 24));
  p = vfmadd(p, r, vset(1.0f / 6));
  p = vfmadd(p, r, vset(0.5f));
  p = vfmadd(p, r, vset(1.0f));
  p = vfmadd(p, r, vset(1.0f));
  return vscale2(p, n);
}

// x * sigmoid(x) as x / (1 + e^-x), and x e^x / (1 + e^x) below 0, so that e^-|x| never overflows.
inline V16 silu(V16 x) {
  const V16 e = exp_nonpositive(vsub(vzero(), vabs(x)));
  const V16 top = vselect(vless(x, vzero()), vmul(x, e), x);
  return vdiv(top, vadd(vset(1.0f), e));
}

#ifdef __AVX512F__
// Lane 4k + j of the result: v[4j + k]'s lanes summed, by the tree _mm512_reduce_add_ps uses (lane i with
// i + 8, then + 4, + 2, + 1), so each sum has its bits; 45 shuffles and adds for 16 sums instead of 128.
__attribute__((always_inline)) inline __m512 lane_sums(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // halves: v[2i]'s in the low 256 bits, v[2i+1]'s in the high
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: v[4i + k]'s in 128-bit block k
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: v[8i + k]'s two lanes, then v[8i + 4 + k]'s
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

inline int lane_of_sum(int i) { return 4 * (i % 4) + i / 4; }  // where lane_sums puts v[i]'s sum

// sums[i]: v[i]'s lanes summed by vsum's tree, for the first `count` of v (the rest may be anything).
__attribute__((always_inline)) inline void lane_sums_of(const V16 (&v)[16], int count, float* sums) {
  alignas(64) float placed[16];
  _mm512_store_ps(placed, lane_sums(v));
  for (int i = 0; i < count; ++i) sums[i] = placed[lane_of_sum(i)];
}
#else
// The same sums on AVX2: a few by vsum each, 16 by one transposing tree of vsum's order (i + 8, + 4, + 2, + 1).
__attribute__((always_inline)) inline void lane_sums_of(const V16 (&v)[16], int count, float* sums) {
  if (count <= 4) {
    for (int i = 0; i < count; ++i) sums[i] = vsum(v[i]);
    return;
  }
  __m256 s[16], u[8], w[4];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].hi, v[i].lo);
  for (int i = 0; i < 8; ++i)  // 128-bit halves: s[2i]'s + 4 in the low one, s[2i+1]'s in the high
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20), _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
  for (int i = 0; i < 4; ++i)  // + 2 within each half
    w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // v[8k + 2j]'s sum lies in lane j, v[8k + 2j + 1]'s in 4 + j
  for (int k = 0; k < 2; ++k) {  // + 1
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(w[2 * k], w[2 * k + 1], 0x88), _mm256_shuffle_ps(w[2 * k], w[2 * k + 1], 0xDD));
    alignas(32) float placed[8];
    _mm256_store_ps(placed, _mm256_permutevar8x32_ps(f, natural));
    for (int i = 8 * k; i < count && i < 8 * k + 8; ++i) sums[i] = placed[i - 8 * k];
  }
}
#endif

// One head of `dim` values rotated (RoPE, the half-split form): x * cos + rotate_half(x) * sin with the
// reference's roundings (a product, a product, a sum: no fma), so the values equal the torch ops' bit for bit.
inline void rotate_head(const float* v, const float* ct, const float* st, int64_t dim, float* o) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const Mask16 m = lanes_from(half, i);
    const V16 a = load_lanes(m, v + i), b = load_lanes(m, v + half + i);
    // first half: a cos - b sin, as a * cos + (-b) * sin; second half: b cos + a sin
    const V16 first = vadd(vmul_rounded(a, load_lanes(m, ct + i)), vmul_rounded(vsub(vzero(), b), load_lanes(m, st + i)));
    const V16 second = vadd(vmul_rounded(b, load_lanes(m, ct + half + i)), vmul_rounded(a, load_lanes(m, st + half + i)));
    store_lanes(o + i, m, first);
    store_lanes(o + half + i, m, second);
  }
}

}  // namespace lanes_quant
