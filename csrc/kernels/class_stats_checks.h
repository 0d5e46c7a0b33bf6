// Argument checks of class_stats, shared by the CPU and CUDA entry points.
// They run before any write, so a failing call leaves the state unchanged.
#pragma once

#include "checks.h"

namespace d9d {

inline void check_class_stats(const at::Tensor& preds, const at::Tensor& target,
                              const std::optional<at::Tensor>& mask, int64_t num_classes, at::IntArrayRef top_ks,
                              bool nll, const at::Tensor& stats, const std::optional<at::Tensor>& confmat,
                              const at::Tensor& extras, const at::Tensor& bad) {
  const char* op = "class_stats";
  const auto dev = preds.device();
  const int64_t C = num_classes;
  D9D_CHECK(C >= 1, op, "num_classes", "must be >= 1, got ", C);
  check_index(op, "target", target);
  D9D_CHECK(target.dim() == 1, op, "target", "must be 1-D [N] (the dk.ops wrapper flattens), got shape ",
            target.sizes());
  check_device(op, "target", target, dev);
  const int64_t n = target.size(0);
  const bool scores = at::isFloatingType(preds.scalar_type());
  if (scores) {
    D9D_CHECK(preds.dim() == 2 && preds.size(0) == n && preds.size(1) == C, op, "preds",
              "scores must have shape [N, num_classes] = [", n, ", ", C, "], got ", preds.sizes());
  } else {
    D9D_CHECK_TYPE(preds.scalar_type() == at::kLong, op, "preds",
                   "must be int64 class indices or float16/bfloat16/float32/float64 scores, got ",
                   preds.scalar_type());
    D9D_CHECK(preds.sizes() == target.sizes(), op, "preds", "indices must have the shape of target ",
              target.sizes(), ", got ", preds.sizes());
  }
  D9D_CHECK(!top_ks.empty() || (nll && scores), op, "top_ks",
            "must be non-empty unless nll with scores (then only extras and bad are counted)");
  for (size_t a = 0; a < top_ks.size(); ++a) {  // K is tiny: a quadratic test, no allocation
    D9D_CHECK(top_ks[a] >= 1 && top_ks[a] <= C, op, "top_ks", "must lie in [1, num_classes=", C, "], got ", top_ks);
    for (size_t b = 0; b < a; ++b) D9D_CHECK(top_ks[a] != top_ks[b], op, "top_ks", "must be distinct, got ", top_ks);
  }
  D9D_CHECK(scores || (top_ks.size() == 1 && top_ks[0] == 1), op, "top_ks",
            "must be [1] when preds are class indices (top-k needs scores), got ", top_ks);
  D9D_CHECK(scores || !nll, op, "nll", "needs scores/logits preds, got class indices");
  check_mask(op, mask, target.sizes(), dev);
  check_state(op, "stats", stats, {static_cast<int64_t>(top_ks.size()), 3, C}, dev);
  if (confmat.has_value()) check_state(op, "confmat", *confmat, {C, C}, dev);
  check_state(op, "extras", extras, {2}, dev);
  check_state(op, "bad", bad, {2}, dev);
}

}  // namespace d9d
