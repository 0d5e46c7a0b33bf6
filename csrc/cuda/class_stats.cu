// class_stats on CUDA.
//  * index preds: one thread per row; counts in a per-block shared-memory
//    histogram (stats [3, C] + confmat [C, C]) when it fits, else global atomics.
//  * score rows of float / half / bfloat16 with max(top_ks) <= 32: one pass
//    (scores_warp_kernel / scores_block_kernel below: 16-byte loads, the top-k
//    as one sorted list across a warp's lanes that a vector enters only when
//    its max reaches the list's last entry, exp2 log-sum-exp folded into
//    float64; scores_thread_kernel, a thread per row with a register top-k,
//    for rows of <= 32 classes and class-strided rows, read in place).
//  * float64 scores and larger k: one warp per row. Pass 0 over the row
//    checks validity, folds the online log-sum-exp and selects the best
//    class; top-k takes k - 1 more selection passes ("best class ranked
//    behind the previous pick", the tie rule of ranks_ahead), so no per-row
//    sort or buffer is needed; counts go to global memory with atomics.
// Specification: d9d_kernels/reference.py::class_stats.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/class_stats_checks.h"
#include "../kernels/class_stats.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

struct Rows {
  const int64_t* target;
  int64_t st;
  const bool* mask;
  int64_t sm;
  int64_t n, C;
  bool has_ignore;
  int64_t ignore_index;
  __device__ bool keep(int64_t i, int64_t t) const {
    return kept(mask == nullptr || mask[i * sm], has_ignore, t, ignore_index);
  }
};

// top_ks by value: a kernel parameter, no host-to-device copy per call.
struct TopKs {
  int64_t k[kWarp];
};

struct Out {
  double* stats;
  double* confmat;
  double* extras;
  double* bad;  // [2]: a target (or index pred) out of range, bad scores
};

// The counts of one pick of a valid row (class j at rank rk): predicted, for
// every k of top_ks (lane < K) whose top-k holds rank rk.
__device__ inline void count_pick(const TopKs& ks, int K, int lane, int rk, int64_t j, int64_t C, double* stats) {
  if (lane < K && rk < ks.k[lane]) atomicAdd(stats + stats_pred(lane, j, C), 1.0);
}

// The target's counts of a valid row: a hit where its rank is within k, and the target count.
__device__ inline void count_target(const TopKs& ks, int K, int lane, int rank_t, int64_t t, int64_t C,
                                    double* stats) {
  if (lane < K) {
    if (rank_t < ks.k[lane]) atomicAdd(stats + stats_tp(lane, t, C), 1.0);
    atomicAdd(stats + stats_target(lane, t, C), 1.0);
  }
}


// Index preds: the counts go to block-private uint32 counters in shared memory
// (native shared atomics; `shared_counts`) when the stats (and the confusion
// matrix) fit, else to float64 atomics on the state.
__global__ void indices_kernel(Rows r, const int64_t* preds, int64_t sp, Out o, bool shared_counts) {
  extern __shared__ uint32_t counts[];
  const int64_t C = r.C;
  const int64_t n_stats = 3 * C, n_conf = o.confmat ? C * C : 0;
  if (shared_counts) counters_zero(counts, n_stats + n_conf);
  double rows = 0.0, bad = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < r.n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = r.target[i * r.st];
    if (!r.keep(i, t)) continue;
    const int64_t p = preds[i * sp];
    if (!class_in_range(t, C) || !class_in_range(p, C)) {
      bad += 1.0;
      continue;
    }
    if (shared_counts) {
      if (p == t) atomicAdd(counts + stats_tp(0, t, C), 1u);
      atomicAdd(counts + stats_pred(0, p, C), 1u);
      atomicAdd(counts + stats_target(0, t, C), 1u);
      if (n_conf) atomicAdd(counts + n_stats + t * C + p, 1u);
    } else {
      if (p == t) atomicAdd(o.stats + stats_tp(0, t, C), 1.0);
      atomicAdd(o.stats + stats_pred(0, p, C), 1.0);
      atomicAdd(o.stats + stats_target(0, t, C), 1.0);
      if (n_conf) atomicAdd(o.confmat + t * C + p, 1.0);
    }
    rows += 1.0;
  }
  if (shared_counts) {
    counters_flush(counts, o.stats, n_stats);
    if (n_conf) counters_flush(counts + n_stats, o.confmat, n_conf);
  }
  __shared__ double scratch[kThreads / kWarp];
  rows = block_sum(rows, scratch);
  bad = block_sum(bad, scratch);
  if (threadIdx.x == 0) {
    if (rows != 0.0) atomicAdd(o.extras, rows);
    if (bad != 0.0) atomicAdd(o.bad, bad);
  }
}

