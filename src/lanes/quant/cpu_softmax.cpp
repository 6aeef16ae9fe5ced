// Log-softmax over a pass's logits on the CPU (AVX-512 or AVX2), registered as `lanes_quant::log_softmax` (every
// value, for top logprobs) and `lanes_quant::greedy` (each row's argmax and its log-probability only).
// Both take a row's maximum and its sum of exponentials by the same instructions in the same order, so a
// greedy pass's logprob has the bits a sampling pass reports for the same token. One op a pass where
// torch's argmax, log_softmax and gather took three (and wake their OpenMP threads after a decode step's
// kernels: 1-1.5 ms a pass at 8 lanes here, against 0.4 ms on warm threads).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_math.h"
#include "cpu_pool.h"

namespace {

using namespace lanes_quant;

struct RowStats {
  float top;     // the row's maximum (NaN if it has one, as torch's argmax takes a NaN for the maximum)
  int64_t at;    // its first position
  float lse;     // log of the sum of exp(x - top), summed in 16 lanes in order, then across them
};

RowStats row_stats(const float* x, int64_t V) {
  const V16 lowest = vset(-std::numeric_limits<float>::infinity());
  V16 best = lowest;
  I16 index = iramp(), where = index;
  Mask16 nan = 0;
  for (int64_t i = 0; i < V; i += 16) {
    const Mask16 m = lanes_from(V, i);
    const V16 v = m == 0xFFFF ? vload(x + i) : vselect(m, vload_masked(m, x + i), lowest);
    nan |= vnan(v);
    const Mask16 above = vgreater(v, best);  // strictly: a lane keeps its first
    best = vselect(above, v, best);
    where = iselect(above, index, where);
    index = iadd16(index);
  }
  if (nan) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return {x[i], i, x[i]};
  }
  RowStats s{};
  s.top = vtop(best);
  const Mask16 tops = vequal(best, vset(s.top));
  s.at = ileast(tops, where);  // the first position among the lanes holding it
  const V16 top = vset(s.top);
  V16 sum = vzero();
  for (int64_t i = 0; i < V; i += 16) {
    const Mask16 m = lanes_from(V, i);
    sum = vadd(sum, vkeep(m, exp_nonpositive(vsub(load_lanes(m, x + i), top))));
  }
  s.lse = std::log(vsum(sum));
  return s;
}

void check(const at::Tensor& logits) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "lanes_quant: logits must be fp32 [R, V]");
}

// logits [R, V] fp32 -> [R, V] fp32: (x - max) - log(sum(exp(x - max))) a row.
at::Tensor log_softmax_op(const at::Tensor& logits) {
  check(logits);
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t R = x.size(0), V = x.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowStats s = row_stats(xp + r * V, V);
      const V16 top = vset(s.top), lse = vset(s.lse);
      for (int64_t i = 0; i < V; i += 16) {
        const Mask16 m = lanes_from(V, i);
        const V16 v = load_lanes(m, xp + r * V + i);
        store_lanes(op + r * V + i, m, vsub(vsub(v, top), lse));
      }
    }
  });
  return out;
}

// logits [R, V] fp32 -> [2, R] float64: each row's argmax (its first position) and its log_softmax value.
at::Tensor greedy_op(const at::Tensor& logits) {
  check(logits);
  const at::Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({2, R}, x.options().dtype(at::kDouble));
  const float* xp = x.data_ptr<float>();
  double* op = out.data_ptr<double>();
  parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowStats s = row_stats(xp + r * V, V);
      op[r] = static_cast<double>(s.at);
      op[R + r] = static_cast<double>((xp[r * V + s.at] - s.top) - s.lse);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) {
  m.def("log_softmax(Tensor logits) -> Tensor");
  m.def("greedy(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) {
  m.impl("log_softmax", &log_softmax_op);
  m.impl("greedy", &greedy_op);
}
