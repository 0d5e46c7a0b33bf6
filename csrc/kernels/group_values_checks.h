// Argument checks of group_values (host-only, CPU and CUDA entry points).
#pragma once

#include "checks.h"
#include "group_values.h"

namespace d9d {

inline void check_group_values(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                               const at::Tensor& program, const at::Tensor& beta, const at::Tensor& out) {
  const char* op = "group_values";
  const auto dev = out.device();
  for (auto [arg, t] : {std::pair<const char*, const at::Tensor*>{"sum", &sum}, {"max", &max}, {"replica", &replica},
                        {"beta", &beta}, {"out", &out}}) {
    D9D_CHECK_TYPE(t->scalar_type() == at::kDouble, op, arg, "must be float64, got ", t->scalar_type());
    D9D_CHECK(t->dim() == 1 && t->is_contiguous(), op, arg, "must be a contiguous 1-D tensor, got shape ", t->sizes());
    check_device(op, arg, *t, dev);
  }
  check_index(op, "program", program);
  D9D_CHECK(program.dim() == 2 && program.size(1) == group_values::kCols && program.is_contiguous(), op, "program",
            "must be a contiguous [K, ", int(group_values::kCols), "], got shape ", program.sizes());
  check_device(op, "program", program, dev);
  D9D_CHECK(beta.size(0) == program.size(0), op, "beta", "must have one value per program row (",
            program.size(0), "), got ", beta.size(0));
}

inline group_values::Buffers buffers_of(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica) {
  return {sum.data_ptr<double>(), sum.numel(), max.data_ptr<double>(), max.numel(),
          replica.data_ptr<double>(), replica.numel()};
}

}  // namespace d9d
