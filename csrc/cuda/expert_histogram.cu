// expert_histogram on CUDA: one launch per 256 rows of indices (the layer ids
// travel by value in the launch's parameters: no host-to-device copy, so the
// call is capturable in a CUDA graph). Grid (blocks per row, rows): each block
// grid-strides over its row's slots and counts them in uint32 shared-memory
// counters (global float64 atomics when E does not fit), flushed once per
// block. Lanes of a warp holding the same expert add once (__match_any_sync),
// so "one expert takes all" routing costs one atomic per warp, not 32. The
// gate sums run on a grid (expert tiles, token slices, rows): a thread keeps
// one expert's float64 sum over its tokens (coalesced along E) and adds it
// once. Specification: d9d_kernels/reference.py::expert_histogram.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/expert_histogram_checks.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

constexpr int kMaxRows = 256;  // rows per launch: their layer ids are a 2 KiB kernel parameter

struct LayerIds {
  int64_t id[kMaxRows];
};

template <class I>
__global__ void __launch_bounds__(kThreads)
    expert_load_kernel(const I* idx, int64_t s0, int64_t s1, int64_t n, int64_t E, LayerIds lay, double* load, double* bad,
                bool in_smem) {
  extern __shared__ uint32_t cnt[];
  const int row = blockIdx.y;
  double* dst = load + lay.id[row] * E;
  if (in_smem) counters_zero(cnt, E);
  const I* p = idx + row * s0;
  uint32_t nbad = 0;
  const int lane = threadIdx.x % kWarp;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  // the whole warp runs every trip (lanes past n hold no slot), so the match is over converged lanes
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x - lane; b < n; b += stride) {
    const int64_t i = b + lane;
    const int64_t v = i < n ? static_cast<int64_t>(p[i * s1]) : -1;
    const bool ok = static_cast<uint64_t>(v) < static_cast<uint64_t>(E);
    nbad += (!ok && v != -1) ? 1u : 0u;
    // lanes with the same expert add together (key -1: not counted)
    const unsigned peers = __match_any_sync(0xffffffffu, ok ? static_cast<long long>(v) : -1ll);
    if (ok && lane == __ffs(peers) - 1) {
      const unsigned c = __popc(peers);
      if (in_smem) {
        atomicAdd(cnt + v, c);
      } else {
        atomicAdd(dst + v, static_cast<double>(c));
      }
    }
  }
  if (in_smem) counters_flush(cnt, dst, E);
  add_block_count(nbad, bad);
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    expert_gate_kernel(const T* probs, int64_t s0, int64_t s1, int64_t s2, int64_t T_, int64_t E, LayerIds lay,
                double* gate) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int row = blockIdx.z;
  double* dst = gate + lay.id[row] * (E + 1);
  if (e < E) {
    const T* p = probs + row * s0 + e * s2;
    double acc = 0.0;
    for (int64_t t = blockIdx.y; t < T_; t += gridDim.y) acc += static_cast<double>(p[t * s1]);
    atomicAdd(dst + e, acc);
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(dst + E, static_cast<double>(T_));
}

void expert_histogram_cuda(const at::Tensor& indices, at::IntArrayRef layers, const std::optional<at::Tensor>& probs,
                           const at::Tensor& load, const std::optional<at::Tensor>& gate, const at::Tensor& bad) {
  check_expert_histogram(indices, layers, probs, load, gate, bad);
  const int64_t R = indices.size(0), n = indices.size(1), E = load.size(1);
  if (R == 0) return;
  const at::cuda::CUDAGuard guard(indices.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (int64_t r0 = 0; r0 < R; r0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, R - r0));
    LayerIds lay;
    for (int r = 0; r < rows; ++r) lay.id[r] = layers[r0 + r];
    if (n > 0) {
      AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "expert_histogram_cuda", [&] {
        auto kernel = expert_load_kernel<index_t>;
        const size_t smem = counter_smem(kernel, E);
        // one wave over all rows; per row at least enough blocks that none counts 2^31 slots, and
        // (shared counters) no more blocks than would each read about as many slots as they flush
        int64_t per_row = std::max<int64_t>(1, one_wave(kernel, n * rows, kThreads, smem) / rows);
        if (smem) per_row = std::max<int64_t>(1, std::min<int64_t>(per_row, n / E));
        per_row = std::max<int64_t>(per_row, (n + kMaxPerBlock - 1) / kMaxPerBlock);
        const dim3 grid(static_cast<unsigned>(per_row), static_cast<unsigned>(rows));
        kernel<<<grid, kThreads, smem, stream>>>(indices.data_ptr<index_t>() + r0 * indices.stride(0),
                                                 indices.stride(0), indices.stride(1), n, E, lay,
                                                 load.data_ptr<double>(), bad.data_ptr<double>(), smem != 0);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
    if (probs.has_value()) {
      const at::Tensor& pr = *probs;
      const int64_t T_ = pr.size(1);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pr.scalar_type(), "expert_histogram_cuda_gate", [&] {
        const int threads = static_cast<int>(std::min<int64_t>(kThreads, (E + kWarp - 1) / kWarp * kWarp));
        const int64_t e_blocks = (E + threads - 1) / threads;
        // token slices: about 8 blocks per SM over the whole grid, each slice at least one token
        const int64_t t_blocks = std::max<int64_t>(
            1, std::min<int64_t>({T_, sms * 8 / std::max<int64_t>(1, e_blocks * rows), 65535}));
        const dim3 grid(static_cast<unsigned>(e_blocks), static_cast<unsigned>(t_blocks),
                        static_cast<unsigned>(rows));
        expert_gate_kernel<scalar_t><<<grid, threads, 0, stream>>>(pr.data_ptr<scalar_t>() + r0 * pr.stride(0),
                                                            pr.stride(0), pr.stride(1), pr.stride(2), T_, E, lay,
                                                            gate->data_ptr<double>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("expert_histogram", &d9d::cuda::expert_histogram_cuda); }
