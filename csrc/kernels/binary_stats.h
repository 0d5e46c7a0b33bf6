// Per-entry math of binary_stats / score_histogram (d9d_kernels.reference),
// shared by csrc/cpu/*.cpp and csrc/cuda/*.cu.
#pragma once

#include "common.h"

namespace d9d {

// An entry (kept by mask / ignore_index) is counted iff this holds, else it is bad.
D9D_HD inline bool binary_entry_ok(int64_t target, double pred) {
  return (target == 0 || target == 1) && is_finite(pred);
}

// The probability of a pred: sigmoid for logits.
D9D_HD inline double to_prob(double pred, bool logits) { return logits ? sigmoid(pred) : pred; }

// Slot of state[l] = (tp, fp, tn, fn); positive iff prob > threshold.
D9D_HD inline int binary_cell(double prob, double threshold, bool target_pos) {
  const bool pos = prob > threshold;
  return pos ? (target_pos ? 0 : 1) : (target_pos ? 3 : 2);
}

// Offset of hist[pos ? 0 : 1, label, bin] in the [2, L, B] histogram.
D9D_HD inline int64_t hist_slot(bool target_pos, int64_t label, int64_t bin, int64_t n_labels, int64_t n_bins) {
  return (target_pos ? 0 : n_labels * n_bins) + label * n_bins + bin;
}

}  // namespace d9d
