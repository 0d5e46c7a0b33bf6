// Argument checks of expert_histogram, shared by the CPU and CUDA entry points
// and the Meta kernel. They run before any write, so a failing call leaves the
// state unchanged.
#pragma once

#include "checks.h"

namespace d9d {

inline void check_expert_histogram(const at::Tensor& indices, at::IntArrayRef layers,
                                   const std::optional<at::Tensor>& probs, const at::Tensor& load,
                                   const std::optional<at::Tensor>& gate, const at::Tensor& bad) {
  const char* op = "expert_histogram";
  const auto dev = indices.device();
  D9D_CHECK_TYPE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt, op, "indices",
                 "must be int64 or int32, got ", indices.scalar_type());
  D9D_CHECK(indices.dim() == 2, op, "indices",
            "must be 2-D [L', T * top_k] (the dk.ops wrapper flattens), got shape ", indices.sizes());
  D9D_CHECK(load.dim() == 2 && load.size(1) >= 1, op, "load", "must be float64 [L, E] with E >= 1, got shape ",
            load.sizes());
  const int64_t L = load.size(0), E = load.size(1);
  check_state(op, "load", load, {L, E}, dev);
  D9D_CHECK(static_cast<int64_t>(layers.size()) == indices.size(0), op, "layers", "must hold one layer id per row of ",
            "indices (", indices.size(0), "), got ", layers.size());
  for (const int64_t l : layers) {
    D9D_CHECK(l >= 0 && l < L, op, "layers", "must lie in [0, ", L, ") (the rows of load), got ", l);
  }
  if (probs.has_value()) {
    check_floating(op, "probs", *probs);
    D9D_CHECK(probs->dim() == 3 && probs->size(0) == indices.size(0) && probs->size(2) == E, op, "probs",
              "must be [L', T, E] = [", indices.size(0), ", T, ", E, "], got shape ", probs->sizes());
    check_device(op, "probs", *probs, dev);
    D9D_CHECK(gate.has_value(), op, "gate", "must be given (float64 [L, E + 1]) with probs");
  }
  if (gate.has_value()) check_state(op, "gate", *gate, {L, E + 1}, dev);
  check_state(op, "bad", bad, {1}, dev);
}

}  // namespace d9d
