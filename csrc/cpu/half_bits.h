// float16 / bfloat16 bits -> float, 4 at a time, through the GCC/Clang vector
// extension (16 bytes: the x86-64 and arm64 baseline, no -march flag).
// Kept instead of at::vec: in this extension's translation units (no
// CPU_CAPABILITY flags) at::vec::Vectorized is ATen's generic fallback, 6x
// slower than these lanes on a bfloat16 row max (bench/bench_atvec.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace d9d {

typedef float F32x4 __attribute__((vector_size(16)));

// IEEE half bits -> float, exact: the branch-free formula of
// c10::detail::fp16_ieee_to_fp32_value on 4 lanes (the scalar conversion
// is not vectorised: 0.85 ns/score on [1024, 1000] float16 rows).
inline F32x4 half_bits_to_float4(const uint16_t* h) {
  typedef uint16_t U16x4 __attribute__((vector_size(8)));
  typedef uint32_t U32x4 __attribute__((vector_size(16)));
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
inline F32x4 bf16_bits_to_float4(const uint16_t* h) {
  typedef uint16_t U16x4 __attribute__((vector_size(8)));
  typedef uint32_t U32x4 __attribute__((vector_size(16)));
  U16x4 v;
  std::memcpy(&v, h, sizeof v);
  return reinterpret_cast<F32x4>(__builtin_convertvector(v, U32x4) << 16);
}

// Converts h[0 .. n - n % 4); returns n - n % 4 (the caller converts the rest:
// a padded copy for the tail cost more than the scalar conversion at C = 10).
inline int64_t half_bits_to_float(const uint16_t* h, float* out, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const F32x4 f = half_bits_to_float4(h + j);
    std::memcpy(out + j, &f, sizeof f);
  }
  return j;
}

}  // namespace d9d
