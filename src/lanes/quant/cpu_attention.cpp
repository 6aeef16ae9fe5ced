// Causal attention over the paged KV cache on the CPU (AVX-512 or AVX2), registered as `lanes_quant::paged_attention`.
//
// Each query row is computed on its own, in an order fixed by its own context alone: a score is one fma
// chain over the head's dimensions, the softmax sums its keys in order, and the output adds the values in
// order. So a row's result does not depend on which other rows share the pass (a drafted lane's 1 + k
// rows, other lanes, a prompt beside it): the property that makes drafted decoding equal plain decoding.
// Keys are read through their slots where they lie; nothing is gathered or padded.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_pool.h"

namespace {

using namespace lanes_quant;

inline V16 head_part(const float* at, int v, Mask16 dims) {  // dimensions [16 v, 16 v + 16) of a head
  return load_lanes(dims, at + v * 16);
}

#ifdef __AVX512F__
// Lane p of the result: the sum of a[p]'s 16 lanes, by a tree whose order depends on p alone.
inline __m512 sums16(const __m512 (&a)[16]) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(u[2 * i]), y = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}
#else
inline V16 sums16(const V16 (&a)[16]) {  // lane p: a[p]'s lanes summed by vsum's tree
  float sums[16];
  lane_sums_of(a, 16, sums);
  return vload(sums);
}
#endif

// Keys and values [j0, j0 + 16) of a row, for one KV head, fetched into L2 a block ahead of the scores
// that read them (and the value sums after): the slots hop over other heads' bytes, past the prefetcher.
inline void prefetch_keys(const float* ck, const float* cv, const int64_t* slots, int64_t j0, int64_t len,
                          int64_t kv_heads, int64_t kv_head, int64_t d) {
  for (int64_t j = j0; j < std::min(j0 + 16, len); ++j) {
    const int64_t at = (slots[j] * kv_heads + kv_head) * d;
    for (int64_t i = 0; i < d; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(ck + at + i), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(cv + at + i), _MM_HINT_T1);
    }
  }
}

// One query row and one KV head: `group` query heads (GQA) over the row's `len` keys at `slots`; NV
// vectors of 16 cover a head of d dimensions. Key j's score is one fma chain over d and sums16's lane
// j % 16, its softmax weight is summed in lane j % 16, its value added in order j: all fixed by j alone.
template <int NV>
void attend(const float* q, const float* ck, const float* cv, const int64_t* slots, int64_t len, int64_t group,
            int64_t kv_heads, int64_t kv_head, int64_t d, float scale, float* out, std::vector<float>& p) {
  const int64_t padded = (len + 15) / 16 * 16;
  p.resize(group * (padded + 1));
  float* totals = p.data() + group * padded;  // each head's sum of weights
  Mask16 dims[NV];
  for (int v = 0; v < NV; ++v) dims[v] = lanes_from(d, v * 16);
  const V16 scale16 = vset(scale);
  prefetch_keys(ck, cv, slots, 0, len, kv_heads, kv_head, d);
  for (int64_t h = 0; h < group; ++h) {
    float* ph = p.data() + h * padded;
    V16 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = head_part(q + h * d, v, dims[v]);
    V16 top = vset(-INFINITY);
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      if (h == 0) prefetch_keys(ck, cv, slots, j0 + 16, len, kv_heads, kv_head, d);
      V16 acc[16];
      for (int i = 0; i < 16; ++i) {  // past the last key, the last key again (its weight masked to 0 below)
        const float* kj = ck + (slots[std::min(j0 + i, len - 1)] * kv_heads + kv_head) * d;
        acc[i] = vmul(qv[0], head_part(kj, 0, dims[0]));
        for (int v = 1; v < NV; ++v) acc[i] = vfmadd(qv[v], head_part(kj, v, dims[v]), acc[i]);
      }
      const V16 scores = vmul(sums16(acc), scale16);
      vstore(ph + j0, scores);
      top = vselect(lanes_from(len, j0), vmax(top, scores), top);
    }
    const V16 top16 = vset(vtop(top));
    V16 sum = vzero();
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      const V16 e = vkeep(lanes_from(len, j0), exp_nonpositive(vsub(vload(ph + j0), top16)));
      vstore(ph + j0, e);
      sum = vadd(sum, e);
    }
    totals[h] = vsum(sum);
  }
  constexpr int kHeads = NV <= 16 ? 16 / NV : 1;  // heads whose outputs fit in 16 accumulators at once
  for (int64_t h0 = 0; h0 < group; h0 += kHeads) {
    const int64_t heads = std::min<int64_t>(kHeads, group - h0);
    V16 acc[kHeads][NV];
    for (int h = 0; h < kHeads; ++h)
      for (int v = 0; v < NV; ++v) acc[h][v] = vzero();
    for (int64_t j = 0; j < len; ++j) {
      const float* vj = cv + (slots[j] * kv_heads + kv_head) * d;
      V16 values[NV];
      for (int v = 0; v < NV; ++v) values[v] = head_part(vj, v, dims[v]);
      for (int h = 0; h < kHeads; ++h) {
        if (h >= heads) break;
        const V16 w = vset(p[(h0 + h) * padded + j]);
        for (int v = 0; v < NV; ++v) acc[h][v] = vfmadd(w, values[v], acc[h][v]);
      }
    }
    for (int h = 0; h < heads; ++h) {
      const V16 inv = vset(1.0f / totals[h0 + h]);
      for (int v = 0; v < NV; ++v) store_lanes(out + (h0 + h) * d + v * 16, dims[v], vmul(acc[h][v], inv));
    }
  }
}

