// RMSNorm on the CPU (AVX-512 or AVX2), registered as `lanes_quant::rms_norm`: x * rsqrt(mean(x^2) + eps) * weight over
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
      V16 squares = vzero();
      for (int64_t i = 0; i < width; i += 16) {
        const V16 v = load_lanes(lanes_from(width, i), row + i);
        squares = vfmadd(v, v, squares);
      }
      const float scale = 1.0f / std::sqrt(vsum(squares) / static_cast<float>(width) + epsilon);
      const V16 s = vset(scale);
      for (int64_t i = 0; i < width; i += 16) {
        const Mask16 m = lanes_from(width, i);
        const V16 v = load_lanes(m, row + i), w = load_lanes(m, wp + i);
        store_lanes(op + t * width + i, m, vmul(w, vmul(v, s)));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) { m.impl("rms_norm", &rms_norm_op); }
