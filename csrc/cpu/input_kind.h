// INPUT_AUTO on CPU: "logits iff any valid pred of this call lies outside
// [0, 1]" needs a pass of its own before any entry can be classified. It
// stops at the first such pred (logits are found at once in practice).
#pragma once

#include <algorithm>
#include <atomic>

#include "../kernels/binary_stats.h"
#include "common.h"

namespace d9d {

// Elementwise form: entries valid on their own (binary / multilabel).
template <class T>
bool any_logit_entries(const Strided2<T>& p, const Strided2<int64_t>& t, const Strided2<bool>& m, bool has_m,
                       bool has_ignore, int64_t ignore_index, int64_t n, int64_t L, int64_t grain_rows) {
  std::atomic<bool> found{false};
  // Branch-free inner loop over blocks of rows, one early-exit test per block:
  // with probabilities the whole call is read, so a test per entry would
  // cost more than the scan itself.
  constexpr int64_t kBlock = 1024;
  for_chunks(n, num_chunks(n, grain_rows), [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i0 = b; i0 < e && !found.load(std::memory_order_relaxed); i0 += kBlock) {
      bool any = false;
      const int64_t i1 = std::min(e, i0 + kBlock);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < L; ++j) {
          const int64_t tv = t(i, j);
          const double v = static_cast<double>(p(i, j));
          any |= kept(!has_m || m(i, j), has_ignore, tv, ignore_index) & binary_entry_ok(tv, v) & outside_unit(v);
        }
      }
      if (any) found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

}  // namespace d9d
