// The NLL pass of class_stats on CPU (class_stats_nll.h) on at::vec.
// at::vec fixes its width at compile time (CPU_CAPABILITY_*), and setup.py
// builds every file with one flag set for the x86-64 baseline, where the
// default Vectorized<float> is a plain array with a scalar std::exp. So this
// one file builds the AVX2 Vectorized (Sleef expf8, F16C/bfloat16 loads)
// in a D9D_TARGET_BEGIN region (target_region.h), as class_stats.cpp builds its 32-byte lanes,
// and class_stats.cpp calls it only after the same runtime check. Every
// header at::vec includes from outside its CPU_CAPABILITY namespace is
// included first, built for the baseline, so no inline function shared with
// another file gets an AVX2 body (the linker keeps one copy of each).
// Where torch itself runs AVX-512 kernels, the sum of exps takes a 64-byte
// build of the same loop (raw intrinsics, sum_exp_512).
#include "class_stats_nll.h"

#include <ATen/NumericUtils.h>
#include <ATen/Version.h>
#include <ATen/native/Math.h>
#include <ATen/native/cpu/zmath.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16-math.h>
#include <c10/util/Load.h>
#include <c10/util/MathConstants.h>
#include <c10/util/TypeCast.h>
#include <c10/util/complex.h>
#include <c10/util/copysign.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <tuple>
#include <type_traits>

#include "target_region.h"

// The score types the NLL pass is built for (both builds below).
#define D9D_NLL_INSTANTIATE(T)                                 \
  template bool nll_vec_max<T>(const T*, int64_t, float*); \
  template double nll_vec_sum_exp<T>(const T*, int64_t, float);

#if defined(D9D_HAS_TARGET_REGION)
#include <immintrin.h>

