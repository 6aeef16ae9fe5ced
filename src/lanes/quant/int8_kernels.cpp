// Products of the 32-value GGUF formats (Q8_0, Q4_0, Q4_1) by integer dot products (AVX-512 VNNI), with
// each activation group of 32 quantized to 8 bits as llama.cpp quantizes it for these types; registered as
// lanes_quant::mm_int8 and lanes_quant::take_int8.
//
// A row's groups are read in chunks of 16, 8, 4, 2 and 1 (int8_layout.py writes the order): in a chunk of
// gc groups each of the 16 int32 lanes of a vpdpbusd sums 4 values of one group, so a chunk takes
// max(1, gc / 2) instructions and its lanes' integer sums are scaled by a vector of the groups' scales.
// Every (weight row, x row) pair runs the same instructions in the same order whatever the tile, so a row's
// result has the same bits in any pass (what drafted decoding needs to equal plain decoding).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "gguf_formats.h"
#include "int8_chunks.h"
#include "cpu_math.h"
#include "cpu_pool.h"
#include "cpu_rows.h"

namespace {

using namespace lanes_quant;

enum Kind : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

inline bool four_bit(int64_t kind) { return kind != kQ8_0; }

constexpr int instructions(int gc) { return gc == 1 ? 1 : gc / 2; }

// The instructions of a chunk of GC groups of a weight row, from its stored bytes (4-bit: two a 64 packed bytes).
template <int GC, bool Nibbles>
inline void load_instructions(const uint8_t* q, __m512i (&out)[8]) {
  if constexpr (!Nibbles) {
    if constexpr (GC == 1) out[0] = _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    else for (int s = 0; s < instructions(GC); ++s) out[s] = _mm512_loadu_si512(q + 64 * s);
  } else if constexpr (GC >= 4) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < instructions(GC) / 2; ++p) {
      const __m512i v = _mm512_loadu_si512(q + 64 * p);
      out[2 * p] = _mm512_and_si512(v, low4);
      out[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
  } else if constexpr (GC == 2) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), m = _mm256_set1_epi8(0x0F);
    out[0] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), m = _mm_set1_epi8(0x0F);
    out[0] = _mm512_zextsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, m)),
                                                            _mm_and_si128(_mm_srli_epi16(v, 4), m), 1));
  }
}

// The same for a chunk size known only at run time.
template <bool Nibbles>
inline void load_any(const uint8_t* q, int gc, __m512i (&out)[8]) {
  switch (gc) {
    case 16: load_instructions<16, Nibbles>(q, out); break;
    case 8: load_instructions<8, Nibbles>(q, out); break;
    case 4: load_instructions<4, Nibbles>(q, out); break;
    case 2: load_instructions<2, Nibbles>(q, out); break;
    default: load_instructions<1, Nibbles>(q, out); break;
  }
}

// A chunk's per-group f16 values (GC of them from `first`) spread to its lanes: lane l takes group l / L.
template <int GC>
inline __m512 lane_values(const uint8_t* first, const Chunk& c) {
  if constexpr (GC == 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first)));
  const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << GC) - 1), first));
  return _mm512_maskz_permutexvar_ps(c.used, c.spread, v);
}

// The x rows of one product, prepared once a call: per row and chunk, the instructions' signed bytes and,
// per lane, its group's scale d, and d times (Q4_1) or the weights' zero point times (Q4_0, Q8_0) the
// lane's sum of quantized values: the minimum's term, or what the u8 weights' offset adds.
struct XRows {
  int64_t stride = 0;  // bytes of one row's chunks
  std::vector<uint8_t> bytes;
  const uint8_t* row(int64_t t) const { return bytes.data() + t * stride; }
};

constexpr int64_t kChunkBytes = 8 * 64 + 3 * 64;  // at most 8 instructions, then scale, sum and correction lanes

