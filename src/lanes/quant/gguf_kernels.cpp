// Matmuls over the K-quant GGUF formats read in place (AVX-512), fp32 activations, registered as torch ops
// `lanes_quant::*` (the 32-value formats multiply in integers: int8_kernels.cpp).
//
// Values are decoded (gguf_formats.h) exactly as the gguf package dequantizes them, so a result differs
// from x @ dequantize(w).T only by the order of fp32 additions. Rows of a weight are its output features;
// a row is whole blocks of its format.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "gguf_formats.h"
#include "cpu_pool.h"
#include "cpu_rows.h"

namespace {

using namespace lanes_quant;

constexpr int64_t kChunk = 64;  // groups whose scales are converted at once: a multiple of 8 (K-quant super-blocks)
constexpr int kRowTile = 4;  // weight rows decoded together: four independent accumulator chains at one x row
constexpr int kXTile = 4;    // x rows sharing a decoded group: 16 accumulators, 8 decoded vectors, 2 x vectors
// mm_tiles from 2 x rows: tiles of 2 weight rows by up to 10 x rows (20 accumulators), x rows split into
// near-equal tiles, so a group is decoded once for as many x rows as registers allow (a drafted lane's 1 + k
// rows are one tile, not 8 and a lone 1). Every accumulator's chain is the same whatever the tile.
constexpr int kFewRows = 2;
constexpr int kMostX = 10;

// The one fma chain of every product: a group's two weight vectors of NR rows into TR x rows' accumulators
// (x at the group's first column of the first row, rows K apart). Both paths use it, so a row's bits agree.
template <int TR, int NR>
inline void add_group(const __m512* w0, const __m512* w1, const float* x, int64_t K, __m512 (&acc)[NR][TR]) {
  for (int t = 0; t < TR; ++t) {
    const __m512 x0 = _mm512_loadu_ps(x + t * K), x1 = _mm512_loadu_ps(x + t * K + 16);
    for (int r = 0; r < NR; ++r) {
      acc[r][t] = _mm512_fmadd_ps(w0[r], x0, acc[r][t]);
      acc[r][t] = _mm512_fmadd_ps(w1[r], x1, acc[r][t]);
    }
  }
}

// Each accumulator's sum into out[t * ldo + n0 + r], rows past N (repeats of the last) not stored.
template <int TR, int NR>
inline void store_tile(__m512 (&acc)[NR][TR], int64_t n0, int64_t N, float* out, int64_t ldo) {
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r)
      if (n0 + r < N) out[t * ldo + n0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// out[t0 .. t0+TR, n0 .. n0+NR) of x [T, K] @ w.T; rows past N repeat the last one and are not stored.
template <class Q, int TR, int NR = kRowTile>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, int64_t K, const float* x,
                 int64_t t0, float* out) {
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * row_bytes;
  alignas(64) float scale[NR][kChunk * Q::kScales];
  alignas(64) float offset[NR][kChunk];
  __m512 acc[NR][TR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t groups = K / 32;
  for (int64_t c0 = 0; c0 < groups; c0 += kChunk) {
    const int64_t count = std::min(kChunk, groups - c0);
    for (int r = 0; r < NR; ++r) Q::scales(rows[r], groups, c0, count, scale[r], offset[r]);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t g = c0 + i;
      __m512 w0[NR], w1[NR];
      for (int r = 0; r < NR; ++r) Q::group(rows[r], g, scale[r] + i * Q::kScales, offset[r] + i, w0[r], w1[r]);
      add_group<TR, NR>(w0, w1, x + t0 * K + g * 32, K, acc);
    }
  }
  store_tile<TR, NR>(acc, n0, N, out + t0 * N, N);
}

constexpr int64_t kAheadRows = 64;  // how far ahead of the tile being computed its weight rows are fetched

template <class Q>
void mm_tiles(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const float* x, int64_t T, float* out) {
  if (T == 1) {  // one x row: eight weight rows a tile give eight independent fma chains (sixteen spill)
    parallel_for(0, (N + 7) / 8, 8, [&](int64_t begin, int64_t end) {
      prefetch_rows(w, row_bytes, begin * 8, kAheadRows, std::min(N, end * 8));
      for (int64_t i = begin; i < end; ++i) {
        prefetch_rows(w, row_bytes, i * 8 + kAheadRows, 8, std::min(N, end * 8));
        tile<Q, 1, 8>(w, row_bytes, i * 8, N, K, x, 0, out);
      }
    });
    return;
  }
  const int64_t tiles = (N + kFewRows - 1) / kFewRows;
  const int64_t parts = (T + kMostX - 1) / kMostX;  // x tiles, sizes differing by at most one
  parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    prefetch_rows(w, row_bytes, begin * kFewRows, kAheadRows, std::min(N, end * kFewRows));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * kFewRows;
      prefetch_rows(w, row_bytes, n0 + kAheadRows, kFewRows, std::min(N, end * kFewRows));
      for (int64_t p = 0, t0 = 0; p < parts; ++p) {
        const int64_t rows = T / parts + (p < T % parts ? 1 : 0);
        switch (rows) {
#define LANES_X(TR) case TR: tile<Q, TR, kFewRows>(w, row_bytes, n0, N, K, x, t0, out); break;
          LANES_X(1) LANES_X(2) LANES_X(3) LANES_X(4) LANES_X(5) LANES_X(6) LANES_X(7) LANES_X(8) LANES_X(9) LANES_X(10)
#undef LANES_X
          default: break;
        }
        t0 += rows;
      }
    }
  });
}

