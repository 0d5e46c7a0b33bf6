// The NLL (log-sum-exp) pass of class_stats on CPU: one row of scores, at::vec
// (ATen's SIMD layer, Sleef exp) in 32-byte lanes. Defined in
// class_stats_nll.cpp, the only translation unit built for AVX2 + FMA; call
// only when nll_vec_ok().
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace d9d {

// The CPU has AVX2 + FMA and torch's CPU capability is not DEFAULT
// (ATEN_CPU_CAPABILITY=default turns the vector NLL off, as the 32-byte lanes).
bool nll_vec_ok();

// The max of x[0..C), false when a score is NaN or +Inf or all are -Inf.
template <class T>
bool nll_vec_max(const T* x, int64_t C, float* max);

// sum_j exp(x[j] - m) (m = the row max, finite), float terms summed in double.
template <class T>
double nll_vec_sum_exp(const T* x, int64_t C, float m);

}  // namespace d9d
