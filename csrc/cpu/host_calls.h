// Host functions that one C++ call into the extension chains: forward's
// scratch reset and fold (forward_scratch.cpp) and a group's values on CPU
// buffers (group_compute.cpp), used by PlanRunner.forward (plan_runner.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace d9d {

// (kind: 0 SUM, 1 MAX, 2 REPLICA; state view; scratch view; reset values or none)
using ScratchRange = std::tuple<int64_t, at::Tensor, at::Tensor, std::optional<at::Tensor>>;

// Resets (fold = false) or folds into the state (fold = true) each range.
void scratch_ranges(const std::vector<ScratchRange>& ranges, bool fold);

// Folds each range into the state and resets its scratch (REPLICA: folded only).
void fold_and_clear(const std::vector<ScratchRange>& ranges);

// group_values into a new float64 output of out_size.
at::Tensor host_values_out(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                           const at::Tensor& program, const at::Tensor& beta, int64_t out_size, int64_t n_scalar);

// A view of x (1-D, stride `stride`) at element `offset` with contiguous `sizes`
// (in units of x's stride), made without the dispatcher.
at::Tensor value_view(const at::Tensor& x, int64_t offset, int64_t stride, c10::IntArrayRef sizes);

}  // namespace d9d