// One row of K values decoded into out (fp32).
template <class Q>
inline void decode_row(const uint8_t* row, int64_t K, float* out) {
  alignas(64) float scale[kChunk * Q::kScales];
  alignas(64) float offset[kChunk];
  const int64_t groups = K / 32;
  for (int64_t c0 = 0; c0 < groups; c0 += kChunk) {
    const int64_t count = std::min(kChunk, groups - c0);
    Q::scales(row, groups, c0, count, scale, offset);
    for (int64_t i = 0; i < count; ++i) {
      __m512 w0, w1;
      Q::group(row, c0 + i, scale + i * Q::kScales, offset + i, w0, w1);
      _mm512_storeu_ps(out + (c0 + i) * 32, w0);
      _mm512_storeu_ps(out + (c0 + i) * 32 + 16, w1);
    }
  }
}

// Rows `ids` of w decoded into dst [len(ids), K] fp32.
template <class Q>
void decode_rows(const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* ids, int64_t count, float* dst) {
  parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) decode_row<Q>(w + ids[i] * row_bytes, K, dst + i * K);
  });
}

// Rows [first, first + count) decoded into dst [count, K] fp32 (called inside a parallel region).
template <class Q>
void decode_range(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t first, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i) decode_row<Q>(w + (first + i) * row_bytes, K, dst + i * K);
}

// ggml's type numbers.
enum Kind : int64_t { kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };  // Q8_0, Q4_0, Q4_1: int8_kernels.cpp

template <class F>
void dispatch(int64_t kind, F&& f) {
  switch (kind) {
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

// out[t0 .. t0+TR, n0 .. n0+NR) of x [T, K] @ w.T for w rows already decoded to fp32 (`w` [N, K]), with
// tile()'s fma chain exactly: so a row's result is the same whichever path, and however many rows, it took.
template <int TR, int NR = kRowTile>
inline void decoded_tile(const float* w, int64_t n0, int64_t N, int64_t K, const float* x, int64_t t0,
                         float* out, int64_t ldo) {
  const float* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * K;
  __m512 acc[NR][TR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K; c += 32) {
    __m512 w0[NR], w1[NR];
    for (int r = 0; r < NR; ++r) w0[r] = _mm512_loadu_ps(rows[r] + c), w1[r] = _mm512_loadu_ps(rows[r] + c + 16);
    add_group<TR, NR>(w0, w1, x + t0 * K + c, K, acc);
  }
  store_tile<TR, NR>(acc, n0, N, out + t0 * ldo, ldo);
}

// x [T, k] fp32 @ w.T -> [T, n] fp32 panel by panel (the many-rows path): each thread decodes its panels of
// at most `panel` weight rows to fp32 once, in its own scratch, and multiplies every x row by them.
at::Tensor mm_panels_op(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n, int64_t k, int64_t panel) {
  check_weight(w, kind, n, k);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "lanes_quant: x must be fp32 [T, k]");
  TORCH_CHECK(panel > 0, "lanes_quant: panel must be positive");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const int64_t T = x.size(0);
  // at least two panels a thread, so that the last one to finish waits for little
  const int64_t per = (n + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  const int64_t rows = std::min(panel, std::max<int64_t>(16, (per + 15) / 16 * 16));
  const int64_t panels = (n + rows - 1) / rows;
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  dispatch(kind, [&](auto q) {
    using Q = decltype(q);
    parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(rows * k);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t first = p * rows, count = std::min(rows, n - first);
        decode_range<Q>(w.data_ptr<uint8_t>(), w.size(1), k, first, count, scratch.data());
        float* part = op + first;  // the panel's columns of out, row stride n
        int64_t t0 = 0;
        for (; t0 + kXTile <= T; t0 += kXTile)
          for (int64_t n0 = 0; n0 < count; n0 += kRowTile) decoded_tile<kXTile>(scratch.data(), n0, count, k, xp, t0, part, n);
        for (int64_t n0 = 0; n0 < count; n0 += kRowTile) {
          switch (T - t0) {
            case 1: decoded_tile<1>(scratch.data(), n0, count, k, xp, t0, part, n); break;
            case 2: decoded_tile<2>(scratch.data(), n0, count, k, xp, t0, part, n); break;
            case 3: decoded_tile<3>(scratch.data(), n0, count, k, xp, t0, part, n); break;
            default: break;
          }
        }
      }
    });
  });
  return out;
}

// Rows `ids` [R] int64 of w, dequantized: [R, k] fp32 (an embedding lookup, or the whole tensor for checks).
at::Tensor take_rows_op(const at::Tensor& w, const at::Tensor& ids, int64_t kind, int64_t n, int64_t k) {
  check_weight(w, kind, n, k);
  const at::Tensor idc = checked_row_ids(ids, n);
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
