// Argument checks of binary_stats and score_histogram (shared by the CPU and
// CUDA entry points). They run before any write: a failing call leaves the
// state unchanged.
#pragma once

#include "checks.h"

namespace d9d {

inline void check_binary_stats(const at::Tensor& preds, const at::Tensor& target,
                               const std::optional<at::Tensor>& mask, int64_t input_kind, const at::Tensor& state,
                               const at::Tensor& bad, bool native_target = false) {
  const char* op = "binary_stats";
  const auto dev = preds.device();
  D9D_CHECK_TYPE(!preds.is_complex(), op, "preds", "must be real, got ", preds.scalar_type());
  D9D_CHECK(preds.dim() == 2, op, "preds", "must be 2-D [N, L] (the dk.ops wrapper reshapes), got shape ",
            preds.sizes());
  if (!native_target) check_index(op, "target", target);  // the CUDA kernels also read int32/uint8/bool
  D9D_CHECK(target.sizes() == preds.sizes(), op, "target", "must have the shape of preds ", preds.sizes(),
            ", got ", target.sizes());
  check_device(op, "target", target, dev);
  check_input_kind(op, input_kind);
  check_mask(op, mask, preds.sizes(), dev);
  check_state(op, "state", state, {preds.size(1), 4}, dev);
  check_state(op, "bad", bad, {2}, dev);
}

inline void check_score_histogram(const at::Tensor& preds, const at::Tensor& target,
                                  const std::optional<at::Tensor>& mask, int64_t input_kind, bool multiclass,
                                  const at::Tensor& hist, const at::Tensor& bad, bool native_target = false) {
  const char* op = "score_histogram";
  const auto dev = preds.device();
  check_floating(op, "preds", preds);
  D9D_CHECK(preds.dim() == 2, op, "preds", "must be 2-D [N, L] (the dk.ops wrapper reshapes), got shape ",
            preds.sizes());
  if (!native_target) check_index(op, "target", target);  // the CUDA kernels also read int32/uint8/bool
  if (multiclass) {
    D9D_CHECK(target.dim() == 1 && target.size(0) == preds.size(0), op, "target",
              "must be [N] class indices when multiclass, N = ", preds.size(0), ", got ", target.sizes());
  } else {
    D9D_CHECK(target.sizes() == preds.sizes(), op, "target", "must have the shape of preds ", preds.sizes(),
              ", got ", target.sizes());
  }
  check_device(op, "target", target, dev);
  check_input_kind(op, input_kind);
  check_mask(op, mask, target.sizes(), dev);
  D9D_CHECK(hist.dim() == 3 && hist.size(0) == 2 && hist.size(1) == preds.size(1) && hist.size(2) >= 1, op, "hist",
            "must be float64 [2, L, B] with L = ", preds.size(1), " and B >= 1, got shape ", hist.sizes());
  check_state(op, "hist", hist, hist.sizes(), dev);
  check_state(op, "bad", bad, {2}, dev);
}

}  // namespace d9d
