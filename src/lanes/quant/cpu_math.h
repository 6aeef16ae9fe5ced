// Vector math for the CPU kernels, the same instructions for every lane: a value's result never depends on
// where in a tensor it sits (unlike a vector loop with a scalar tail, or a split across threads).
#pragma once

#include <immintrin.h>
#include <cstdint>

namespace lanes_quant {

// e^x for x <= 0: 2^n * p(r), r = x - n ln2, p of degree 7 (Taylor; its error is 5e-9 of the value).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // below this e^x is 0 in fp32 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x * sigmoid(x) as x / (1 + e^-x), and x e^x / (1 + e^x) below 0, so that e^-|x| never overflows.
inline __m512 silu(__m512 x) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 top = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(top, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __mmask16 lanes_from(int64_t count, int64_t i) {  // lanes of [i, i + 16) below count
  return static_cast<__mmask16>(count - i >= 16 ? 0xFFFF : (1u << (count - i)) - 1);
}

// The lanes `m` of 16 floats at p (the rest 0), and their store: plain when all 16 are wanted, since masked
// loads cost here (attention's scores over a 64-wide head: 23 -> 18 cycles a key and head without them).
inline __m512 load_lanes(__mmask16 m, const float* p) { return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); }
inline void store_lanes(float* p, __mmask16 m, __m512 v) {
  if (m == 0xFFFF) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, m, v);
}

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

// Products with their rounding spelled out: the compiler may not fuse these into an fma, as it would a
// plain multiply and add (GCC contracts vector intrinsics by default).
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline __m512 mul_rounded(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kNearest); }

// One head of `dim` values rotated (RoPE, the half-split form): x * cos + rotate_half(x) * sin with the
// reference's roundings (a product, a product, a sum: no fma), so the values equal the torch ops' bit for bit.
inline void rotate_head(const float* v, const float* ct, const float* st, int64_t dim, float* o) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes_from(half, i);
    const __m512 a = load_lanes(m, v + i), b = load_lanes(m, v + half + i);
    // first half: a cos - b sin, as a * cos + (-b) * sin; second half: b cos + a sin
    const __m512 first = _mm512_add_ps(mul_rounded(a, load_lanes(m, ct + i)),
                                       mul_rounded(_mm512_sub_ps(_mm512_setzero_ps(), b), load_lanes(m, st + i)));
    const __m512 second = _mm512_add_ps(mul_rounded(b, load_lanes(m, ct + half + i)), mul_rounded(a, load_lanes(m, st + half + i)));
    store_lanes(o + i, m, first);
    store_lanes(o + half + i, m, second);
  }
}

}  // namespace lanes_quant
