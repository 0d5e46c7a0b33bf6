// [N, L] entries of binary_stats / score_histogram on CUDA: the walk over
// entries (16-byte vectors when contiguous, a (row, label) stride walk when
// not: no 64-bit divide per entry), targets read in their own integer type,
// block-private uint32 counters, and the INPUT_AUTO flag kernel.
#pragma once

#include "../kernels/binary_stats.h"
#include "common.cuh"

namespace d9d {
namespace cuda {

template <class T, class TT>
struct Entries {
  const T* preds;
  const TT* target;
  const bool* mask;
  int64_t p0, p1, t0, t1, m0, m1, n, L;
  bool has_ignore;
  int64_t ignore_index;
  __device__ double p(int64_t i, int64_t j) const { return static_cast<double>(preds[i * p0 + j * p1]); }
  __device__ int64_t t(int64_t i, int64_t j) const { return static_cast<int64_t>(target[i * t0 + j * t1]); }
  __device__ bool keep(int64_t i, int64_t j, int64_t tv) const {
    return kept(mask == nullptr || mask[i * m0 + j * m1], has_ignore, tv, ignore_index);
  }
  __device__ bool keep_flat(bool m, int64_t tv) const { return kept(m, has_ignore, tv, ignore_index); }
};

// target/mask may be [N] (multiclass rows): their column stride is then 0.
template <class T, class TT>
inline Entries<T, TT> make_entries(const at::Tensor& preds, const at::Tensor& target,
                                   const std::optional<at::Tensor>& mask, std::optional<int64_t> ignore_index) {
  auto s1 = [](const at::Tensor& x) { return x.dim() > 1 ? x.stride(1) : int64_t(0); };
  return Entries<T, TT>{preds.data_ptr<T>(),
                        static_cast<const TT*>(target.data_ptr()),
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

// How entries are walked: `split` over the flat index when preds, target and
// mask are all contiguous (vectors where they line up), else all scalar.
struct Walk {
  VecSplit split;
  bool flat;
};

template <class T, class TT>
inline Walk make_walk(const at::Tensor& preds, const at::Tensor& target, const std::optional<at::Tensor>& mask) {
  const int64_t total = preds.numel();
  const bool flat = preds.is_contiguous() && target.is_contiguous() && target.numel() == total &&
                    (!mask.has_value() || mask->is_contiguous());
  const T* p = preds.data_ptr<T>();
  const int64_t head = head_of<T>(p, total);
  constexpr int V = kVec<T>;
  const int64_t t_align = std::min<int64_t>(16, V * sizeof(TT));
  const bool vec = flat && lines_up(target.data_ptr(), head, sizeof(TT), t_align) &&
                   lines_up(mask.has_value() ? mask->data_ptr() : nullptr, head, 1, V);
  return Walk{vec_split(p, total, vec), flat};
}

// kV consecutive targets in as few loads as their bytes allow (aligned by make_walk).
template <class TT, int kV>
__device__ inline void load_targets(const TT* p, TT (&out)[kV]) {
  constexpr int bytes = kV * sizeof(TT);
  if constexpr (bytes >= 16) {
    uint4 raw[bytes / 16];
#pragma unroll
    for (int r = 0; r < bytes / 16; ++r) raw[r] = reinterpret_cast<const uint4*>(p)[r];
    memcpy(&out, &raw, bytes);
  } else {
    load_mask<bytes>(reinterpret_cast<const bool*>(p), reinterpret_cast<bool(&)[bytes]>(out));
  }
}

// Calls f(j, pred, target, kept) for every entry of this thread's share.
// Contiguous: flat index e with label j = e mod L kept by increments; else a
// (row, label) walk advanced by (stride / L, stride % L) per step.
template <bool L1, class T, class TT, class F>
__device__ inline void for_each_entry(const Entries<T, TT>& in, const Walk& w, F&& f) {
  constexpr int V = kVec<T>;
  const int64_t L = L1 ? 1 : in.L;
  const int64_t total = in.n * L;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const VecSplit& s = w.split;
  if (s.nv > 0) {
    const int64_t step = L1 ? 0 : (stride * V) % L;
    int64_t j0 = L1 ? 0 : (s.head + gid * V) % L;
    for (int64_t v = gid; v < s.nv; v += stride) {
      const int64_t e = s.head + v * V;
      T p[V];
      TT t[V];
      bool m[V];
      load_vec(in.preds + e, p);
      load_targets<TT, V>(in.target + e, t);
      if (in.mask) load_mask<V>(in.mask + e, m);
      int64_t j = j0;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t tv = static_cast<int64_t>(t[k]);
        f(j, static_cast<double>(p[k]), tv, in.keep_flat(in.mask == nullptr || m[k], tv));
        if (!L1 && ++j == L) j = 0;
      }
      if (!L1) {
        j0 += step;
        if (j0 >= L) j0 -= L;
      }
    }
    for (int64_t k = gid; k < s.n_scalar(total); k += stride) {  // < 2 vectors: a divide each is fine
      const int64_t e = s.scalar_index(k);
      const int64_t i = L1 ? e : e / L, j = L1 ? 0 : e % L;
      const int64_t tv = in.t(i, j);
      f(j, in.p(i, j), tv, in.keep(i, j, tv));
    }
    return;
  }
  const int64_t di = L1 ? stride : stride / L, dj = L1 ? 0 : stride % L;
  int64_t i = L1 ? gid : gid / L, j = L1 ? 0 : gid % L;
  for (int64_t e = gid; e < total; e += stride) {
    if (w.flat) {
      const int64_t tv = static_cast<int64_t>(in.target[e]);
      f(j, static_cast<double>(in.preds[e]), tv, in.keep_flat(in.mask == nullptr || in.mask[e], tv));
    } else {
      const int64_t tv = in.t(i, j);
      f(j, in.p(i, j), tv, in.keep(i, j, tv));
    }
    i += di;
    if (!L1) {
      j += dj;
      if (j >= L) {
        j -= L;
        ++i;
      }
    }
  }
}

// INPUT_AUTO for entries: *flag = 1 if any valid entry's pred lies outside [0, 1].
template <bool L1, class T, class TT>
__global__ void __launch_bounds__(kThreads) any_logit_kernel(Entries<T, TT> in, Walk w, int* flag) {
  bool found = false;
  for_each_entry<L1>(in, w, [&](int64_t, double v, int64_t t, bool keep) {
    found |= keep && binary_entry_ok(t, v) && outside_unit(v);
  });
  if (found) *flag = 1;  // benign race: every writer stores 1
}

// Runs f.template operator()<L1, T, TT>() for preds dtype T (floating) and
// target dtype TT (int64, int32, uint8, bool), L1 = one label.
#define D9D_DISPATCH_ENTRIES(preds_type, target_type, L1_VALUE, NAME, ...)                                \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds_type, NAME, [&] {                          \
    using T = scalar_t;                                                                                        \
    auto by_target = [&](auto tt_tag) {                                                                        \
      using TT = typename decltype(tt_tag)::type;                                                              \
      if (L1_VALUE) {                                                                                          \
        constexpr bool L1 = true;                                                                              \
        __VA_ARGS__();                                                                                         \
      } else {                                                                                                 \
        constexpr bool L1 = false;                                                                             \
        __VA_ARGS__();                                                                                         \
      }                                                                                                        \
    };                                                                                                         \
    switch (target_type) {                                                                                     \
      case at::kInt: by_target(Tag<int32_t>{}); break;                                                         \
      case at::kByte: by_target(Tag<uint8_t>{}); break;                                                        \
      case at::kBool: by_target(Tag<bool>{}); break;                                                           \
      default: by_target(Tag<int64_t>{}); break;                                                               \
    }                                                                                                          \
  })

template <class X>
struct Tag {
  using type = X;
};

// Target dtypes read natively: int64 (the ops wrapper's), int32, uint8, bool.
inline bool native_target(at::ScalarType t) {
  return t == at::kLong || t == at::kInt || t == at::kByte || t == at::kBool;
}

}  // namespace cuda
}  // namespace d9d
