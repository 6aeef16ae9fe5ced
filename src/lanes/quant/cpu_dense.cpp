// fp32 products with few activation rows (AVX-512 or AVX2), registered as `lanes_quant::mm_f32`: x [T, K] @ w.T.
//
// A decode pass multiplies each full-precision weight by a handful of rows (a lane's one, or a drafted
// lane's 1 + k); the weights are read from memory once for all of them (a block of weight rows stays in
// L1 while every row of x passes over it), so a row past the first adds its arithmetic, not another read
// (docs/DECISIONS.md, "fp32 products of few rows"). Each (weight row, x row) product is one fma chain over
// K in order, summed across its 16 lanes by a fixed tree: its bits do not depend on T or on the tile it fell
// in, so a drafted lane's rows equal its plain rows. A block ahead is fetched a few lines a step while this
// one computes (fetched in one burst, it waited on memory before the arithmetic began): `spread` fetches
// the next block over all of this block's x tiles, else the block 2 ahead during the first tile (faster on
// a Sapphire Rapids; on a Zen 4 that left a drafted pass's 2-3 tiles at 1.3-1.5x one row's, DECISIONS.md).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>

#include "cpu_math.h"
#include "cpu_pool.h"
#include "cpu_rows.h"

namespace {

using namespace lanes_quant;

#ifdef __AVX512F__
constexpr int kRows = 4;  // weight rows a block
constexpr int kTile = 4;  // x rows a tile: 16 accumulators with the block's rows
#else
constexpr int kRows = 2;  // AVX2 has 16 vector registers: 4 accumulators of two halves, and the operands
constexpr int kTile = 2;
#endif

// The block ahead's lines, toward L2 (T0 measured 10-25% slower), `per` a step, row by row at each column.
struct Ahead {
  const float* w;  // its first row
  int rows;  // 0 past the last block
  int64_t K, next, end, per;  // line `next` is row next % rows, column 16 x (next / rows); `end` lines in all

  void fetch() {
    for (int64_t i = 0; i < per && next < end; ++i, ++next)
      _mm_prefetch(reinterpret_cast<const char*>(w + (next % rows) * K + (next / rows) * 16), _MM_HINT_T1);
  }
};

// Weight rows [n0, n0 + R) by x rows [t0, t0 + TT) into out [T, N]: whole vectors of K, then its masked tail;
// the block ahead's next lines are fetched meanwhile.
template <int R, int TT>
void block(const float* x, const float* w, float* out, int64_t n0, int64_t t0, int64_t N, int64_t K, Ahead& ahead) {
  V16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = vzero();
  const float* wr = w + n0 * K;
  const float* xr = x + t0 * K;
  int64_t c = 0;
  for (; c + 16 <= K; c += 16) {
    V16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(wr + r * K + c);
    ahead.fetch();
    for (int t = 0; t < TT; ++t) {
      const V16 xv = vload(xr + t * K + c);
      for (int r = 0; r < R; ++r) acc[r * TT + t] = vfmadd(wv[r], xv, acc[r * TT + t]);
    }
  }
  if (c < K) {
    const Mask16 m = lanes_from(K, c);
    V16 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload_masked(m, wr + r * K + c);
    ahead.fetch();
    for (int t = 0; t < TT; ++t) {
      const V16 xv = vload_masked(m, xr + t * K + c);
      for (int r = 0; r < R; ++r) acc[r * TT + t] = vfmadd(wv[r], xv, acc[r * TT + t]);
    }
  }
  float sums[16];
  lane_sums_of(acc, R * TT, sums);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) out[(t0 + t) * N + n0 + r] = sums[r * TT + t];
}

// All of x's rows over one block of weight rows, in tiles of at most kTile as even as they come (9: 3, 3, 3):
// a one-row tile would load the block for 4 products only. `ahead` rows of a block ahead, from ahead_w, are
// fetched over every tile's steps evenly (`spread`) or over the first tile's.
template <int R>
void rows_block(const float* x, const float* w, float* out, int64_t n0, int64_t T, int64_t N, int64_t K,
                const float* ahead_w, int ahead, bool spread) {
  const int64_t tiles = (T + kTile - 1) / kTile, lines = (K + 15) / 16;
  Ahead fetch{ahead_w, ahead, K, 0, ahead * lines, spread ? (ahead + tiles - 1) / tiles : ahead};
  for (int64_t i = 0, t0 = 0; i < tiles; ++i) {
    const int64_t rows = (T - t0) / (tiles - i) + ((T - t0) % (tiles - i) != 0);
    if (kTile >= 4 && rows == 4) block<R, (kTile >= 4 ? 4 : 1)>(x, w, out, n0, t0, N, K, fetch);
    else if (kTile >= 3 && rows == 3) block<R, (kTile >= 3 ? 3 : 1)>(x, w, out, n0, t0, N, K, fetch);
    else if (rows == 2) block<R, 2>(x, w, out, n0, t0, N, K, fetch);
    else block<R, 1>(x, w, out, n0, t0, N, K, fetch);
    t0 += rows;
  }
}

// x [T, K] fp32, w [N, K] fp32, both contiguous -> [T, N].
at::Tensor mm_f32_op(const at::Tensor& x, const at::Tensor& w, bool spread) {
  TORCH_CHECK(x.dtype() == at::kFloat && w.dtype() == at::kFloat && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "lanes_quant: mm_f32 takes fp32 x [T, K] and w [N, K]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t T = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor out = at::empty({T, N}, xc.options());
  if (T == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (N + kRows - 1) / kRows;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(float));
  const int64_t distance = spread ? 1 : 2;  // blocks from the one computed to the one fetched (each measured best)
  lanes_quant::parallel_for(0, blocks, std::max<int64_t>(1, 4096 / (K * std::max<int64_t>(T, 1)) + 1),
                            [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kRows, a0 = n0 + distance * kRows;
      if (b == begin) lanes_quant::prefetch_rows(reinterpret_cast<const uint8_t*>(wp), row_bytes, n0, distance * kRows, N);
      const int ahead = static_cast<int>(std::clamp<int64_t>(N - a0, 0, kRows));
      const float* ahead_w = wp + std::min(a0, N) * K;
      const int64_t rows = std::min<int64_t>(kRows, N - n0);
      if (kRows >= 4 && rows == 4) rows_block<(kRows >= 4 ? 4 : 1)>(xp, wp, op, n0, T, N, K, ahead_w, ahead, spread);
      else if (kRows >= 3 && rows == 3) rows_block<(kRows >= 3 ? 3 : 1)>(xp, wp, op, n0, T, N, K, ahead_w, ahead, spread);
      else if (rows == 2) rows_block<2>(xp, wp, op, n0, T, N, K, ahead_w, ahead, spread);
      else rows_block<1>(xp, wp, op, n0, T, N, K, ahead_w, ahead, spread);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) {
  m.def("mm_f32(Tensor x, Tensor w, bool spread=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) {
  m.impl("mm_f32", &mm_f32_op);
}
