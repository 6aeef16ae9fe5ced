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

}  // namespace lanes_quant
