// Argument checks of weighted_moments, shared by the CPU and CUDA entry points.
// They run before any write, so a failing call leaves the state unchanged.
#pragma once

#include "checks.h"

namespace d9d {

inline void check_weighted_moments(const at::Tensor& x, const std::optional<at::Tensor>& y,
                                   const std::optional<at::Tensor>& weights,
                                   const std::optional<at::Tensor>& mask, const at::Tensor& state,
                                   const at::Tensor& bad, const std::optional<at::Tensor>& pivot) {
  const char* op = "weighted_moments";
  const auto dev = x.device();
  check_real(op, "x", x);
  D9D_CHECK(x.dim() == 1, op, "x", "must be 1-D [N] (the dk.ops wrapper flattens), got shape ", x.sizes());
  if (y.has_value()) {
    check_real(op, "y", *y);
    D9D_CHECK(y->sizes() == x.sizes(), op, "y", "must have the shape of x ", x.sizes(), ", got ", y->sizes());
    check_device(op, "y", *y, dev);
  }
  if (weights.has_value()) {
    check_real(op, "weights", *weights);
    D9D_CHECK(weights->sizes() == x.sizes(), op, "weights", "must have the shape of x ", x.sizes(), ", got ",
              weights->sizes());
    check_device(op, "weights", *weights, dev);
  }
  check_mask(op, mask, x.sizes(), dev);
  check_state(op, "state", state, {9}, dev);
  check_state(op, "bad", bad, {1}, dev);
  if (pivot.has_value()) check_state(op, "pivot", *pivot, {2}, dev);
}

}  // namespace d9d