// The best of two candidates (score, class); class -1 = none.
__device__ inline void pick_better(double& s, int64_t& j, double s2, int64_t j2) {
  if (j2 >= 0 && (j < 0 || ranks_ahead(s2, j2, s, j))) {
    s = s2;
    j = j2;
  }
}

__device__ inline void warp_pick(double& s, int64_t& j) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const int64_t j2 = __shfl_xor_sync(0xffffffffu, j, o);
    pick_better(s, j, s2, j2);
  }
}

template <class T>
__global__ void scores_kernel(Rows r, const T* preds, int64_t row_stride, TopKs top_ks, int K, int kmax,
                              bool nll, Out o) {
  const int lane = threadIdx.x % kWarp;
  const int64_t C = r.C;
  const auto target = [&](int64_t i) { return r.target[i * r.st]; };
  const auto keep = [&](int64_t i, int64_t t) { return r.keep(i, t); };
  for_kept_warp_rows(r.n, target, keep, [&](int64_t i, int64_t t) {
    if (!class_in_range(t, C)) {
      if (lane == 0) atomicAdd(o.bad, 1.0);
      return true;
    }
    const T* row = preds + i * row_stride;
    // pass 0: validity (no NaN/+Inf, not all -Inf), online lse, best class
    bool finite = true;
    Lse l = lse_init();
    double bs = 0.0;
    int64_t bj = -1;
    for (int64_t j = lane; j < C; j += kWarp) {
      const double v = static_cast<double>(row[j]);
      finite &= score_ok(v);
      if (nll) lse_add(l, v);
      pick_better(bs, bj, v, j);
    }
    finite = __all_sync(0xffffffffu, finite);
    warp_pick(bs, bj);  // every lane: the row's best (bs = -Inf: all scores masked)
    if (!finite || bs == -INFINITY) {
      if (lane == 0) atomicAdd(o.bad + 1, 1.0);
      return true;
    }
    if (nll) {
      for (int off = kWarp / 2; off > 0; off /= 2) {
        Lse other{__shfl_xor_sync(0xffffffffu, l.m, off), __shfl_xor_sync(0xffffffffu, l.s, off)};
        lse_merge(l, other);
      }
    }
    int rank_t = kmax;
    const int64_t argmax = bj;
    for (int rk = 0; rk < kmax; ++rk) {
      if (rk > 0) {  // best class ranked behind the previous pick (bs, bj)
        const double ps = bs;
        const int64_t pj = bj;
        bs = 0.0;
        bj = -1;
        for (int64_t j = lane; j < C; j += kWarp) {
          const double v = static_cast<double>(row[j]);
          if (ranks_ahead(ps, pj, v, j)) pick_better(bs, bj, v, j);
        }
        warp_pick(bs, bj);
      }
      if (bj == t) rank_t = rk;
      count_pick(top_ks, K, lane, rk, bj, C, o.stats);
    }
    count_target(top_ks, K, lane, rank_t, t, C, o.stats);
    if (lane == 0) {
      if (o.confmat) atomicAdd(o.confmat + t * C + argmax, 1.0);
      atomicAdd(o.extras, 1.0);
      if (nll) atomicAdd(o.extras + 1, lse_value(l) - static_cast<double>(row[t]));
    }
    return true;
  });
}

