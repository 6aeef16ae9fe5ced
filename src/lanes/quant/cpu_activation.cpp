// The gated MLP's activation on the CPU (AVX-512 or AVX2), registered as `lanes_quant::silu_mul`: silu(gate) * up
// in one pass over gate_up, every value by the same instructions wherever it sits, so a row's result does
// not depend on the pass's other rows (torch's vector loop leaves a split's or a row's tail to scalar code,
// which rounds differently).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"
#include "cpu_pool.h"

namespace {

using namespace lanes_quant;

// gate_up [T, 2I] fp32 (gate first, then up) -> [T, I] fp32.
at::Tensor silu_mul_op(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dtype() == at::kFloat && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "lanes_quant: gate_up must be fp32 [T, 2I]");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = xp + t * 2 * width;
      const float* up = gate + width;
      for (int64_t i = 0; i < width; i += 16) {
        const Mask16 m = lanes_from(width, i);
        const V16 g = load_lanes(m, gate + i), u = load_lanes(m, up + i);
        store_lanes(op + t * width + i, m, vmul(silu(g), u));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lanes_quant, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(lanes_quant, CPU, m) { m.impl("silu_mul", &silu_mul_op); }
