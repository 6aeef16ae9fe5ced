// Checks the CPU kernels share.
#pragma once

#include <ATen/ATen.h>

namespace lanes_quant {

// `ids` as a contiguous int64 [R] tensor of row ids, each checked to lie in [0, n).
inline at::Tensor checked_row_ids(const at::Tensor& ids, int64_t n) {
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "lanes_quant: ids must be int64 [R]");
  at::Tensor idc = ids.contiguous();
  if (idc.numel() > 0) {
    const auto [lo, hi] = at::aminmax(idc);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < n, "lanes_quant: a row id is out of range");
  }
  return idc;
}

}  // namespace lanes_quant