// ---- score rows in one pass: float / half / bfloat16 scores, max(top_ks) <= 32 ----
// Each row is read once, with 16-byte loads (a scalar head up to the first
// 16-byte boundary of the row, a scalar tail). Per vector a thread takes the
// NaN-propagating max of its scores: it feeds the validity test and the
// online log-sum-exp (exp2 of float differences, summed per vector in float
// and folded into float64), and it gates the top-k. The warp keeps the best
// kmax (score, class) pairs it has read as one sorted list across its lanes
// (lane r: rank r); the pair in lane kmax - 1 is the gate. Only a vector whose
// max reaches the gate (raised to the best gate of the block's warps: a score
// below it ranks behind kmax scores of the row) takes the slow path: its max,
// then any other score still at the gate, enter the list one at a time, each
// a shuffle-shift of the lanes behind it. Past the first vectors almost no
// vector enters, so a row costs about a read and the log-sum-exp. Scores
// compare in float (exact for <= 32-bit inputs, same order). Rows of up to
// kBlockRowC classes take a warp each; longer (vocabulary) rows the whole
// block, whose warps' lists meet in shared memory. The row counters and the
// NLL sum go out once per block.
constexpr int64_t kBlockRowC = 4096;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int32_t kNoClass = 0x7fffffff;  // an empty slot: ranks behind every real class
constexpr unsigned kFull = 0xffffffffu;

// max(a, b), NaN if either is NaN (fmaxf drops a NaN): one instruction on sm_80+.
__device__ inline float max_nan(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? NAN : fmaxf(a, b);
#endif
}

// 2^x in one MUFU.EX2 (relative error ~2^-22; results below 2^-126 flush to
// 0, far below a float sum's rounding of its largest term, 1).
__device__ inline float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// The best kmax (score, class) pairs a warp has read, best first, lane r
// holding rank r (lanes >= kmax hold ranks nobody reads). Every member is
// called by the whole warp with warp-uniform arguments.
struct WarpList {
  float v = -INFINITY;
  int32_t j = kNoClass;
  float gate_v = -INFINITY;  // rank kmax - 1: what a new pair must rank ahead of
  int32_t gate_j = kNoClass;

  // (s, c) ranks ahead of the gate: the lanes from its rank on shift down one.
  __device__ void insert(float s, int32_t c, int kmax) {
    const int lane = threadIdx.x % kWarp;
    const float pv = __shfl_up_sync(kFull, v, 1);
    const int32_t pj = __shfl_up_sync(kFull, j, 1);
    if (!ranks_ahead(v, j, s, c)) {
      const bool prev_stays = lane == 0 || ranks_ahead(pv, pj, s, c);
      v = prev_stays ? s : pv;
      j = prev_stays ? c : pj;
    }
    gate_v = __shfl_sync(kFull, v, kmax - 1);
    gate_j = __shfl_sync(kFull, j, kmax - 1);
  }
  // An empty list from each lane's (s, c) where `has`: one bitonic sort of the
  // warp (best first), in place of up to 32 inserts.
  __device__ void build(bool has, float s, int32_t c, int kmax) {
    const int lane = threadIdx.x % kWarp;
    v = has ? s : -INFINITY;
    j = has ? c : kNoClass;
    for (int size = 2; size <= kWarp; size *= 2) {
      for (int stride = size / 2; stride > 0; stride /= 2) {
        const float ov = __shfl_xor_sync(kFull, v, stride);
        const int32_t oj = __shfl_xor_sync(kFull, j, stride);
        // in a best-first run ((lane & size) == 0) the lower lane of a pair keeps the better
        const bool keep_better = ((lane & size) == 0) == ((lane & stride) == 0);
        if (keep_better ? ranks_ahead(ov, oj, v, j) : ranks_ahead(v, j, ov, oj)) {
          v = ov;
          j = oj;
        }
      }
    }
    gate_v = __shfl_sync(kFull, v, kmax - 1);
    gate_j = __shfl_sync(kFull, j, kmax - 1);
  }
  // Each lane's (s, c) where `has`, in lane order; those still ahead of the gate go in.
  __device__ void offer(bool has, float s, int32_t c, int kmax) {
    for (unsigned m = __ballot_sync(kFull, has); m != 0u; m &= m - 1u) {
      const int src = __ffs(m) - 1;
      const float cs = __shfl_sync(kFull, s, src);
      const int32_t cc = __shfl_sync(kFull, c, src);
      if (ranks_ahead(cs, cc, gate_v, gate_j)) insert(cs, cc, kmax);
    }
  }
};

