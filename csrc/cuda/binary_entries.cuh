// [N, L] entries of binary_stats / score_histogram on CUDA: strided access,
// the keep rule, and the INPUT_AUTO flag kernel shared by both ops.
#pragma once

#include "../kernels/binary_stats.h"
#include "common.cuh"

namespace d9d {
namespace cuda {

template <class T>
struct Entries {
  const T* preds;
  const int64_t* target;
  const bool* mask;
  int64_t p0, p1, t0, t1, m0, m1, n, L;
  bool has_ignore;
  int64_t ignore_index;
  __device__ double p(int64_t i, int64_t j) const { return static_cast<double>(preds[i * p0 + j * p1]); }
  __device__ int64_t t(int64_t i, int64_t j) const { return target[i * t0 + j * t1]; }
  __device__ bool keep(int64_t i, int64_t j, int64_t tv) const {
    return kept(mask == nullptr || mask[i * m0 + j * m1], has_ignore, tv, ignore_index);
  }
};

// target/mask may be [N] (multiclass rows): their column stride is then 0.
template <class T>
inline Entries<T> make_entries(const at::Tensor& preds, const at::Tensor& target,
                               const std::optional<at::Tensor>& mask, std::optional<int64_t> ignore_index) {
  auto s1 = [](const at::Tensor& x) { return x.dim() > 1 ? x.stride(1) : int64_t(0); };
  return Entries<T>{preds.data_ptr<T>(),
                    target.data_ptr<int64_t>(),
                    mask_ptr(mask),
                    preds.stride(0),
                    preds.stride(1),
                    target.stride(0),
                    s1(target),
                    mask.has_value() ? mask->stride(0) : 0,
                    mask.has_value() ? s1(*mask) : 0,
                    preds.size(0),
                    preds.size(1),
                    ignore_index.has_value(),
                    ignore_index.value_or(0)};
}

// INPUT_AUTO for entries: *flag = 1 if any valid entry's pred lies outside [0, 1].
template <class T>
__global__ void any_logit_kernel(Entries<T> in, int* flag) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < in.n * in.L;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / in.L, j = e % in.L;
    const int64_t t = in.t(i, j);
    if (!in.keep(i, j, t)) continue;
    const double v = in.p(i, j);
    if (binary_entry_ok(t, v) && outside_unit(v)) {
      *flag = 1;  // benign race: every writer stores 1
      return;
    }
  }
}

}  // namespace cuda
}  // namespace d9d
