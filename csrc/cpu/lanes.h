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

}  // namespace d9d