template <int NV>
void attend_rows(const float* qp, const float* kp, const float* vp, const int64_t* sp, const int64_t* fp, const int64_t* lp,
                 int64_t t_rows, int64_t hq, int64_t hkv, int64_t d, float scale, float* op) {
  const int64_t group = hq / hkv;
  parallel_for(0, t_rows * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / hkv, g = i % hkv;
      attend<NV>(qp + (t * hq + g * group) * d, kp, vp, sp + fp[t], lp[t], group, hkv, g, d, scale,
                 op + (t * hq + g * group) * d, p);
    }
  });
}

void check_caches(const at::Tensor& cache_k, const at::Tensor& cache_v) {
  TORCH_CHECK(cache_k.dtype() == at::kFloat && cache_k.dim() == 3 && cache_k.is_contiguous() &&
              cache_v.sizes() == cache_k.sizes() && cache_v.dtype() == at::kFloat && cache_v.is_contiguous(),
              "lanes_quant: the caches must be contiguous fp32 [S, Hkv, D]");
  TORCH_CHECK(cache_k.size(2) <= 256, "lanes_quant: a head of ", cache_k.size(2), " dimensions is past the kernel's 256");
}

// q [T, Hq, D] fp32 contiguous, the caches checked: every row attended into a new [T, Hq, D].
at::Tensor attend_all(const at::Tensor& qc, const at::Tensor& cache_k, const at::Tensor& cache_v, const at::Tensor& key_slots,
                      const at::Tensor& row_first, const at::Tensor& row_len, double scale) {
  const int64_t t_rows = qc.size(0), hq = qc.size(1), d = qc.size(2), hkv = cache_k.size(1);
  TORCH_CHECK(cache_k.size(2) == d && hq % hkv == 0, "lanes_quant: head shapes do not match");
  TORCH_CHECK(row_first.dtype() == at::kLong && row_len.dtype() == at::kLong && key_slots.dtype() == at::kLong &&
              row_first.numel() == t_rows && row_len.numel() == t_rows, "lanes_quant: row tables must be int64 [T]");
  const at::Tensor ks = key_slots.contiguous(), first = row_first.contiguous(), lens = row_len.contiguous();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = ks.data_ptr<int64_t>();
  const int64_t slots_total = cache_k.size(0), keys = ks.numel();
  for (int64_t t = 0; t < t_rows; ++t)
    TORCH_CHECK(lp[t] > 0 && fp[t] >= 0 && fp[t] + lp[t] <= keys, "lanes_quant: a row's keys are out of range");
  for (int64_t i = 0; i < keys; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots_total, "lanes_quant: a key slot is out of range");
  at::Tensor out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = cache_k.data_ptr<float>();
  const float* vp = cache_v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  switch ((d + 15) / 16) {
#define LANES_ATTEND(NV) case NV: attend_rows<NV>(qp, kp, vp, sp, fp, lp, t_rows, hq, hkv, d, sc, op); break;
    LANES_ATTEND(1) LANES_ATTEND(2) LANES_ATTEND(3) LANES_ATTEND(4) LANES_ATTEND(5) LANES_ATTEND(6)
    LANES_ATTEND(7) LANES_ATTEND(8) LANES_ATTEND(9) LANES_ATTEND(10) LANES_ATTEND(11) LANES_ATTEND(12)
    LANES_ATTEND(13) LANES_ATTEND(14) LANES_ATTEND(15) LANES_ATTEND(16)
#undef LANES_ATTEND
    default: break;
  }
  return out;
}

