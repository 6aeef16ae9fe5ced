// Matmuls over GGUF block formats read in place (AVX-512), registered as torch ops `lanes_quant::*`.
//
// Each format's `group` decodes 32 consecutive values of a row into two fp32 vectors with exactly the
// roundings of the gguf package's dequantization (products of small integers and f16 scales are exact in
// fp32; the one rounding left is the same), so a result differs from x @ dequantize(w).T only by the order
// of fp32 additions. Rows of a weight are its output features; a row is whole blocks of its format.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m512i bytes16(const uint8_t* p) {  // 16 bytes widened to 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m512i nibbles(__m512i v, int shift) {
  return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(0xF));
}

inline __m512i bits(__m512i v, int shift, int mask, int up) {  // ((v >> shift) & mask) << up
  __m512i b = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
  return _mm512_sll_epi32(b, _mm_cvtsi32_si128(up));
}

// Q8_0: 32 values a block: f16 d, int8 q[32]; value d * q.
struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + g * kBytes;
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
  }
};

// Q4_0: f16 d, 16 bytes of nibbles (low: values 0..15, high: 16..31); value d * (q - 8).
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + g * kBytes;
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m512i v = bytes16(b + 2), eight = _mm512_set1_epi32(8);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(nibbles(v, 0), eight)), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(nibbles(v, 4), eight)), d);
  }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; value d * q + m (d * q is exact, so one fma rounds as they do).
struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + g * kBytes;
    const __m512 d = _mm512_set1_ps(f16(b)), m = _mm512_set1_ps(f16(b + 2));
    const __m512i v = bytes16(b + 4);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibbles(v, 0)), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibbles(v, 4)), d, m);
  }
};

// The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K: 256 values: f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles (32 bytes a pair of
// sub-blocks, low nibbles the even one); value (d * sc) * q - dmin * m.
struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7);
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    const __m512 d = _mm512_set1_ps(f16(b) * static_cast<float>(sc));
    const __m512 dm = _mm512_set1_ps(-(f16(b + 2) * static_cast<float>(m)));
    const uint8_t* qs = b + 16 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibbles(bytes16(qs), shift)), d, dm);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(nibbles(bytes16(qs + 16), shift)), d, dm);
  }
};

// Q5_K: as Q4_K with a fifth bit: bit j of qh[l] is the high bit of value l of sub-block j.
struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7);
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    const __m512 d = _mm512_set1_ps(f16(b) * static_cast<float>(sc));
    const __m512 dm = _mm512_set1_ps(-(f16(b + 2) * static_cast<float>(m)));
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48 + 32 * (j >> 1);
    const int shift = 4 * (j & 1);
    const __m512i q0 = _mm512_or_si512(nibbles(bytes16(qs), shift), bits(bytes16(qh), j, 1, 4));
    const __m512i q1 = _mm512_or_si512(nibbles(bytes16(qs + 16), shift), bits(bytes16(qh + 16), j, 1, 4));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, dm);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, dm);
  }
};

// Q6_K: 256 values: ql[128] (low nibbles), qh[64] (2 high bits), int8 scales[16] (one a 16 values), f16 d;
// value (d * sc) * (q - 32). Group j of a super-block: half j/4, nibble and bit pair chosen by j%4.
struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static inline void group(const uint8_t* row, int64_t g, __m512& w0, __m512& w1) {
    const uint8_t* b = row + (g >> 3) * kBytes;
    const int j = static_cast<int>(g & 7), half = j >> 2, k = j & 3;
    const uint8_t* ql = b + 64 * half + 32 * (k & 1);
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 2 * j;
    const float d = f16(b + 208);
    const int nshift = 4 * (k >> 1), hshift = 2 * k;
    const __m512i off = _mm512_set1_epi32(32);
    const __m512i q0 = _mm512_or_si512(nibbles(bytes16(ql), nshift), bits(bytes16(qh), hshift, 3, 4));
    const __m512i q1 = _mm512_or_si512(nibbles(bytes16(ql + 16), nshift), bits(bytes16(qh + 16), hshift, 3, 4));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q0, off)), _mm512_set1_ps(d * static_cast<float>(sc[0])));
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q1, off)), _mm512_set1_ps(d * static_cast<float>(sc[1])));
  }
};

constexpr int kRowTile = 4;  // weight rows decoded together: four independent accumulator chains at one x row
constexpr int kXTile = 4;    // x rows sharing a decoded group: 16 accumulators, 8 decoded vectors, 2 x vectors

// out[t0 .. t0+TR, n0 .. n0+4) of x [T, K] @ w.T; rows past N repeat the last one and are not stored.
template <class Q, int TR>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, int64_t K, const float* x,
                 int64_t t0, float* out) {
  const uint8_t* rows[kRowTile];
  for (int r = 0; r < kRowTile; ++r) rows[r] = w + std::min(n0 + r, N - 1) * row_bytes;
  __m512 acc[kRowTile][TR];
  for (int r = 0; r < kRowTile; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 w0[kRowTile], w1[kRowTile];
    for (int r = 0; r < kRowTile; ++r) Q::group(rows[r], g, w0[r], w1[r]);
    for (int t = 0; t < TR; ++t) {
      const float* xp = x + (t0 + t) * K + g * 32;
      const __m512 x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16);
      for (int r = 0; r < kRowTile; ++r) {
        acc[r][t] = _mm512_fmadd_ps(w0[r], x0, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(w1[r], x1, acc[r][t]);
      }
    }
  }
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < kRowTile; ++r)
      if (n0 + r < N) out[(t0 + t) * N + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

template <class Q>
void mm_tiles(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, int64_t T, float* out) {
  const int64_t tiles = (N + kRowTile - 1) / kRowTile;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kRowTile;
      int64_t t0 = 0;
      for (; t0 + kXTile <= T; t0 += kXTile) tile<Q, kXTile>(w, row_bytes, n0, N, K, x, t0, out);
      switch (T - t0) {
        case 1: tile<Q, 1>(w, row_bytes, n0, N, K, x, t0, out); break;
        case 2: tile<Q, 2>(w, row_bytes, n0, N, K, x, t0, out); break;
        case 3: tile<Q, 3>(w, row_bytes, n0, N, K, x, t0, out); break;
        default: break;
      }
    }
  });
}