// x [T, K] fp32 quantized a group of 32 (d = amax / 127, q = rint(x * (127 / amax))) into XRows.
void prepare_x(const float* x, int64_t T, int64_t K, int64_t kind, const Chunks& chunks, XRows& out) {
  out.stride = chunks.count * kChunkBytes;
  out.bytes.assign(T * out.stride, 0);
  const int shift = kind == kQ8_0 ? 7 : 3;  // the zero point the u8 weights carry: 128 or 8
  const int64_t groups = K / 32;
  alignas(64) int8_t q[kMostK];
  alignas(64) float d[kMostK / 32 + 16];
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * K;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 a = _mm512_loadu_ps(xr + 32 * g), b = _mm512_loadu_ps(xr + 32 * g + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      d[g] = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_store_si128(reinterpret_cast<__m128i*>(q + 32 * g), _mm512_cvtsepi32_epi8(qa));
      _mm_store_si128(reinterpret_cast<__m128i*>(q + 32 * g + 16), _mm512_cvtsepi32_epi8(qb));
    }
    uint8_t* row = out.bytes.data() + t * out.stride;
    for (int64_t ci = 0; ci < chunks.count; ++ci) {
      const Chunk& c = chunks.at[ci];
      uint8_t* base = row + ci * kChunkBytes;
      const int32_t* units = reinterpret_cast<const int32_t*>(q + 32 * c.first);
      __m512i sum = _mm512_setzero_si512();
      for (int s = 0; s < c.instructions; ++s) {
        const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), c.used, c.units[s], units, 4);
        _mm512_storeu_si512(base + 64 * s, v);
        sum = _mm512_dpbusd_epi32(sum, ones, v);
      }
      const __mmask16 own = static_cast<__mmask16>((1u << c.groups) - 1);
      const __m512 scale = _mm512_maskz_permutexvar_ps(c.used, c.spread, _mm512_maskz_loadu_ps(own, d + c.first));
      _mm512_storeu_ps(base + 8 * 64, scale);
      if (kind == kQ4_1) _mm512_storeu_ps(base + 9 * 64, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(sum)));
      else _mm512_storeu_si512(base + 10 * 64, _mm512_slli_epi32(sum, shift));
    }
  }
}

// One chunk (GC groups) of two weight rows, unpacked once and kept in registers while x rows go past: each x
// vector is loaded once for the two rows, and every (weight row, x row) pair runs the same instructions.
template <int64_t Kind, int GC>
struct Pair {
  __m512i first[8], second[8];
  __m512 scale0, scale1, offset0 = _mm512_setzero_ps(), offset1 = _mm512_setzero_ps();

  __attribute__((always_inline)) Pair(const uint8_t* row0, const uint8_t* row1, const Chunks& chunks, const Chunk& c) {
    load_instructions<GC, Kind != kQ8_0>(row0 + c.quant_offset, first);
    load_instructions<GC, Kind != kQ8_0>(row1 + c.quant_offset, second);
    scale0 = lane_values<GC>(row0 + chunks.scale_offset + 2 * c.first, c);
    scale1 = lane_values<GC>(row1 + chunks.scale_offset + 2 * c.first, c);
    if constexpr (Kind == kQ4_1) {
      offset0 = lane_values<GC>(row0 + chunks.min_offset + 2 * c.first, c);
      offset1 = lane_values<GC>(row1 + chunks.min_offset + 2 * c.first, c);
    }
  }

