// RMSNorm on the CPU (AVX-512), registered as `lanes_quant::rms_norm`: x * rsqrt(mean(x^2) + eps) * weight over
// each row's last dimension, in fp32, as the Hugging Face decoders compute it. One op where torch's
// composite takes eight (pow, mean, add, rsqrt, two muls and their copies: 30 us a call from the pass
// thread, a tenth of a one-row decode step); a row's sum of squares in one fixed order (16 lanes, then
// their sum), so its result never depends on the pass's other rows.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>

#include "cpu_math.h"
#include "cpu_pool.h"

namespace {

using namespace lanes_quant;

// x [..., H] fp32, weight [H] fp32 -> [..., H] fp32.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dtype() == at::kFloat && weight.dtype() == at::kFloat && weight.dim() == 1 && x.dim() >= 1 &&
              x.size(-1) == weight.size(0), "lanes_quant: rms_norm takes fp32 x [..., H] and weight [H]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t width = xc.size(-1), rows = width ? xc.numel() / width : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 v = load_lanes(lanes_from(width, i), row + i);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(width) + epsilon);
      const __m512 s = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < width; i += 16) {
        const __mmask16 m = lanes_from(width, i);
        const __m512 v = load_lanes(m, row + i), w = load_lanes(m, wp + i);
        store_lanes(op + t * width + i, m, _mm512_mul_ps(w, _mm512_mul_ps(v, s)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) { m.impl("rms_norm", &rms_norm_op); }