// One thread's share of the online log-sum-exp: max m, sum of exp(x - m) in float64.
struct LseF {
  float m = -INFINITY;
  double s = 0.0;
  // n scores with max vm (NaN-propagating), one float sum.
  __device__ void add_block(const float* x, int n, float vm) {
    if (!(vm > -INFINITY)) return;  // all masked (or NaN: the row is bad)
    if (vm > m) {
      s *= static_cast<double>(exp2_approx((m - vm) * kLog2e));
      m = vm;
    }
    float f = 0.f;
    for (int k = 0; k < n; ++k) f += exp2_approx((x[k] - m) * kLog2e);
    s += static_cast<double>(f);
  }
  // lse_merge in float exponents: no float64 exp in this path, one log per row.
  __device__ void merge(float m2, double s2) {
    if (!(m2 > -INFINITY)) return;
    if (m2 > m) {
      s = s * static_cast<double>(exp2_approx((m - m2) * kLog2e)) + s2;
      m = m2;
    } else {
      s += s2 * static_cast<double>(exp2_approx((m2 - m) * kLog2e));
    }
  }
  __device__ double value() const { return static_cast<double>(m) + log(s); }
};

// The block's gates: each warp's latest gate score. Reads may be stale (each
// slot only rises within a row), and a stale value is still one that kmax
// scores of the row reach. The block kernel resets the slots between rows,
// after every warp's scan and before the next row's.
struct SharedGate {
  float* slot;  // [kThreads / kWarp] in shared memory, or nullptr (a warp per row)
  // The score below which nothing can enter: the warp's own gate, or a higher one of the block's.
  __device__ float raise(float warp_gate) const {
    if (slot == nullptr) return warp_gate;
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    if (lane == 0) slot[warp] = warp_gate;
    return fmaxf(warp_gate, warp_max(*(volatile float*)&slot[lane % (kThreads / kWarp)]));
  }
};

