// Vectors of D9D_VEC_BYTES bytes through the GCC/Clang vector extension, for
// CPU loops that -O3 does not vectorise on its own (short fixed-width lane
// loops get fully unrolled into scalar compares instead).
// 16 bytes is the baseline of x86-64 (SSE2) and arm64 (NEON): no -march flag
// and no intrinsics; on other targets the compiler lowers the same code to
// scalar operations. 32 bytes is AVX2, compiled only inside a
// D9D_TARGET_BEGIN("avx2") region (target_region.h) and called only after a
// runtime CPU check.
//
// Contract of this -inl.h: include it once per width, with D9D_VEC_BYTES
// defined, inside a namespace of its own (class_stats.cpp: vec16, vec32); no
// include guard, on purpose. Its headers below must already be included by
// the includer outside any target region (then these includes are no-ops
// and no std inline function gets an AVX2 body); they are here so that the
// file also stands alone.

#include <cstring>

#if !defined(D9D_VEC_BYTES)
#error "lanes-inl.h: define D9D_VEC_BYTES (16 or 32) before including it"
#endif

constexpr int kVecBytes = D9D_VEC_BYTES;

template <class V>
struct VecN {
  typedef V type __attribute__((vector_size(kVecBytes)));
};

template <class V>
using VecOf = typename VecN<V>::type;  // float x 4 / double x 2 (x 8 / x 4 for 32 bytes)

template <class V>
using MaskOf = decltype(VecOf<V>{} > VecOf<V>{});  // int32 / int64 lanes: 0 or -1 each

template <class V>
constexpr int kPerVec = kVecBytes / sizeof(V);

template <class V>
inline VecOf<V> load_vec(const V* p) {  // unaligned
  VecOf<V> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// s in every lane: one shuffle (a lane loop of stores compiled to ~10 shuffles).
template <class V>
inline VecOf<V> splat(V s) {
  return s - VecOf<V>{};  // exact, -0 included
}

// Bit l set iff lane l of a comparison mask is set (movemask; a lane loop
// off x86).
template <class M>
inline int lane_bits(M m) {
#if defined(__SSE2__)
  if constexpr (sizeof(M) == 16 && sizeof(m[0]) == 4) {
    return _mm_movemask_ps(reinterpret_cast<__m128>(m));
  } else if constexpr (sizeof(M) == 16) {
    return _mm_movemask_pd(reinterpret_cast<__m128d>(m));
  } else if constexpr (sizeof(m[0]) == 4) {
    return _mm256_movemask_ps(reinterpret_cast<__m256>(m));
  } else {
    return _mm256_movemask_pd(reinterpret_cast<__m256d>(m));
  }
#else
  int bits = 0;
  for (int l = 0; l < int(sizeof(M) / sizeof(m[0])); ++l) bits |= (m[l] != 0) << l;
  return bits;
#endif
}

// Any lane of a comparison mask set.
template <class M>
inline bool any_lane(M m) {
  typedef int64_t Q __attribute__((vector_size(kVecBytes)));
  const Q q = reinterpret_cast<Q>(m);
  int64_t acc = 0;
  for (int l = 0; l < kVecBytes / 8; ++l) acc |= q[l];
  return acc != 0;
}

// Sum of the lanes of an integer vector, in vector registers (a lane-by-lane
// sum of 8 int32 lanes was 8 extracts on the critical path of a C = 10 row).
template <class M>
inline int64_t lane_sum(M m) {
  using Int = std::remove_cv_t<std::remove_reference_t<decltype(m[0])>>;
  if constexpr (sizeof(M) > 16) {
    typedef Int Half __attribute__((vector_size(sizeof(M) / 2)));
    Half lo, hi;
    std::memcpy(&lo, &m, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char*>(&m) + sizeof lo, sizeof hi);
    return lane_sum(lo + hi);
  } else if constexpr (sizeof(M) / sizeof(Int) == 4) {  // 2 shuffles, not 4 extracts
    const M h = m + __builtin_shufflevector(m, m, 2, 3, 0, 1);
    return (h + __builtin_shufflevector(h, h, 1, 0, 3, 2))[0];
  } else {
    int64_t total = 0;
    for (int l = 0; l < int(sizeof(M) / sizeof(Int)); ++l) total += m[l];
    return total;
  }
}
