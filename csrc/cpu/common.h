// Host-side helpers of the C++ ops: argument checks (shared with the CUDA
// launchers) and the thread-private chunking used by every CPU kernel.
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace d9d {

// "d9d_kernels.<op>: argument '<arg>' <msg...>"; TypeError for dtypes, ValueError else.
#define D9D_CHECK_TYPE(cond, op, arg, ...) \
  TORCH_CHECK_TYPE(cond, "d9d_kernels.", op, ": argument '", arg, "' ", __VA_ARGS__)
#define D9D_CHECK(cond, op, arg, ...) \
  TORCH_CHECK_VALUE(cond, "d9d_kernels.", op, ": argument '", arg, "' ", __VA_ARGS__)

inline void check_device(const char* op, const char* arg, const at::Tensor& t, const at::Device& dev) {
  D9D_CHECK(t.device() == dev, op, arg, "must be on ", dev, " (the device of the first input), got ", t.device());
}

// A state tensor: float64, contiguous, exactly `shape`, on `dev`.
inline void check_state(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef shape,
                        const at::Device& dev) {
  D9D_CHECK_TYPE(t.scalar_type() == at::kDouble, op, arg, "must be float64 ", shape, ", got ", t.scalar_type());
  D9D_CHECK(t.sizes() == shape, op, arg, "must be float64 ", shape, ", got shape ", t.sizes());
  check_device(op, arg, t, dev);
  D9D_CHECK(t.is_contiguous(), op, arg, "must be contiguous (it is written in place)");
}

inline void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  D9D_CHECK_TYPE(at::isFloatingType(t.scalar_type()), op, arg,
                 "must be float16/bfloat16/float32/float64, got ", t.scalar_type());
}

inline void check_index(const char* op, const char* arg, const at::Tensor& t) {
  D9D_CHECK_TYPE(t.scalar_type() == at::kLong, op, arg, "must be int64, got ", t.scalar_type());
}

inline void check_mask(const char* op, const std::optional<at::Tensor>& mask, at::IntArrayRef shape,
                       const at::Device& dev) {
  if (!mask.has_value()) return;
  D9D_CHECK_TYPE(mask->scalar_type() == at::kBool, op, "mask", "must be bool, got ", mask->scalar_type());
  D9D_CHECK(mask->sizes() == shape, op, "mask", "must have shape ", shape, ", got ", mask->sizes());
  check_device(op, "mask", *mask, dev);
}

inline void check_input_kind(const char* op, int64_t input_kind) {
  D9D_CHECK(input_kind >= 0 && input_kind <= 2, op, "input_kind",
            "must be 0 (probs), 1 (logits) or 2 (auto), got ", input_kind);
}


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