// Thread g (lane + a multiple of 32) of G reads its share of `row` into the
// warp's list, lse and validity: 16-byte vectors, then the scalar head and
// tail (the list does not depend on the order scores arrive in). Called by
// every lane of the warp: all lanes run the same trips.
template <class T>
__device__ inline void scan_share(const T* row, int64_t C, int g, int G, bool nll, int kmax, SharedGate shared,
                                  WarpList& wl, LseF& l, bool& finite) {
  constexpr int V = kVec<T>;
  const int64_t head = min(C, static_cast<int64_t>(((16u - (reinterpret_cast<uintptr_t>(row) & 15u)) & 15u) / sizeof(T)));
  const int64_t nv = (C - head) / V, body_end = head + nv * V;
  const int lane = g % kWarp;
  float floor_v = -INFINITY;  // a score below this cannot enter
  auto scalar = [&](int64_t c, bool has) {  // head and tail: < V scores, a lane's at most one
    float x = -INFINITY;
    if (has) {
      x = static_cast<float>(row[c]);
      finite &= x < INFINITY;
      if (nll) l.add_block(&x, 1, x);
    }
    wl.offer(has && x >= floor_v, x, static_cast<int32_t>(c), kmax);
    floor_v = fmaxf(floor_v, wl.gate_v);
  };
  // The next vector is in flight while this one is read: two 16-byte loads per
  // thread outstanding, not one.
  T next[V];
  if (g < nv) load_vec(row + head + g * V, next);
  bool empty = true;  // the list: the first vector that enters builds it
  for (int64_t q0 = g - lane; q0 < nv; q0 += G) {
    const int64_t q = q0 + lane;
    T p[V];
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = next[k];
    if (q + G < nv) load_vec(row + head + (q + G) * V, next);
    float x[V];
    float vm = -INFINITY;
    if (q < nv) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        x[k] = static_cast<float>(p[k]);
        vm = max_nan(vm, x[k]);
      }
      finite &= vm < INFINITY;
      if (nll) l.add_block(x, V, vm);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) x[k] = -INFINITY;
    }
    const bool enters = q < nv && vm >= floor_v;  // NaN: no
    if (__any_sync(kFull, enters)) {
      int km = 0;  // the first position of the vector's max
#pragma unroll
      for (int k = V - 1; k >= 0; --k) km = x[k] == vm ? k : km;
      const int32_t base = static_cast<int32_t>(head + q * V);
      if (empty) {
        wl.build(enters, vm, base + km, kmax);
        empty = false;
      } else {
        wl.offer(enters, vm, base + km, kmax);  // usually the only one to enter
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        wl.offer(enters && k != km && x[k] >= fmaxf(floor_v, wl.gate_v), x[k], base + k, kmax);
      }
      floor_v = shared.raise(fmaxf(floor_v, wl.gate_v));
    }
  }
  scalar(g, g < head);
  scalar(body_end + g, body_end + g < C);
}

__device__ inline LseF warp_lse(LseF a) {
  for (int o = kWarp / 2; o > 0; o /= 2) a.merge(__shfl_xor_sync(kFull, a.m, o), __shfl_xor_sync(kFull, a.s, o));
  return a;
}

// A thread's row counts: valid rows, bad rows by cause, its NLL sum.
struct RowCounts {
  uint32_t rows = 0, bad_target = 0, bad_scores = 0;
  double nll = 0.0;

  // Adds the block's counts to the state, once per block (every thread calls it).
  __device__ void flush(const Out& o, bool with_nll) {
    add_block_count(rows, o.extras);
    add_block_count(bad_target, o.bad);
    add_block_count(bad_scores, o.bad + 1);
    if (with_nll) {
      __shared__ double scratch[kThreads / kWarp];
      const double total = block_sum(nll, scratch);
      if (threadIdx.x == 0 && total != 0.0) atomicAdd(o.extras + 1, total);
    }
  }
};

// One warp per row (C <= kBlockRowC).
template <class T>
__global__ void __launch_bounds__(kThreads) scores_warp_kernel(Rows r, const T* preds, int64_t row_stride,
                                                               TopKs top_ks, int K, int kmax, bool nll, Out o) {
  const int lane = threadIdx.x % kWarp;
  const int64_t C = r.C;
  RowCounts rc;
  const auto target = [&](int64_t i) { return r.target[i * r.st]; };
  const auto keep = [&](int64_t i, int64_t t) { return r.keep(i, t); };
  for_kept_warp_rows(r.n, target, keep, [&](int64_t i, int64_t t) {
    if (!class_in_range(t, C)) {
      rc.bad_target += lane == 0;
      return true;
    }
    const T* row = preds + i * row_stride;
    WarpList wl;
    LseF l;
    bool finite = true;
    scan_share<T>(row, C, lane, kWarp, nll, kmax, SharedGate{nullptr}, wl, l, finite);
    finite = __all_sync(kFull, finite);
    const float best = __shfl_sync(kFull, wl.v, 0);
    const int32_t argmax = __shfl_sync(kFull, wl.j, 0);
    if (!finite || best == -INFINITY) {
      rc.bad_scores += lane == 0;
      return true;
    }
    const LseF lse = nll ? warp_lse(l) : LseF{};
    const unsigned hit = __ballot_sync(kFull, lane < kmax && wl.j == t);
    const int rank_t = hit != 0u ? __ffs(hit) - 1 : kmax;
    for (int rk = 0; rk < kmax; ++rk) count_pick(top_ks, K, lane, rk, __shfl_sync(kFull, wl.j, rk), C, o.stats);
    count_target(top_ks, K, lane, rank_t, t, C, o.stats);
    if (lane == 0) {
      if (o.confmat) atomicAdd(o.confmat + t * C + argmax, 1.0);
      rc.rows += 1;
      if (nll) rc.nll += lse.value() - static_cast<double>(row[t]);
    }
    return true;
  });
  rc.flush(o, nll);
}