  // The chunk of one x row (its prepared bytes at `x`) into the two rows' accumulators.
  __attribute__((always_inline)) void add(const uint8_t* x, __m512& acc0, __m512& acc1) const {
    __m512i dot0 = _mm512_setzero_si512(), dot1 = _mm512_setzero_si512();
    for (int s = 0; s < instructions(GC); ++s) {
      const __m512i xv = _mm512_loadu_si512(x + 64 * s);
      dot0 = _mm512_dpbusd_epi32(dot0, first[s], xv);
      dot1 = _mm512_dpbusd_epi32(dot1, second[s], xv);
    }
    const uint8_t* lanes = x + 8 * 64;
    if constexpr (Kind != kQ4_1) {
      const __m512i fix = _mm512_loadu_si512(lanes + 128);
      dot0 = _mm512_sub_epi32(dot0, fix);
      dot1 = _mm512_sub_epi32(dot1, fix);
    }
    const __m512 xscale = _mm512_loadu_ps(lanes);
    acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot0), _mm512_mul_ps(scale0, xscale), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot1), _mm512_mul_ps(scale1, xscale), acc1);
    if constexpr (Kind == kQ4_1) {
      const __m512 xsum = _mm512_loadu_ps(lanes + 64);
      acc0 = _mm512_fmadd_ps(offset0, xsum, acc0);
      acc1 = _mm512_fmadd_ps(offset1, xsum, acc1);
    }
  }
};

// f(std::integral_constant<int, gc>) for a chunk of gc groups: the chunk's size as a template argument.
template <class F>
inline void by_size(int gc, F&& f) {
  switch (gc) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// One chunk (GC groups) of NR weight rows by TR x rows into their accumulators, two weight rows at a time.
template <int64_t Kind, int GC, int NR, int TR>
inline void chunk_tile(const uint8_t* const (&rows)[NR], const Chunks& chunks, int64_t ci, const uint8_t* const (&x)[TR],
                       __m512 (&acc)[NR][TR]) {
  static_assert(NR % 2 == 0, "weight rows go in pairs");
  for (int r = 0; r < NR; r += 2) {
    const Pair<Kind, GC> pair(rows[r], rows[r + 1], chunks, chunks.at[ci]);
    for (int t = 0; t < TR; ++t) pair.add(x[t], acc[r][t], acc[r + 1][t]);
  }
}

// out[t0 .. t0+TR, n0 .. n0+NR) of the product; weight rows past N repeat the last and are not stored.
template <int64_t Kind, int NR, int TR>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, const Chunks& chunks, const XRows& xs,
                 int64_t t0, float* out) {
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + std::min(n0 + r, N - 1) * row_bytes;
  __m512 acc[NR][TR];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < TR; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t ci = 0; ci < chunks.count; ++ci) {
    const uint8_t* x[TR];
    for (int t = 0; t < TR; ++t) x[t] = xs.row(t0 + t) + ci * kChunkBytes;
    by_size(chunks.at[ci].groups, [&](auto gc) { chunk_tile<Kind, decltype(gc)::value, NR, TR>(rows, chunks, ci, x, acc); });
  }
  static_assert(NR * TR <= 16, "a tile's sums take one lane_sums");
  __m512 all[16];
  for (int i = 0; i < 16; ++i) all[i] = i < NR * TR ? acc[i / TR][i % TR] : _mm512_setzero_ps();
  alignas(64) float sums[16];
  _mm512_store_ps(sums, lane_sums(all));
  for (int t = 0; t < TR; ++t)
    for (int r = 0; r < NR; ++r)
      if (n0 + r < N) out[(t0 + t) * N + n0 + r] = sums[lane_of_sum(r * TR + t)];
}

constexpr int64_t kAheadRows = 64;  // weight rows fetched toward the cache ahead of their tile
constexpr int kOneRowTile = 8;      // one x row: eight weight rows, eight independent accumulator chains
constexpr int kFewRows = 2;         // more x rows: two weight rows by up to kMostX x rows (measured: 2-4 alike)
constexpr int kMostX = 8;
constexpr int64_t kPanel = 64;      // more: x rows a panel, whose prepared bytes (<= 135 KB at k = 1536) stay in L2

