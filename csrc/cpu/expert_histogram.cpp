// expert_histogram on CPU: the rows of indices are cut into tasks (row, slice
// of the row), enough for every thread; each task counts into its own
// histograms, and the calling thread adds them into load. A task keeps
// kSub interleaved uint32 histograms (slot i counts into copy i % kSub), so a
// run of one expert (the "one expert takes all" routing) does not chain every
// increment through one counter. The slot loop costs about one increment
// (load, add, store) per slot; on contiguous rows it prefetches kAhead slots
// ahead, as a large batch streams from memory (bench/analysis.md, "MoE
// router statistics"). The gate sums are one task per row.
// Specification: d9d_kernels/reference.py::expert_histogram.
#include <ATen/Dispatch.h>

#include <array>
#include <cstring>

#include "common.h"
#include "../kernels/expert_histogram_checks.h"

namespace d9d {

namespace {

constexpr int64_t kGrain = 1 << 14;  // slots per task at least
constexpr int kSub = 2;              // interleaved histograms per task (E <= kSubMaxE); 4 or 8 were slower on random routing (bench/analysis.md)
constexpr int64_t kSubMaxE = 4096;   // beyond this one histogram per task (its copies would not stay in cache)
constexpr int64_t kFlush = int64_t(1) << 30;  // slots counted before the uint32 counters are flushed
constexpr int64_t kUnroll = 8;       // slots per step of the unrolled loop (a 64-byte line of int64)
constexpr int64_t kAhead = 1024;     // slots the contiguous loop prefetches ahead (8 KiB of int64)

// One slot: its expert's counter in h, or the bad count (-1, a dropped slot, is neither).
inline void count_slot(int64_t v, uint64_t ue, uint32_t* h, int64_t& bad) {
  if (static_cast<uint64_t>(v) < ue) {
    ++h[v];
  } else {
    bad += v != -1;
  }
}

// Counts slots [b, e) of one row (element stride s; kContig: s == 1) into
// out[E] (int64) and its bad slots into nbad.
template <bool kContig, class I>
void count_row(const I* p, int64_t s, int64_t b, int64_t e, int64_t E, int64_t* out, int64_t& nbad,
               std::vector<uint32_t>& sub) {
  const int ns = E <= kSubMaxE ? kSub : 1;
  const uint64_t ue = static_cast<uint64_t>(E);
  const auto at = [&](int64_t i) { return static_cast<int64_t>(kContig ? p[i] : p[i * s]); };
  int64_t bad = 0;
  for (int64_t lo = b; lo < e; lo += kFlush) {
    const int64_t hi = std::min(e, lo + kFlush);
    std::fill(sub.begin(), sub.begin() + ns * E, 0u);
    uint32_t* h = sub.data();
    int64_t i = lo;
    if (ns == kSub) {
      if constexpr (kContig) {
        for (; i + kUnroll + kAhead <= hi; i += kUnroll) {
#if defined(__GNUC__)
          __builtin_prefetch(p + i + kAhead);
#endif
          for (int k = 0; k < kUnroll; ++k) count_slot(at(i + k), ue, h + (k % kSub) * E, bad);
        }
      }
      for (; i + kUnroll <= hi; i += kUnroll) {
        for (int k = 0; k < kUnroll; ++k) count_slot(at(i + k), ue, h + (k % kSub) * E, bad);
      }
    }
    for (; i < hi; ++i) count_slot(at(i), ue, h, bad);
    for (int k = 0; k < ns; ++k) {
      for (int64_t x = 0; x < E; ++x) out[x] += h[k * E + x];
    }
  }
  nbad += bad;
}

void expert_histogram_cpu(const at::Tensor& indices, at::IntArrayRef layers, const std::optional<at::Tensor>& probs,
                          const at::Tensor& load, const std::optional<at::Tensor>& gate, const at::Tensor& bad) {
  check_expert_histogram(indices, layers, probs, load, gate, bad);
  const int64_t R = indices.size(0), N = indices.size(1), E = load.size(1);
  double* ld = load.data_ptr<double>();
  if (R > 0 && N > 0) {
    // threads only for work worth a hand-off (a tiny batch runs inline: no pool wake-up)
    const int64_t threads = (at::in_parallel_region() || R * N < 4 * kGrain) ? 1 : at::get_num_threads();
    // slices per row: every thread busy when rows are few, each slice at least kGrain slots
    const int64_t per_row =
        std::max<int64_t>(1, std::min<int64_t>((N + kGrain - 1) / kGrain, (threads + R - 1) / R));
    // rows per wave: the tasks' int64 histograms within the private budget
    const int64_t wave = std::max<int64_t>(1, std::min<int64_t>(R, kPrivateBudgetBytes / (per_row * E * 8)));
    std::vector<int64_t> hist, nbad;
    int64_t total_bad = 0;
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "expert_histogram_cpu", [&] {
      const index_t* p = indices.data_ptr<index_t>();
      const int64_t s0 = indices.stride(0), s1 = indices.stride(1);
      for (int64_t r0 = 0; r0 < R; r0 += wave) {
        const int64_t rows = std::min(wave, R - r0), tasks = rows * per_row;
        hist.assign(tasks * E, 0);
        nbad.assign(tasks, 0);
        auto work = [&](int64_t tb, int64_t te) {
          std::vector<uint32_t> sub((E <= kSubMaxE ? kSub : 1) * E);
          for (int64_t t = tb; t < te; ++t) {
            const int64_t r = t / per_row, c = t % per_row;
            const index_t* row = p + (r0 + r) * s0;
            const int64_t b = c * N / per_row, e = (c + 1) * N / per_row;
            if (s1 == 1) {
              count_row<true>(row, s1, b, e, E, hist.data() + t * E, nbad[t], sub);
            } else {
              count_row<false>(row, s1, b, e, E, hist.data() + t * E, nbad[t], sub);
            }
          }
        };
        if (tasks == 1 || threads == 1) {
          work(0, tasks);
        } else {
          at::parallel_for(0, tasks, 1, work);
        }
        for (int64_t t = 0; t < tasks; ++t) {
          double* dst = ld + layers[r0 + t / per_row] * E;
          const int64_t* h = hist.data() + t * E;
          for (int64_t x = 0; x < E; ++x) dst[x] += static_cast<double>(h[x]);
          total_bad += nbad[t];
        }
      }
    });
    bad.data_ptr<double>()[0] += static_cast<double>(total_bad);
  }
  if (probs.has_value() && R > 0) {
    const at::Tensor& pr = *probs;
    const int64_t T = pr.size(1);
    double* g = gate->data_ptr<double>();
    std::vector<double> sums(R * E, 0.0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pr.scalar_type(), "expert_histogram_cpu_gate", [&] {
      const scalar_t* q = pr.data_ptr<scalar_t>();
      const int64_t s0 = pr.stride(0), s1 = pr.stride(1), s2 = pr.stride(2);
      auto rows = [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          double* acc = sums.data() + r * E;
          for (int64_t t = 0; t < T; ++t) {
            const scalar_t* row = q + r * s0 + t * s1;
            for (int64_t x = 0; x < E; ++x) acc[x] += static_cast<double>(row[x * s2]);
          }
        }
      };
      if (at::in_parallel_region() || R * T * E <= kGrain) {
        rows(0, R);
      } else {
        at::parallel_for(0, R, 1, rows);
      }
    });
    for (int64_t r = 0; r < R; ++r) {
      double* dst = g + layers[r] * (E + 1);
      for (int64_t x = 0; x < E; ++x) dst[x] += sums[r * E + x];
      dst[E] += static_cast<double>(T);
    }
  }
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("expert_histogram", &d9d::expert_histogram_cpu); }