// One block per row (C > kBlockRowC): the warps' lists meet in shared memory.
template <class T>
__global__ void __launch_bounds__(kThreads) scores_block_kernel(Rows r, const T* preds, int64_t row_stride,
                                                                TopKs top_ks, int K, int kmax, bool nll, Out o) {
  constexpr int kWarps = kThreads / kWarp;
  __shared__ float wv[kWarps][kWarp];
  __shared__ int32_t wj[kWarps][kWarp];
  __shared__ float wm[kWarps];
  __shared__ double ws[kWarps];
  __shared__ float gates[kWarps];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t C = r.C;
  RowCounts rc;
  if (threadIdx.x < kWarps) gates[threadIdx.x] = -INFINITY;
  __syncthreads();
  for (int64_t i = blockIdx.x; i < r.n; i += gridDim.x) {
    const int64_t t = r.target[i * r.st];
    if (!r.keep(i, t)) continue;  // block-uniform
    if (!class_in_range(t, C)) {
      rc.bad_target += threadIdx.x == 0;
      continue;
    }
    const T* row = preds + i * row_stride;
    WarpList wl;
    LseF l;
    bool finite = true;
    scan_share<T>(row, C, threadIdx.x, kThreads, nll, kmax, SharedGate{gates}, wl, l, finite);
    if (lane < kmax) {  // each warp's best kmax, best first
      wv[warp][lane] = wl.v;
      wj[warp][lane] = wl.j;
    }
    const LseF wl_lse = nll ? warp_lse(l) : LseF{};
    if (lane == 0) {
      wm[warp] = wl_lse.m;
      ws[warp] = wl_lse.s;
    }
    const int ok = __syncthreads_and(finite);
    if (threadIdx.x < kWarps) gates[threadIdx.x] = -INFINITY;  // every scan of this row is done
    if (warp == 0) {
      int h = 0;  // lane w < kWarps walks warp w's list
      int rank_t = kmax;
      int32_t argmax = kNoClass;
      float best = -INFINITY;
      for (int rk = 0; rk < kmax; ++rk) {
        float s = lane < kWarps && h < kmax ? wv[lane][h] : -INFINITY;
        int32_t j = lane < kWarps && h < kmax ? wj[lane][h] : kNoClass;
        const int32_t mine = j;
        for (int off = kWarp / 2; off > 0; off /= 2) {
          const float s2 = __shfl_xor_sync(kFull, s, off);
          const int32_t j2 = __shfl_xor_sync(kFull, j, off);
          if (ranks_ahead(s2, j2, s, j)) {
            s = s2;
            j = j2;
          }
        }
        if (rk == 0) {
          argmax = j;
          best = s;
          if (!ok || best == -INFINITY) break;  // warp-uniform
        }
        if (mine == j) ++h;
        if (j == t) rank_t = rk;
        count_pick(top_ks, K, lane, rk, j, C, o.stats);
      }
      if (!ok || best == -INFINITY) {
        rc.bad_scores += lane == 0;
      } else {
        count_target(top_ks, K, lane, rank_t, t, C, o.stats);
        if (lane == 0) {
          if (o.confmat) atomicAdd(o.confmat + t * C + argmax, 1.0);
          rc.rows += 1;
          if (nll) {
            LseF a;
            for (int w = 0; w < kWarps; ++w) a.merge(wm[w], ws[w]);
            rc.nll += a.value() - static_cast<double>(row[t]);
          }
        }
      }
    }
    __syncthreads();  // wv / wj / wm / ws are rewritten by the next row
  }
  rc.flush(o, nll);
}