// Rows `ids` of w decoded into dst [len(ids), K] fp32.
template <class Q>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* ids, int64_t count, float* dst) {
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = w + ids[i] * row_bytes;
      float* out = dst + i * K;
      for (int64_t g = 0; g < K / 32; ++g) {
        __m512 w0, w1;
        Q::group(row, g, w0, w1);
        _mm512_storeu_ps(out + g * 32, w0);
        _mm512_storeu_ps(out + g * 32 + 16, w1);
      }
    }
  });
}

// Rows [first, first + count) decoded into dst [count, K] fp32.
template <class Q>
void decode_range(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t first, int64_t count, float* dst) {
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = w + (first + i) * row_bytes;
      float* out = dst + i * K;
      for (int64_t g = 0; g < K / 32; ++g) {
        __m512 w0, w1;
        Q::group(row, g, w0, w1);
        _mm512_storeu_ps(out + g * 32, w0);
        _mm512_storeu_ps(out + g * 32 + 16, w1);
      }
    }
  });
}

// ggml's type numbers.
enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

template <class F>
void dispatch(int64_t kind, F&& f) {
  switch (kind) {
    case kQ8_0: f(Q8_0{}); break;
    case kQ4_0: f(Q4_0{}); break;
    case kQ4_1: f(Q4_1{}); break;
    case kQ4_K: f(Q4_K{}); break;
    case kQ5_K: f(Q5_K{}); break;
    case kQ6_K: f(Q6_K{}); break;
    default: TORCH_CHECK(false, "lanes_quant: GGUF type ", kind, " has no kernel");
  }
}

void check_weight(const at::Tensor& w, int64_t kind, int64_t n, int64_t k) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == n,
              "lanes_quant: w must be contiguous uint8 [n, row bytes]");
  TORCH_CHECK(k % 32 == 0 && k > 0, "lanes_quant: k must be a positive multiple of 32");
  dispatch(kind, [&](auto q) {
    using Q = decltype(q);
    TORCH_CHECK(k % Q::kValues == 0 && w.size(1) == k / Q::kValues * Q::kBytes,
                "lanes_quant: w's row bytes do not match k for GGUF type ", kind);
  });
}

// x [T, k] fp32 @ w.T -> [T, n] fp32, every weight group decoded in registers (the few-rows path).
at::Tensor mm_tiles_op(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n, int64_t k) {
  check_weight(w, kind, n, k);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "lanes_quant: x must be fp32 [T, k]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  dispatch(kind, [&](auto q) {
    mm_tiles<decltype(q)>(w.data_ptr<uint8_t>(), w.size(1), n, k, xc.data_ptr<float>(), x.size(0), out.data_ptr<float>());
  });
  return out;
}

// x [T, k] fp32 @ w.T -> [T, n] fp32 panel by panel: `panel` rows decoded to fp32, then BLAS (the many-rows path).
at::Tensor mm_panels_op(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n, int64_t k, int64_t panel) {
  check_weight(w, kind, n, k);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "lanes_quant: x must be fp32 [T, k]");
  TORCH_CHECK(panel > 0, "lanes_quant: panel must be positive");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  at::Tensor scratch = at::empty({std::min(panel, n), k}, x.options());
  dispatch(kind, [&](auto q) {
    using Q = decltype(q);
    for (int64_t first = 0; first < n; first += panel) {
      const int64_t count = std::min(panel, n - first);
      at::Tensor rows = scratch.narrow(0, 0, count);
      decode_range<Q>(w.data_ptr<uint8_t>(), w.size(1), k, first, count, rows.data_ptr<float>());
      at::Tensor part = out.narrow(1, first, count);
      at::mm_out(part, xc, rows.t());
    }
  });
  return out;
}

// Rows `ids` [R] int64 of w, dequantized: [R, k] fp32 (an embedding lookup, or the whole tensor for checks).
at::Tensor take_rows_op(const at::Tensor& w, const at::Tensor& ids, int64_t kind, int64_t n, int64_t k) {
  check_weight(w, kind, n, k);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "lanes_quant: ids must be int64 [R]");
  const at::Tensor idc = ids.contiguous();
  if (idc.numel() > 0) {
    const auto [lo, hi] = at::aminmax(idc);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < n, "lanes_quant: a row id is out of range");
  }
  at::Tensor out = at::empty({idc.size(0), k}, w.options().dtype(at::kFloat));
  dispatch(kind, [&](auto q) {
    decode_rows<decltype(q)>(w.data_ptr<uint8_t>(), w.size(1), k, idc.data_ptr<int64_t>(), idc.size(0), out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(lanes_quant, m) {
  m.def("mm_tiles(Tensor x, Tensor w, int kind, int n, int k) -> Tensor");
  m.def("mm_panels(Tensor x, Tensor w, int kind, int n, int k, int panel) -> Tensor");
  m.def("take_rows(Tensor w, Tensor ids, int kind, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) {
  m.impl("mm_tiles", &mm_tiles_op);
  m.impl("mm_panels", &mm_panels_op);
  m.impl("take_rows", &take_rows_op);
}