namespace d9d {
namespace {

// exp(d) for d = score - row max <= 0 (or -Inf, a masked logit), to ~1 ulp:
// 2^n * exp(r) with n = round(d * log2 e), |r| <= ln 2 / 2 in two-part
// Cody-Waite, exp(r) by Cephes' expf polynomial (kExpP, highest degree
// first). Sleef's expf8 handles the whole float range (overflow, denormal
// results) at about twice the instructions; here d is never positive and a
// result below 2^-126 adds nothing to a sum that holds exp(0) = 1, so d is
// clamped at kExpMin instead. exp_nonpos (8 lanes) and exp_nonpos16 (16
// lanes) below are this one recipe at two widths.
constexpr float kExpMin = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace
}  // namespace d9d

// The sum of exps in 64-byte lanes, for CPUs where torch itself runs
// AVX-512 kernels: raw intrinsics (at::vec is built for one width per
// translation unit, AVX2 below), the same exp and the same 16 terms per
// float lane before a double add. noinline and instantiated here: the
// AVX2 code below calls them after d9d::nll_512_ok().
D9D_TARGET_BEGIN("avx512f,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // inside avx512fintrin.h's cvtepu16 (GCC 12)
namespace d9d {
namespace {

// The exp recipe above on 16 lanes.
inline __m512 exp_nonpos16(__m512 d) {
  const __m512 x = _mm512_max_ps(d, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// 16 scores at x as floats (float16/bfloat16: exact conversion).
template <class T>
inline __m512 load16_512(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if constexpr (std::is_same_v<T, c10::Half>) {
      return _mm512_cvtph_ps(h);
    } else {  // bfloat16: the top half of the float's bits
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

}  // namespace

template <class T>
__attribute__((noinline)) double sum_exp_512(const T* x, int64_t C, float m) {
  constexpr int64_t kBlock512 = 16 * 4 * 16;
  const __m512 vm = _mm512_set1_ps(m);
  double total = 0.0;
  int64_t j = 0;
  const int64_t full = C - C % 64;
  while (j < full) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    // no std::min here: a template instantiated in this region would get an AVX-512 body
    for (const int64_t stop = j + kBlock512 < full ? j + kBlock512 : full; j < stop; j += 64) {
      s0 = _mm512_add_ps(s0, exp_nonpos16(_mm512_sub_ps(load16_512(x + j), vm)));
      s1 = _mm512_add_ps(s1, exp_nonpos16(_mm512_sub_ps(load16_512(x + j + 16), vm)));
      s2 = _mm512_add_ps(s2, exp_nonpos16(_mm512_sub_ps(load16_512(x + j + 32), vm)));
      s3 = _mm512_add_ps(s3, exp_nonpos16(_mm512_sub_ps(load16_512(x + j + 48), vm)));
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    for (int l = 0; l < 16; ++l) total += lanes[l];
  }
  for (; j < C; ++j) total += std::exp(static_cast<double>(static_cast<float>(x[j]) - m));
  return total;
}

template double sum_exp_512<float>(const float*, int64_t, float);
template double sum_exp_512<c10::Half>(const c10::Half*, int64_t, float);
template double sum_exp_512<c10::BFloat16>(const c10::BFloat16*, int64_t, float);

}  // namespace d9d
#pragma GCC diagnostic pop
D9D_TARGET_END

namespace d9d {
// torch runs its own AVX-512 kernels here (ATEN_CPU_CAPABILITY=avx2 or
// default turns this off as it does torch's), and the CPU has the features.
bool nll_512_ok() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") &&
                          at::get_cpu_capability() == "AVX512";
  return yes;
}
}  // namespace d9d

D9D_TARGET_BEGIN("avx2,fma,f16c")
#pragma GCC diagnostic ignored "-Wunknown-pragmas"  // at::vec's `#pragma unroll`
#pragma GCC diagnostic ignored "-Wpsabi"  // lambdas of unused bfloat16 operators miss the target
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
// sleef.h declares its 8-lane functions only under __AVX__, which the pragma
// does not define for C++.
#if !defined(__AVX__)
#define __AVX__ 1
#define D9D_UNDEF_AVX
#endif
#include <sleef.h>
#if defined(D9D_UNDEF_AVX)
#undef __AVX__
#undef D9D_UNDEF_AVX
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace d9d {
namespace {

using FVec = at::vec::Vectorized<float>;
constexpr int64_t kW = FVec::size();  // 8 floats
// Scores summed in float lanes before a double add: 16 terms a lane keep the
// float sum within a few ulps (a float sum over a whole 128k row would not).
constexpr int64_t kBlock = 16 * 4 * kW;

// The exp recipe above on 8 lanes.
inline FVec exp_nonpos(const FVec& d) {
  const __m256 x = _mm256_max_ps(d, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 16 scores at x as two float vectors (float16/bfloat16: exact conversion).
template <class T>
inline void load16(const T* x, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = FVec::loadu(x);
    b = FVec::loadu(x + kW);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(x));
  }
}

}  // namespace

template <class T>
bool nll_vec_max(const T* x, int64_t C, float* max) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  FVec m0(-inf), m1(-inf), m2(-inf), m3(-inf);
  FVec a, b, c, d;
  int64_t j = 0;
  for (; j + 32 <= C; j += 32) {  // maximum() propagates NaN
    load16(x + j, a, b);
    load16(x + j + 16, c, d);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
    m2 = at::vec::maximum(m2, c);
    m3 = at::vec::maximum(m3, d);
  }
  float lanes[kW];
  at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3)).store(lanes);
  bool nan = false;
  float m = -inf;
  for (int64_t l = 0; l < kW; ++l) {
    nan |= lanes[l] != lanes[l];
    m = lanes[l] > m ? lanes[l] : m;
  }
  for (; j < C; ++j) {
    const float v = static_cast<float>(x[j]);
    nan |= v != v;
    m = v > m ? v : m;
  }
  *max = m;
  return !nan && m < inf && m > -inf;
}

template <class T>
double nll_vec_sum_exp(const T* x, int64_t C, float m) {
  if (nll_512_ok()) return sum_exp_512(x, C, m);
  const FVec vm(m);
  FVec a, b, c, d;
  double total = 0.0;
  int64_t j = 0;
  const int64_t full = C - C % 32;
  while (j < full) {
    FVec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
    for (const int64_t stop = std::min(full, j + kBlock); j < stop; j += 32) {
      load16(x + j, a, b);
      load16(x + j + 16, c, d);
      s0 += exp_nonpos(a - vm);  // masked logits (-Inf) add < 2^-125 each
      s1 += exp_nonpos(b - vm);
      s2 += exp_nonpos(c - vm);
      s3 += exp_nonpos(d - vm);
    }
    float lanes[kW];
    ((s0 + s1) + (s2 + s3)).store(lanes);
    for (int64_t l = 0; l < kW; ++l) total += lanes[l];
  }
  for (; j < C; ++j) total += std::exp(static_cast<double>(static_cast<float>(x[j]) - m));
  return total;
}

// Instantiated here, inside the AVX2 region: GCC gives a template the target
// of its instantiation point.
D9D_NLL_INSTANTIATE(float)
D9D_NLL_INSTANTIATE(c10::Half)
D9D_NLL_INSTANTIATE(c10::BFloat16)

}  // namespace d9d

D9D_TARGET_END
#undef CPU_CAPABILITY_AVX2
#undef CPU_CAPABILITY

namespace d9d {

// Built for the baseline (outside the region): it runs before anyone knows
// the CPU has AVX2.
bool nll_vec_ok() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          at::get_cpu_capability() != "DEFAULT";
  return yes;
}

}  // namespace d9d

#else  // no AVX2 build: class_stats.cpp keeps its scalar exp

namespace d9d {
bool nll_vec_ok() { return false; }
template <class T>
bool nll_vec_max(const T*, int64_t, float*) {
  return false;
}
template <class T>
double nll_vec_sum_exp(const T*, int64_t, float) {
  return 0.0;
}
D9D_NLL_INSTANTIATE(float)
D9D_NLL_INSTANTIATE(c10::Half)
D9D_NLL_INSTANTIATE(c10::BFloat16)
}  // namespace d9d

#endif