// out[t0 .. t0+rows, n0 .. n0+2) for a pair of weight rows and a panel of x rows: each chunk of the pair is
// unpacked once for the panel, and its x rows stream from L2 instead of every pair reading all of x.
template <int64_t Kind>
void pair_panel(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, const Chunks& chunks, const XRows& xs,
                int64_t t0, int64_t rows, float* out) {
  const uint8_t* row0 = w + n0 * row_bytes;
  const uint8_t* row1 = w + std::min(n0 + 1, N - 1) * row_bytes;
  __m512 acc[kPanel][2];
  for (int64_t t = 0; t < rows; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  for (int64_t ci = 0; ci < chunks.count; ++ci) {
    by_size(chunks.at[ci].groups, [&](auto gc) {
      const Pair<Kind, decltype(gc)::value> pair(row0, row1, chunks, chunks.at[ci]);
      for (int64_t t = 0; t < rows; ++t) pair.add(xs.row(t0 + t) + ci * kChunkBytes, acc[t][0], acc[t][1]);
    });
  }
  for (int64_t g = 0; g < rows; g += 8) {  // eight x rows' sums (16 vectors) at a time
    const int64_t count = std::min<int64_t>(16, 2 * (rows - g));
    __m512 all[16];
    for (int i = 0; i < 16; ++i) all[i] = i < count ? acc[g + i / 2][i % 2] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, lane_sums(all));
    for (int i = 0; i < count; ++i)
      if (n0 + i % 2 < N) out[(t0 + g + i / 2) * N + n0 + i % 2] = sums[lane_of_sum(i)];
  }
}

// Many x rows: panels of x rows in turn, each thread's weight pairs streaming past each panel.
template <int64_t Kind>
void mm_panels(const uint8_t* w, int64_t row_bytes, int64_t N, const Chunks& chunks, const XRows& xs, int64_t T, float* out) {
  const int64_t pairs = (N + 1) / 2, panels = (T + kPanel - 1) / kPanel;
  parallel_for(0, pairs, 8, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(N, 2 * end);
    for (int64_t p = 0, t0 = 0; p < panels; ++p) {
      const int64_t rows = T / panels + (p < T % panels ? 1 : 0);  // sizes differing by at most one
      prefetch_rows(w, row_bytes, 2 * begin, kAheadRows, last);
      for (int64_t i = begin; i < end; ++i) {
        prefetch_rows(w, row_bytes, 2 * i + kAheadRows, 2, last);
        pair_panel<Kind>(w, row_bytes, 2 * i, N, chunks, xs, t0, rows, out);
      }
      t0 += rows;
    }
  });
}

template <int64_t Kind>
void mm(const uint8_t* w, int64_t row_bytes, int64_t N, const Chunks& chunks, const XRows& xs, int64_t T, float* out) {
  if (T > kMostX) return mm_panels<Kind>(w, row_bytes, N, chunks, xs, T, out);
  const int64_t nr = T == 1 ? kOneRowTile : kFewRows;
  const int64_t tiles = (N + nr - 1) / nr;
  const int64_t parts = (T + kMostX - 1) / kMostX;  // x tiles, sizes differing by at most one
  parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    prefetch_rows(w, row_bytes, begin * nr, kAheadRows, std::min(N, end * nr));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * nr;
      prefetch_rows(w, row_bytes, n0 + kAheadRows, nr, std::min(N, end * nr));
      if (T == 1) {
        tile<Kind, kOneRowTile, 1>(w, row_bytes, n0, N, chunks, xs, 0, out);
        continue;
      }
      for (int64_t p = 0, t0 = 0; p < parts; ++p) {
        const int64_t rows = T / parts + (p < T % parts ? 1 : 0);
        switch (rows) {
          case 1: tile<Kind, kFewRows, 1>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 2: tile<Kind, kFewRows, 2>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 3: tile<Kind, kFewRows, 3>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 4: tile<Kind, kFewRows, 4>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 5: tile<Kind, kFewRows, 5>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 6: tile<Kind, kFewRows, 6>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 7: tile<Kind, kFewRows, 7>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          case 8: tile<Kind, kFewRows, 8>(w, row_bytes, n0, N, chunks, xs, t0, out); break;
          default: break;
        }
        t0 += rows;
      }
    }
  });
}

