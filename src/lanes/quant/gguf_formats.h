// The K-quant GGUF block formats decoded with AVX-512, 32 values of a row at a time.
//
// A format has `scales(row, groups, g0, count, scale, offset)`, which writes the fp32 scale(s) and offset of groups
// [g0, g0 + count) of a row, and `group(row, g, scale, offset, w0, w1)`, which decodes values 32g .. 32g+31
// into two vectors given its group's scale and offset. Values equal the gguf package's dequantization
// exactly: each is one rounding of an exact product of an f16 scale and a small integer, plus an offset,
// which is also what an fma gives. 4- and 5-bit formats look values up in a table of the group's 16 (32)
// possible values (vpermps uses the low 4 bits of an index, so a byte's low nibble needs no mask).
#pragma once

#include <immintrin.h>
#include <cstdint>
#include <cstring>

namespace lanes_quant {

inline uint16_t bits16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline float f16(const uint8_t* p) { return _cvtsh_ss(bits16(p)); }

inline __m512i bytes16(const uint8_t* p) {  // 16 bytes widened to 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512i shifted(__m512i v, int shift) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)); }

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// The 6-bit scales and mins of a Q4_K / Q5_K super-block (llama.cpp's get_scale_min_k4, unpacked 32 bits
// at a time as its utmp does), as (d * sc, -(dmin * m)) for its 8 groups.
inline void scales_k4(const uint8_t* block, float* scale, float* offset) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, block + 4, 12);
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
  const uint32_t mins = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  u[2] = mins;
  u[0] &= low6;  // now bytes 0..7 are sc[0..7], bytes 8..15 are m[0..7]
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2))));
  _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(f16(block)), sc));
  // negated by the sign bit, as -(dmin * m) is: a zero minimum stays -0, so d * q - 0 keeps its sign of zero
  _mm256_storeu_ps(offset, _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(_mm256_set1_ps(f16(block + 2)), m)));
}

// Groups [g0, g0 + count) of a K-quant row from whole super-blocks (g0 and count are multiples of 8).
template <int64_t Bytes>
inline void scales_k4_row(const uint8_t* row, int64_t g0, int64_t count, float* scale, float* offset) {
  for (int64_t i = 0; i < count; i += 8) scales_k4(row + (g0 + i) / 8 * Bytes, scale + i, offset + i);
}

// Q4_K: 256 values: f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles (32 bytes a pair of groups,
// low nibbles the even one); value (d * sc) * q - dmin * m.
struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144, kScales = 1;
  static inline void scales(const uint8_t* row, int64_t, int64_t g0, int64_t count, float* scale, float* offset) {
    scales_k4_row<kBytes>(row, g0, count, scale, offset);
  }
  static inline void group(const uint8_t* row, int64_t g, const float* scale, const float* offset, __m512& w0, __m512& w1) {
    const __m512 table = _mm512_fmadd_ps(iota16(), _mm512_set1_ps(scale[0]), _mm512_set1_ps(offset[0]));
    const int j = static_cast<int>(g & 7);
    const uint8_t* qs = row + (g >> 3) * kBytes + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    w0 = _mm512_permutexvar_ps(shifted(bytes16(qs), shift), table);
    w1 = _mm512_permutexvar_ps(shifted(bytes16(qs + 16), shift), table);
  }
};

// Q5_K: as Q4_K with a fifth bit: bit j of qh[l] is the high bit of value l of group j; values 16..31
// come from a second table, chosen by that bit.
struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176, kScales = 1;
  static inline void scales(const uint8_t* row, int64_t, int64_t g0, int64_t count, float* scale, float* offset) {
    scales_k4_row<kBytes>(row, g0, count, scale, offset);
  }
  static inline void group(const uint8_t* row, int64_t g, const float* scale, const float* offset, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(scale[0]), m = _mm512_set1_ps(offset[0]);
    const __m512 low = _mm512_fmadd_ps(iota16(), d, m);
    const __m512 high = _mm512_fmadd_ps(_mm512_add_ps(iota16(), _mm512_set1_ps(16.0f)), d, m);
    const int j = static_cast<int>(g & 7);
    const uint8_t* b = row + (g >> 3) * kBytes;
    const uint8_t* qs = b + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    const __m512i bit = _mm512_set1_epi32(1 << j);
    const __mmask16 h0 = _mm512_test_epi32_mask(bytes16(b + 16), bit), h1 = _mm512_test_epi32_mask(bytes16(b + 32), bit);
    const __m512i i0 = shifted(bytes16(qs), shift), i1 = shifted(bytes16(qs + 16), shift);
    w0 = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i0, low), h0, i0, high);
    w1 = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i1, low), h1, i1, high);
  }
};

// Q6_K: 256 values: ql[128] (low nibbles), qh[64] (2 high bits), int8 scales[16] (one a 16 values), f16 d;
// value (d * sc) * (q - 32). Group j of a super-block: half j/4, nibble and bit pair chosen by j%4.
struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210, kScales = 2;
  static inline void scales(const uint8_t* row, int64_t, int64_t g0, int64_t count, float* scale, float*) {
    for (int64_t i = 0; i < count; i += 8) {
      const uint8_t* b = row + (g0 + i) / 8 * kBytes;
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
      _mm512_storeu_ps(scale + 2 * i, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), sc));
    }
  }
  static inline void group(const uint8_t* row, int64_t g, const float* scale, const float*, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7), half = j >> 2, k = j & 3;
    const uint8_t* ql = b + 64 * half + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    const int nshift = 4 * (k >> 1), hshift = 2 * k;
    const __m512i low4 = _mm512_set1_epi32(0xF), two = _mm512_set1_epi32(3), off = _mm512_set1_epi32(32);
    auto value = [&](const uint8_t* l, const uint8_t* h) {
      const __m512i lo = _mm512_and_si512(shifted(bytes16(l), nshift), low4);
      const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(shifted(bytes16(h), hshift), two), 4);
      return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(lo, hi), off));
    };
    w0 = _mm512_mul_ps(value(ql, qh), _mm512_set1_ps(scale[0]));
    w1 = _mm512_mul_ps(value(ql + 16, qh + 16), _mm512_set1_ps(scale[1]));
  }
};

}  // namespace lanes_quant
