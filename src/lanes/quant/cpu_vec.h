// Sixteen fp32 lanes for the fp32 kernels, on AVX-512 (one __m512) or on AVX2 with FMA (two __m256): the
// kernels are written once over V16, and a value's arithmetic is the same instructions on every lane. On
// AVX-512 each op is the one intrinsic the kernels used before, so their bits are unchanged; an AVX2 build
// (compiled with -ffp-contract=off, so only the explicit fmas fuse) has its own, equally fixed, bits.
#pragma once

#include <immintrin.h>
#include <cstdint>

namespace lanes_quant {

using Mask16 = uint16_t;  // a bit a lane, as __mmask16

inline Mask16 lanes_from(int64_t count, int64_t i) {  // lanes of [i, i + 16) below count
  return static_cast<Mask16>(count - i >= 16 ? 0xFFFF : (1u << (count - i)) - 1);
}

#ifdef __AVX512F__

using V16 = __m512;
using I16 = __m512i;

inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset(float a) { return _mm512_set1_ps(a); }
inline V16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 vload_masked(Mask16 m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_masked(float* p, Mask16 m, V16 v) { _mm512_mask_storeu_ps(p, m, v); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vdiv(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vabs(V16 a) { return _mm512_abs_ps(a); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
inline V16 vround(V16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V16 vscale2(V16 p, V16 n) { return _mm512_scalef_ps(p, n); }  // p 2^n for whole n
// A product the compiler may not fuse with an add (GCC contracts vector intrinsics by default).
inline V16 vmul_rounded(V16 a, V16 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Mask16 vless(V16 a, V16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask16 vgreater(V16 a, V16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask16 vequal(V16 a, V16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask16 vnan(V16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline V16 vselect(Mask16 m, V16 a, V16 b) { return _mm512_mask_mov_ps(b, m, a); }  // a where m, else b
inline V16 vkeep(Mask16 m, V16 a) { return _mm512_maskz_mov_ps(m, a); }  // a where m, else 0
inline float vsum(V16 a) { return _mm512_reduce_add_ps(a); }  // lane i with i + 8, then + 4, + 2, + 1
inline float vtop(V16 a) { return _mm512_reduce_max_ps(a); }
inline I16 iramp() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline I16 iadd16(I16 a) { return _mm512_add_epi32(a, _mm512_set1_epi32(16)); }
inline I16 iselect(Mask16 m, I16 a, I16 b) { return _mm512_mask_mov_epi32(b, m, a); }
inline int32_t ileast(Mask16 m, I16 a) { return _mm512_mask_reduce_min_epi32(m, a); }

#else  // AVX2 with FMA

struct V16 { __m256 lo, hi; };
struct I16 { __m256i lo, hi; };

// A lane mask's 8 bits as a vector mask (all ones where set), for blends and masked moves.
inline __m256i half_mask(unsigned bits) {
  const __m256i each = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), each), each);
}
inline Mask16 bits_of(__m256 lo, __m256 hi) {
  return static_cast<Mask16>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
inline V16 vload_masked(Mask16 m, const float* p) {
  return {_mm256_maskload_ps(p, half_mask(m & 0xFF)), _mm256_maskload_ps(p + 8, half_mask(m >> 8))};
}
inline void vstore_masked(float* p, Mask16 m, V16 v) {
  _mm256_maskstore_ps(p, half_mask(m & 0xFF), v.lo);
  _mm256_maskstore_ps(p + 8, half_mask(m >> 8), v.hi);
}
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vabs(V16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vround(V16 a) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, nearest), _mm256_round_ps(a.hi, nearest)};
}
// p 2^n for whole n in [-150, 0] (exp_nonpositive's range): 2^n as two normal powers of two, the second
// 1 unless n < -126, so that the product is exact wherever the result is a normal float.
inline __m256 scale2_half(__m256 p, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i first = _mm256_max_epi32(whole, _mm256_set1_epi32(-126));
  const __m256i second = _mm256_sub_epi32(whole, first);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, bias), 23));
  const __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
inline V16 vscale2(V16 p, V16 n) { return {scale2_half(p.lo, n.lo), scale2_half(p.hi, n.hi)}; }
inline V16 vmul_rounded(V16 a, V16 b) { return vmul(a, b); }  // this build does not contract
inline Mask16 vless(V16 a, V16 b) { return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ)); }
inline Mask16 vgreater(V16 a, V16 b) { return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)); }
inline Mask16 vequal(V16 a, V16 b) { return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ)); }
inline Mask16 vnan(V16 a) { return bits_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)); }
inline V16 vselect(Mask16 m, V16 a, V16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(half_mask(m & 0xFF))),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(half_mask(m >> 8)))};
}
inline V16 vkeep(Mask16 m, V16 a) { return vselect(m, a, vzero()); }
// The tree _mm512_reduce_add_ps uses: lane i with i + 8, then + 4, + 2, + 1.
inline float vsum(V16 a) {
  const __m256 eight = _mm256_add_ps(a.hi, a.lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
inline float vtop(V16 a) {
  const __m256 eight = _mm256_max_ps(a.hi, a.lo);
  const __m128 four = _mm_max_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
}
inline I16 iramp() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline I16 iadd16(I16 a) {
  const __m256i step = _mm256_set1_epi32(16);
  return {_mm256_add_epi32(a.lo, step), _mm256_add_epi32(a.hi, step)};
}
inline I16 iselect(Mask16 m, I16 a, I16 b) {
  return {_mm256_blendv_epi8(b.lo, a.lo, half_mask(m & 0xFF)), _mm256_blendv_epi8(b.hi, a.hi, half_mask(m >> 8))};
}
inline int32_t ileast(Mask16 m, I16 a) {  // the least of the lanes in m (m not empty)
  alignas(32) int32_t values[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(values), a.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(values + 8), a.hi);
  int32_t least = INT32_MAX;
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1 && values[i] < least) least = values[i];
  return least;
}

#endif

// The lanes `m` of 16 floats at p (the rest 0), and their store: plain when all 16 are wanted, since masked
// loads cost here (attention's scores over a 64-wide head: 23 -> 18 cycles a key and head without them).
inline V16 load_lanes(Mask16 m, const float* p) { return m == 0xFFFF ? vload(p) : vload_masked(m, p); }
inline void store_lanes(float* p, Mask16 m, V16 v) {
  if (m == 0xFFFF) vstore(p, v);
  else vstore_masked(p, m, v);
}

}  // namespace lanes_quant