// One row decoded to fp32 in the file's value order, each value as the gguf package computes it.
void decode_row(const uint8_t* row, int64_t K, int64_t kind, const Chunks& chunks, float* out) {
  const bool nibbles = four_bit(kind);
  for (int64_t ci = 0; ci < chunks.count; ++ci) {
    const Chunk& c = chunks.at[ci];
    __m512i instr[8];
    if (nibbles) load_any<true>(row + c.quant_offset, c.groups, instr);
    else load_any<false>(row + c.quant_offset, c.groups, instr);
    alignas(64) uint8_t bytes[8][64];
    for (int s = 0; s < c.instructions; ++s) _mm512_storeu_si512(bytes[s], instr[s]);
    for (int i = 0; i < c.groups; ++i) {
      const int64_t g = c.first + i;
      const float d = f16(row + chunks.scale_offset + 2 * g);
      const float m = kind == kQ4_1 ? f16(row + chunks.min_offset + 2 * g) : 0.0f;
      for (int u = 0; u < 8; ++u)
        for (int j = 0; j < 4; ++j) {
          const uint8_t b = bytes[u / c.lanes][4 * (i * c.lanes + u % c.lanes) + j];
          float v;
          if (kind == kQ8_0) v = d * static_cast<float>(static_cast<int>(b) - 128);
          else if (kind == kQ4_0) v = d * static_cast<float>(static_cast<int>(b) - 8);
          else v = d * static_cast<float>(b) + m;
          out[32 * g + 4 * u + j] = v;
        }
    }
  }
}

void check(const at::Tensor& w, int64_t kind, int64_t n, int64_t k) {
  TORCH_CHECK(kind == kQ8_0 || kind == kQ4_0 || kind == kQ4_1, "lanes_quant: GGUF type ", kind, " has no integer kernel");
  TORCH_CHECK(k % 32 == 0 && k > 0 && k <= kMostK, "lanes_quant: k must be a positive multiple of 32 up to ", kMostK);
  const int64_t row_bytes = k / 32 * (kind == kQ8_0 ? 34 : kind == kQ4_0 ? 18 : 20);
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == n && w.size(1) == row_bytes,
              "lanes_quant: w must be contiguous uint8 [n, ", row_bytes, "]");
}

// x [T, k] fp32 @ w.T -> [T, n] fp32, x quantized to 8 bits a group of 32.
at::Tensor mm_int8_op(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t n, int64_t k) {
  check(w, kind, n, k);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == k, "lanes_quant: x must be fp32 [T, k]");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0 || n == 0) return out;
  const Chunks chunks = Chunks::of(k / 32, four_bit(kind));
  XRows xs;
  prepare_x(xc.data_ptr<float>(), x.size(0), k, kind, chunks, xs);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (kind == kQ8_0) mm<kQ8_0>(wp, w.size(1), n, chunks, xs, x.size(0), o);
  else if (kind == kQ4_0) mm<kQ4_0>(wp, w.size(1), n, chunks, xs, x.size(0), o);
  else mm<kQ4_1>(wp, w.size(1), n, chunks, xs, x.size(0), o);
  return out;
}

// Rows `ids` [R] int64 of w dequantized: [R, k] fp32.
at::Tensor take_int8_op(const at::Tensor& w, const at::Tensor& ids, int64_t kind, int64_t n, int64_t k) {
  check(w, kind, n, k);
  const at::Tensor idc = checked_row_ids(ids, n);
  at::Tensor out = at::empty({idc.size(0), k}, w.options().dtype(at::kFloat));
  const Chunks chunks = Chunks::of(k / 32, four_bit(kind));
  const int64_t* id = idc.data_ptr<int64_t>();
  const uint8_t* base = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  parallel_for(0, idc.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) decode_row(base + id[i] * w.size(1), k, kind, chunks, o + i * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) {
  m.def("mm_int8(Tensor x, Tensor w, int kind, int n, int k) -> Tensor");
  m.def("take_int8(Tensor w, Tensor ids, int kind, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) {
  m.impl("mm_int8", &mm_int8_op);
  m.impl("take_int8", &take_int8_op);
}
