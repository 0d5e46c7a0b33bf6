// forward's scratch copy of the state (d9d_kernels/core/storage.py) on CPU:
// resetting the ranges the last forward wrote and folding the ranges this one
// wrote into the state, each in one call (fold_and_clear: both, for the
// one-call forward of PlanRunner, which makes its batch values first). A range is a slice of one kind's
// buffer; a small group's forward has two or three of them, and dispatching
// a zero_ / add_ / maximum / copy_ per range cost more than its update.
//
//   reset: SUM, MAX  scratch = init (absent: 0);  REPLICA  scratch = state
//   fold:  SUM       state += scratch (- init);   MAX      state = max(state, scratch), NaN-propagating
//          REPLICA   state = scratch
// The same arithmetic as the torch ops storage.py falls back to, element by
// element, so the state is bit-identical either way. Host code: it lives with
// the CPU sources because the host compiler builds it.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "host_calls.h"

namespace py = pybind11;

namespace d9d {
namespace {

enum Kind : int64_t { kSum = 0, kMax = 1, kReplica = 2 };  // core.statistic.KINDS, in order

constexpr int64_t kGrain = 1 << 16;  // elements per task: a small group's ranges stay on the calling thread

double* plain(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kDouble && t.is_contiguous() && t.numel() == n,
              "d9d_kernels._C.scratch_ranges: argument 'ranges' holds a ", what,
              " that is not a contiguous float64 CPU tensor of ", n, " elements");
  return t.data_ptr<double>();
}

// One range, elements [b, e).
void one_range(int64_t kind, double* s, double* x, const double* i0, bool fold, int64_t b, int64_t e) {
  const size_t bytes = sizeof(double) * static_cast<size_t>(e - b);
  if (!fold) {
    if (kind == kReplica) {
      std::memcpy(x + b, s + b, bytes);
    } else if (i0 != nullptr) {
      std::memcpy(x + b, i0 + b, bytes);
    } else {
      std::memset(x + b, 0, bytes);  // +0.0 is all-zero bits
    }
  } else if (kind == kSum) {
    if (i0 != nullptr) {
      for (int64_t k = b; k < e; ++k) s[k] += x[k] - i0[k];
    } else {
      for (int64_t k = b; k < e; ++k) s[k] += x[k];
    }
  } else if (kind == kMax) {
    for (int64_t k = b; k < e; ++k) {
      const double u = s[k], v = x[k];
      s[k] = u != u ? u : v != v ? v : u > v ? u : v;  // nan_maximum (running_extrema.h): a tie takes the batch's
    }
  } else {
    std::memcpy(s + b, x + b, bytes);
  }
}

// Fold, then the next forward's reset, of elements [b, e) in one pass: for a
// forward whose batch values were made before. A SUM range without reset
// values (counts: a confusion matrix) skips the blocks whose scratch is all
// +0.0 bits: a small batch writes few cells of a large matrix, so the pass
// reads the scratch once and writes only those blocks, where fold + reset
// cost three passes. Adding +0.0 changes no state value but -0.0, which a
// SUM state built by additions from +0.0 never holds.
void fold_and_clear_range(int64_t kind, double* s, double* x, const double* i0, int64_t b, int64_t e) {
  if (kind != kSum || i0 != nullptr) {
    one_range(kind, s, x, i0, true, b, e);
    if (kind != kReplica) one_range(kind, s, x, i0, false, b, e);  // REPLICA: the scratch is the state now
    return;
  }
  constexpr int64_t kBlock = 64;  // 8 cache lines of float64: one branch per block
  auto fold = [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      s[k] += x[k];
      x[k] = 0.0;
    }
  };
  auto bits = [&](int64_t k) {  // +0.0 is all-zero bits
    uint64_t v;
    std::memcpy(&v, x + k, sizeof v);
    return v;
  };
  int64_t k0 = b;
  for (; k0 + kBlock <= e; k0 += kBlock) {
    uint64_t any = 0;
    for (int64_t k = k0; k < k0 + kBlock; ++k) any |= bits(k);
    if (any != 0) fold(k0, k0 + kBlock);
  }
  uint64_t any = 0;
  for (int64_t k = k0; k < e; ++k) any |= bits(k);
  if (any != 0) fold(k0, e);
}

// f(kind, state, scratch, reset values or nullptr, b, e) over each range's
// elements [b, e) in chunks: a large confusion matrix's range is
// memory-bound, so it takes every core's bandwidth, as the torch ops had.
template <class F>
void each_range(const std::vector<ScratchRange>& ranges, const F& f) {
  for (const auto& [kind, state, scratch, init] : ranges) {
    TORCH_CHECK(kind == kSum || kind == kMax || kind == kReplica,
                "d9d_kernels._C.scratch_ranges: argument 'ranges' holds kind ", kind, "; expected 0, 1 or 2");
    const int64_t n = state.numel();
    double* s = plain(state, n, "state");
    double* x = plain(scratch, n, "scratch");
    const double* i0 = init.has_value() ? plain(*init, n, "reset value") : nullptr;
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) { f(kind, s, x, i0, b, e); });
  }
}

}  // namespace

void fold_and_clear(const std::vector<ScratchRange>& ranges) { each_range(ranges, fold_and_clear_range); }

void scratch_ranges(const std::vector<ScratchRange>& ranges, bool fold) {
  each_range(ranges, [fold](int64_t kind, double* s, double* x, const double* i0, int64_t b, int64_t e) {
    one_range(kind, s, x, i0, fold, b, e);
  });
}

// Adds scratch_ranges to the module; without it (an error here) forward
// dispatches the torch ops per range.
void add_forward_scratch(PyObject* module) {
  try {
    py::module_ m = py::reinterpret_borrow<py::module_>(module);
    m.def("scratch_ranges", &scratch_ranges, "forward's scratch ranges reset (fold=False) or folded into the state");
  } catch (const std::exception&) {
    PyErr_Clear();
  }
}

}  // namespace d9d
