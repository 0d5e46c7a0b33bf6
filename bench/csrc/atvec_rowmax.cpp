// Row max of bfloat16 rows [N, V], one thread: ATen's at::vec as an extension
// translation unit compiles it (default flags: its generic fallback) vs the
// hand-written 16-byte lanes of csrc/cpu/half_bits.h. Built by bench/bench_atvec.py.
#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <chrono>
#include "../../csrc/cpu/half_bits.h"

using namespace at::vec;

double rowmax_atvec(const at::Tensor& x, at::Tensor& out) {  // seconds
  auto t0 = std::chrono::steady_clock::now();
  const int64_t N = x.size(0), V = x.size(1);
  const at::BFloat16* p = x.data_ptr<at::BFloat16>();
  float* o = out.data_ptr<float>();
  using bV = Vectorized<at::BFloat16>;
  using fV = Vectorized<float>;
  for (int64_t i = 0; i < N; ++i) {
    const at::BFloat16* r = p + i * V;
    fV m(-INFINITY);
    int64_t j = 0;
    for (; j + bV::size() <= V; j += bV::size()) {
      auto [a, b] = convert_bfloat16_float(bV::loadu(r + j));
      m = maximum(m, maximum(a, b));
    }
    float s = -INFINITY;
    float buf[fV::size()];
    m.store(buf);
    for (int l = 0; l < fV::size(); ++l) s = std::max(s, buf[l]);
    for (; j < V; ++j) s = std::max(s, float(r[j]));
    o[i] = s;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

typedef float f4 __attribute__((vector_size(16)));
double rowmax_lanes(const at::Tensor& x, at::Tensor& out) {
  auto t0 = std::chrono::steady_clock::now();
  const int64_t N = x.size(0), V = x.size(1);
  const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < N; ++i) {
    const uint16_t* r = p + i * V;
    f4 m0 = -INFINITY - f4{}, m1 = m0;
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
      f4 a = d9d::bf16_bits_to_float4(r + j), b = d9d::bf16_bits_to_float4(r + j + 4);
      m0 = m0 > a ? m0 : a;
      m1 = m1 > b ? m1 : b;
    }
    float s = -INFINITY;
    for (int l = 0; l < 4; ++l) s = std::max(s, std::max(m0[l], m1[l]));
    for (; j < V; ++j) s = std::max(s, float(reinterpret_cast<const at::BFloat16*>(r)[j]));
    o[i] = s;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rowmax_atvec", &rowmax_atvec);
  m.def("rowmax_lanes", &rowmax_lanes);
}