// q [T, Hq, D] fp32; cache_k, cache_v [S, Hkv, D] fp32; key_slots [N] int64 (each lane's context slots in
// order, lanes one after another); row_first [T], row_len [T] int64: row t sees key_slots[first, first + len).
at::Tensor paged_attention_op(const at::Tensor& q, const at::Tensor& cache_k, const at::Tensor& cache_v,
                              const at::Tensor& key_slots, const at::Tensor& row_first, const at::Tensor& row_len,
                              double scale) {
  TORCH_CHECK(q.dtype() == at::kFloat && q.dim() == 3, "lanes_quant: q must be fp32 [T, Hq, D]");
  check_caches(cache_k, cache_v);
  return attend_all(q.contiguous(), cache_k, cache_v, key_slots, row_first, row_len, scale);
}

// The attention part of a layer in one op, for what took RoPE, two index_copy_ and paged_attention: qkv
// [T, (Hq + 2 Hkv) D] fp32 (a row's q heads, then its k and v heads), cos and sin [T, D]; each row's k
// rotated and v written at slots[t] of the caches, then its rotated q attended: -> [T, Hq D]. The same
// arithmetic as those ops (rotate_head, attend), so the same bits.
at::Tensor rope_attention_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& cache_k,
                             const at::Tensor& cache_v, const at::Tensor& slots, const at::Tensor& key_slots,
                             const at::Tensor& row_first, const at::Tensor& row_len, int64_t heads, double scale) {
  check_caches(cache_k, cache_v);
  const int64_t t_rows = qkv.size(0), hkv = cache_k.size(1), d = cache_k.size(2), slots_total = cache_k.size(0);
  TORCH_CHECK(qkv.dtype() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && d % 2 == 0 &&
              qkv.size(1) == (heads + 2 * hkv) * d, "lanes_quant: qkv must be fp32 [T, (Hq + 2 Hkv) D], rows contiguous");
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat && cos.dim() == 2 && sin.dim() == 2 &&
              cos.size(0) == t_rows && sin.size(0) == t_rows && cos.size(1) == d && sin.size(1) == d,
              "lanes_quant: cos and sin must be fp32 [T, D]");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.numel() == t_rows, "lanes_quant: slots must be int64 [T]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), sl = slots.contiguous();
  const int64_t* slot = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_rows; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_total, "lanes_quant: a key slot is out of range");
  at::Tensor q = at::empty({t_rows, heads, d}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = cache_k.data_ptr<float>();
  float* vp = cache_v.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  parallel_for(0, t_rows, std::max<int64_t>(1, 8192 / ((heads + 2 * hkv) * d)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * stride;
      const float *ct = cp + t * d, *st = sp + t * d;
      for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * d, ct, st, d, qp + (t * heads + h) * d);
      for (int64_t g = 0; g < hkv; ++g) rotate_head(row + (heads + g) * d, ct, st, d, kp + (slot[t] * hkv + g) * d);
      std::memcpy(vp + slot[t] * hkv * d, row + (heads + hkv) * d, sizeof(float) * hkv * d);
    }
  });
  return attend_all(q, cache_k, cache_v, key_slots, row_first, row_len, scale).view({t_rows, heads * d});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) {
  m.def("paged_attention(Tensor q, Tensor cache_k, Tensor cache_v, Tensor key_slots, Tensor row_first, "
        "Tensor row_len, float scale) -> Tensor");
  m.def("rope_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) cache_k, Tensor(b!) cache_v, Tensor slots, "
        "Tensor key_slots, Tensor row_first, Tensor row_len, int heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) {
  m.impl("paged_attention", &paged_attention_op);
  m.impl("rope_attention", &rope_attention_op);
}
