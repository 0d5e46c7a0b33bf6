// 16-byte vectors through the GCC/Clang vector extension, for CPU loops that
// -O3 did not vectorise on its own (class_stats: short fixed-width lane
// loops were fully unrolled into scalar compares). 16 bytes is the baseline
// of x86-64 (SSE2) and arm64 (NEON), so no -march flag and no intrinsics;
// on other targets the compiler lowers the same code to scalar operations.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace d9d {

template <class V>
struct Vec16 {
  typedef V type __attribute__((vector_size(16)));
};

template <class V>
using VecOf = typename Vec16<V>::type;  // float x 4 / double x 2

template <class V>
using MaskOf = decltype(VecOf<V>{} > VecOf<V>{});  // int32 x 4 / int64 x 2: 0 or -1 per lane

template <class V>
constexpr int kPerVec = 16 / sizeof(V);

template <class V>
inline VecOf<V> load_vec(const V* p) {  // unaligned
  VecOf<V> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// s in every lane: one shufps (a lane loop of stores compiled to ~10 shuffles).
template <class V>
inline VecOf<V> splat(V s) {
  return s - VecOf<V>{};  // exact, -0 included
}

// Bit l set iff lane l of a comparison mask is set (SSE2 movemask; a lane
// loop elsewhere).
template <class M>
inline int lane_bits(M m) {
#if defined(__SSE2__)
  if constexpr (sizeof(m[0]) == 4) {
    return _mm_movemask_ps(reinterpret_cast<__m128>(m));
  } else {
    return _mm_movemask_pd(reinterpret_cast<__m128d>(m));
  }
#else
  int bits = 0;
  for (int l = 0; l < int(16 / sizeof(m[0])); ++l) bits |= (m[l] != 0) << l;
  return bits;
#endif
}

// Any lane of a comparison mask set.
template <class M>
inline bool any_lane(M m) {
  typedef int64_t Q __attribute__((vector_size(16)));
  const Q q = reinterpret_cast<Q>(m);
  return (q[0] | q[1]) != 0;
}

// IEEE half bits -> float, exact: the branch-free formula of
// c10::detail::fp16_ieee_to_fp32_value on 4 lanes (the scalar conversion
// is not vectorised: 0.85 ns/score on [1024, 1000] float16 rows).
inline VecOf<float> half_bits_to_float4(const uint16_t* h) {
  typedef uint16_t U16x4 __attribute__((vector_size(8)));
  typedef uint32_t U32x4 __attribute__((vector_size(16)));
  using F32x4 = VecOf<float>;
  U16x4 v;
  std::memcpy(&v, h, sizeof v);
  const U32x4 w = __builtin_convertvector(v, U32x4) << 16;
  const U32x4 sign = w & 0x80000000u;
  const U32x4 two_w = w + w;
  const F32x4 normal = reinterpret_cast<F32x4>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const F32x4 subnormal = reinterpret_cast<F32x4>((two_w >> 17) | (126u << 23)) - 0.5f;
  const U32x4 small = reinterpret_cast<U32x4>(two_w < (1u << 27));
  const U32x4 r = sign | (small & reinterpret_cast<U32x4>(subnormal)) | (~small & reinterpret_cast<U32x4>(normal));
  return reinterpret_cast<F32x4>(r);
}

// bfloat16 bits -> float (exact: the top half of the float's bits), 4 lanes.
inline VecOf<float> bf16_bits_to_float4(const uint16_t* h) {
  typedef uint16_t U16x4 __attribute__((vector_size(8)));
  typedef uint32_t U32x4 __attribute__((vector_size(16)));
  U16x4 v;
  std::memcpy(&v, h, sizeof v);
  return reinterpret_cast<VecOf<float>>(__builtin_convertvector(v, U32x4) << 16);
}

// Converts h[0 .. n - n % 4); returns n - n % 4 (the caller converts the rest:
// a padded copy for the tail cost more than the scalar conversion at C = 10).
inline int64_t half_bits_to_float(const uint16_t* h, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const VecOf<float> f = half_bits_to_float4(h + j);
    std::memcpy(out + j, &f, sizeof f);
  }
  return j;
}

}  // namespace d9d