// A thread's best KB (score, class) pairs, best first, in registers (static indices only).
template <int KB>
struct TopK {
  float v[KB];
  int32_t j[KB];

  __device__ void init() {
#pragma unroll
    for (int r = 0; r < KB; ++r) {
      v[r] = -INFINITY;
      j[r] = kNoClass;
    }
  }
  // NaN never enters (its row is bad anyway); -Inf does, behind every finite score.
  __device__ void offer(float s, int32_t c) {
    if (!ranks_ahead(s, c, v[KB - 1], j[KB - 1])) return;
    v[KB - 1] = s;
    j[KB - 1] = c;
#pragma unroll
    for (int r = KB - 1; r > 0; --r) {
      if (ranks_ahead(v[r], j[r], v[r - 1], j[r - 1])) {
        const float tv = v[r];
        const int32_t tj = j[r];
        v[r] = v[r - 1];
        j[r] = j[r - 1];
        v[r - 1] = tv;
        j[r - 1] = tj;
      }
    }
  }
};

// One thread per row: rows of up to kThreadRowC classes (a warp per row
// would leave most lanes idle; the 32 threads of a warp read 32 adjacent
// short rows, one contiguous run) and class-strided rows of any length (a
// channel-first [N, C, H, W] sample seen as [H*W, C], strides (1, H*W):
// the threads of a warp read adjacent pixels of one class per step, so every
// load coalesces and nothing is copied). The row's best KB classes stay in
// registers (static indices only), as in the one-pass kernels above.
constexpr int64_t kThreadRowC = 32;

template <class T, int KB>
__global__ void __launch_bounds__(kThreads) scores_thread_kernel(Rows r, const T* preds, int64_t rs, int64_t cs,
                                                                 TopKs top_ks, int K, int kmax, bool nll, Out o) {
  const int64_t C = r.C;
  RowCounts rc;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < r.n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = r.target[i * r.st];
    if (!r.keep(i, t)) continue;
    if (!class_in_range(t, C)) {
      rc.bad_target += 1;
      continue;
    }
    const T* row = preds + i * rs;
    TopK<KB> tk;
    tk.init();
    LseF l;
    bool finite = true;
    for (int64_t c = 0; c < C; ++c) {
      const float x = static_cast<float>(row[c * cs]);
      finite &= x < INFINITY;
      tk.offer(x, static_cast<int32_t>(c));
      if (nll) l.add_block(&x, 1, x);
    }
    if (!finite || tk.v[0] == -INFINITY) {  // NaN / +Inf, or only -Inf
      rc.bad_scores += 1;
      continue;
    }
    int rank_t = kmax;
#pragma unroll
    for (int rk = 0; rk < KB; ++rk) rank_t = rk < kmax && tk.j[rk] == t ? rk : rank_t;
    for (int ki = 0; ki < K; ++ki) {
      const int k = static_cast<int>(top_ks.k[ki]);
#pragma unroll
      for (int rk = 0; rk < KB; ++rk) {
        if (rk < k) atomicAdd(o.stats + stats_pred(ki, tk.j[rk], C), 1.0);
      }
      if (rank_t < k) atomicAdd(o.stats + stats_tp(ki, t, C), 1.0);
      atomicAdd(o.stats + stats_target(ki, t, C), 1.0);
    }
    if (o.confmat) atomicAdd(o.confmat + t * C + tk.j[0], 1.0);
    rc.rows += 1;
    if (nll) rc.nll += l.value() - static_cast<double>(static_cast<float>(row[t * cs]));
  }
  rc.flush(o, nll);
}

