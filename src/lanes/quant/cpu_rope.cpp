// Rotary embedding on the CPU (AVX-512 or AVX2), registered as `lanes_quant::rope`: x * cos + rotate_half(x) * sin
// in one pass, with the reference's roundings (a product, a product, a sum: no fma), so its values equal
// the torch ops' bit for bit, and every value is computed alike wherever it sits.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "cpu_math.h"
#include "cpu_pool.h"

namespace {

using namespace lanes_quant;

// x [T, H, D] fp32 (heads and values contiguous, rows any stride); cos, sin [T, D] fp32 -> [T, H, D].
at::Tensor rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "lanes_quant: x must be fp32 [T, H, D], each row's heads contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "lanes_quant: the head size must be even");
  TORCH_CHECK(cos.dtype() == at::kFloat && sin.dtype() == at::kFloat && cos.dim() == 2 && sin.dim() == 2 &&
                  cos.size(0) == rows && sin.size(0) == rows && cos.size(1) == dim && sin.size(1) == dim,
              "lanes_quant: cos and sin must be fp32 [T, D]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(heads * dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * dim;
      const float* st = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate_head(xp + t * stride + h * dim, ct, st, dim, op + (t * heads + h) * dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) { m.impl("rope", &rope_op); }
