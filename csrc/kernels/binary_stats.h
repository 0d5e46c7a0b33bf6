// Per-entry math of binary_stats / score_histogram (d9d_kernels.reference),
// shared by csrc/cpu/*.cpp and csrc/cuda/*.cu.
#pragma once

#include "common.h"

namespace d9d {

// Where a kept entry that is not counted goes in bad[2]: 0 for a target that
// is not 0/1, 1 for a NaN/Inf pred with a good target; -1 when it is counted.
D9D_HD inline int binary_bad_cause(int64_t target, double pred) {
  if (!(target == 0 || target == 1)) return 0;
  return is_finite(pred) ? -1 : 1;
}

// binary_bad_cause into a GPU thread's two register counters: adds a kept
// entry that is not counted to its cause's and returns true; false (nothing
// added) for an entry to count. Branch-free adds: the CPU loops keep the
// branch on the cause, their counters live in memory.
D9D_HD inline bool binary_count_bad(int64_t target, double pred, uint32_t& bad_target, uint32_t& bad_pred) {
  const int cause = binary_bad_cause(target, pred);
  bad_target += cause == 0;
  bad_pred += cause == 1;
  return cause >= 0;
}

// An entry (kept by mask / ignore_index) is counted iff this holds, else it is bad.
D9D_HD inline bool binary_entry_ok(int64_t target, double pred) { return binary_bad_cause(target, pred) < 0; }

// The probability of a pred: sigmoid for logits.
D9D_HD inline double to_prob(double pred, bool logits) { return logits ? sigmoid(pred) : pred; }

// The rule "sigmoid(v) > threshold" without an exp for most logits: sigmoid
// is monotonic, so compare v with logit(threshold) and fall back to the exact
// sigmoid within a margin where rounding could decide. The margin (1e-9
// relative) moves sigmoid by >= threshold * (1 - threshold) * 1e-9 >> 1 ulp
// for thresholds in [1e-5, 1 - 1e-5]; outside that range always take the exact
// path. Saves one exp per entry: binary_stats 1e7 logits (bench/bench_kernels.py).
struct Threshold {
  double p;      // the probability threshold
  double logit;  // log(p / (1 - p))
  bool fast;     // the logit comparison is safe
};

D9D_HD inline Threshold make_threshold(double p) {
  const bool fast = p >= 1e-5 && p <= 1.0 - 1e-5;
  return Threshold{p, fast ? log(p) - log1p(-p) : 0.0, fast};
}

D9D_HD inline bool is_positive(double v, bool logits, const Threshold& t) {
  if (!logits) return v > t.p;
  const double d = v - t.logit;
  const bool exact = !t.fast || !(fabs(d) > 1e-9 * (1.0 + fabs(t.logit)));  // rare: predictable
  return exact ? sigmoid(v) > t.p : d > 0.0;
}

// Slot of state[l] = (tp, fp, tn, fn), branch-free: with random labels the
// branchy form mispredicts on every other entry.
D9D_HD inline int binary_cell(bool pos, bool target_pos) { return (pos ? 0 : 2) + (pos != target_pos ? 1 : 0); }

// Offset of hist[pos ? 0 : 1, label, bin] in the [2, L, B] histogram.
D9D_HD inline int64_t hist_slot(bool target_pos, int64_t label, int64_t bin, int64_t n_labels, int64_t n_bins) {
  return (target_pos ? 0 : n_labels * n_bins) + label * n_bins + bin;
}

}  // namespace d9d