// Rows of <= kThreadRowC classes and class-strided rows: a thread per row,
// KB = the smallest buffer >= kmax of {1, 8, 32}. Else a warp or a block per row.
template <class T>
void single_pass(const Rows& r, const at::Tensor& preds, const TopKs& ks, int K, int kmax, bool nll, const Out& o,
                 cudaStream_t stream) {
  const T* p = preds.data_ptr<T>();
  if (preds.stride(1) != 1 || r.C <= kThreadRowC) {
    auto launch = [&](auto kernel) {
      kernel<<<one_wave(kernel, r.n), kThreads, 0, stream>>>(r, p, preds.stride(0), preds.stride(1), ks, K, kmax,
                                                             nll, o);
    };
    if (kmax <= 1) {
      launch(scores_thread_kernel<T, 1>);
    } else if (kmax <= 8) {
      launch(scores_thread_kernel<T, 8>);
    } else {
      launch(scores_thread_kernel<T, 32>);
    }
  } else if (r.C > kBlockRowC) {
    auto kernel = scores_block_kernel<T>;
    kernel<<<one_wave(kernel, r.n * kThreads), kThreads, 0, stream>>>(r, p, preds.stride(0), ks, K, kmax, nll, o);
  } else {
    auto kernel = scores_warp_kernel<T>;
    kernel<<<one_wave(kernel, r.n * kWarp), kThreads, 0, stream>>>(r, p, preds.stride(0), ks, K, kmax, nll, o);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void class_stats_cuda(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                      int64_t num_classes, std::optional<int64_t> ignore_index, at::IntArrayRef top_ks, bool nll,
                      const at::Tensor& stats, const std::optional<at::Tensor>& confmat, const at::Tensor& extras,
                      const at::Tensor& bad) {
  check_class_stats(preds_in, target, mask, num_classes, top_ks, nll, stats, confmat, extras, bad);
  const int64_t n = target.size(0), C = num_classes;
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(target.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  Rows r{target.data_ptr<int64_t>(), target.stride(0), mask_ptr(mask), mask.has_value() ? mask->stride(0) : 0,
         n, C, ignore_index.has_value(), ignore_index.value_or(0)};
  Out o{stats.data_ptr<double>(), confmat.has_value() ? confmat->data_ptr<double>() : nullptr,
        extras.data_ptr<double>(), bad.data_ptr<double>()};
  if (!at::isFloatingType(preds_in.scalar_type())) {
    const int64_t slots = 3 * C + (confmat.has_value() ? C * C : 0);
    const size_t smem = counter_smem(indices_kernel, slots);
    indices_kernel<<<counter_blocks(indices_kernel, n, n, smem, slots), kThreads, smem, stream>>>(
        r, preds_in.data_ptr<int64_t>(), preds_in.stride(0), o, smem != 0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int K = static_cast<int>(top_ks.size());
  TORCH_CHECK(K <= kWarp, "d9d_kernels.class_stats: argument 'top_ks' holds at most ", kWarp,
              " values on CUDA, got ", K);
  const int kmax = top_ks.empty() ? 1 : static_cast<int>(*std::max_element(top_ks.begin(), top_ks.end()));
  TopKs ks{};
  for (int i = 0; i < K; ++i) ks.k[i] = top_ks[i];
  if (preds_in.scalar_type() != at::kDouble && kmax <= kWarp) {  // class-strided rows read in place
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds_in.scalar_type(), "class_stats_cuda", [&] {
      if constexpr (!std::is_same_v<scalar_t, double>) single_pass<scalar_t>(r, preds_in, ks, K, kmax, nll, o, stream);
    });
    return;
  }
  // A warp per row reads 32 consecutive scores per step.
  const at::Tensor preds = preds_in.stride(1) == 1 ? preds_in : preds_in.contiguous();
  // float64 scores (compared in double) and max(top_ks) > 32: the selection passes
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "class_stats_cuda", [&] {
    scores_kernel<scalar_t><<<blocks_for(n * kWarp), kThreads, 0, stream>>>(
        r, preds.data_ptr<scalar_t>(), preds.stride(0), ks, K, kmax, nll, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("class_stats", &d9d::cuda::class_stats_cuda); }
