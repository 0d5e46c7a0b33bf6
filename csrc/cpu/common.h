// Host-side helpers of the CPU kernels: the thread-private chunking every
// CPU kernel uses and strided views of its inputs (argument checks:
// csrc/kernels/checks.h, shared with CUDA).
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kernels/checks.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace d9d {

// Bytes of thread-private accumulators we allow per call (all chunks together).
constexpr int64_t kPrivateBudgetBytes = int64_t(64) << 20;

// Number of chunks (= thread-private accumulators) for n items: one per
// thread, at least `grain` items each, their private state within budget.
// 1 means "run inline in the calling thread, accumulate straight into the
// state" (no allocation, no thread hand-off: the path of tiny inputs).
inline int64_t num_chunks(int64_t n, int64_t grain, int64_t private_bytes = 0) {
  if (n <= grain || at::in_parallel_region()) return 1;
  int64_t c = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (private_bytes > 0) c = std::min<int64_t>(c, std::max<int64_t>(1, kPrivateBudgetBytes / private_bytes));
  return std::max<int64_t>(c, 1);
}

// Runs f(chunk, begin, end) for `chunks` equal slices of [0, n).
template <class F>
inline void for_chunks(int64_t n, int64_t chunks, const F& f) {
  if (chunks <= 1) {
    f(int64_t(0), int64_t(0), n);
    return;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) f(c, c * n / chunks, (c + 1) * n / chunks);
  });
}

// Strided element access for inputs that may be views (broadcast masks,
// weights broadcast from a scalar): no copy is made for them.
template <class T>
struct Strided1 {
  const T* p;
  int64_t s;
  inline const T& operator[](int64_t i) const { return p[i * s]; }
};

template <class T>
inline Strided1<T> strided1(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.dim() == 0 ? 0 : t.stride(0)};
}

template <class T>
struct Strided2 {
  const T* p;
  int64_t s0, s1;
  inline const T& operator()(int64_t i, int64_t j) const { return p[i * s0 + j * s1]; }
};

template <class T>
inline Strided2<T> strided2(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

}  // namespace d9d
