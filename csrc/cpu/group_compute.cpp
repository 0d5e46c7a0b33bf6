// A group's compute() from Python in one call (d9d_kernels/metrics/formulas/fused.py).
//
//  * scalar_views(x): x.unbind(0) of a 1-D tensor as 0-d tensors that share
//    x's storage, each made directly as a TensorImpl at its offset. A group's
//    compute returns one fresh tensor per member from one packed output, and
//    unbind's per-element select goes through the dispatcher and the view
//    bookkeeping. Any device. group_compute makes the vector values (a
//    per-class score, a confusion matrix) the same way, with their shapes.
//  * group_compute(...) on CPU buffers: the output allocated, the group_values
//    kernel, the counts of bad inputs that make members raise (weighted sums of
//    slots of the SUM buffer) and the scalar views, with no dispatched op in
//    between. compute() runs right after a sync, from cold caches, so the
//    number of distinct ops it touches, not their work, decides its cost.
// The results carry no autograd history: callers pass plain tensors, outside
// torch.compile. Host code: it lives with the CPU sources because the host
// compiler builds it.
#include <ATen/EmptyTensor.h>
#include <torch/extension.h>

#include <tuple>
#include <utility>
#include <vector>

#include "host_calls.h"

namespace py = pybind11;

namespace d9d {

constexpr const char* kGroupCompute = "d9d_kernels._C.group_compute";

void group_values_cpu(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                      const at::Tensor& program, const at::Tensor& beta, const at::Tensor& out);  // group_values.cpp

namespace {

// Tensors on x's storage, one after another from x[0]: n_scalar 0-d ones,
// then one per shape in `shapes` (row-major over x's stride), each made
// directly as a TensorImpl.
std::vector<at::Tensor> value_views(const char* op, const at::Tensor& x, int64_t n_scalar,
                                    const std::vector<std::vector<int64_t>>& shapes) {
  TORCH_CHECK(x.dim() == 1, op, ": argument 'x' must be 1-D, got ", x.dim(), "-D");
  TORCH_CHECK(x.layout() == at::kStrided && x.has_storage() && !x.requires_grad() && !x.is_quantized(), op,
              ": argument 'x' must be a plain strided tensor without grad");
  int64_t need = n_scalar;
  for (const auto& shape : shapes) {
    for (int64_t d : shape) TORCH_CHECK(d >= 0, op, ": argument 'shapes' holds a negative size, ", d);
    need += c10::multiply_integers(shape);
  }
  TORCH_CHECK(n_scalar >= 0 && need <= x.size(0), op, ": the values need ", need, " elements, 'x' has ", x.size(0));
  const int64_t stride = x.stride(0);
  int64_t offset = x.storage_offset();
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n_scalar) + shapes.size());
  auto make = [&](c10::IntArrayRef sizes) {
    out.push_back(value_view(x, offset, stride, sizes));
    offset += c10::multiply_integers(sizes) * stride;
  };
  for (int64_t i = 0; i < n_scalar; ++i) make({});
  for (const auto& shape : shapes) make(shape);
  return out;
}

std::vector<at::Tensor> scalar_views(const at::Tensor& x) {
  return value_views("d9d_kernels._C.scalar_views", x, x.dim() == 1 ? x.size(0) : 0, {});
}

// (the values: n_scalar 0-d tensors then one per vector shape, all on one new
// `out` of out_size; out; raising counts): counts[r] = sum_j bad_matrix[r, j] *
// sum[bad_index[j]] (exact: small integer sums).
std::tuple<std::vector<at::Tensor>, at::Tensor, std::vector<double>> group_compute(
    const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica, const at::Tensor& program,
    const at::Tensor& beta, int64_t out_size, int64_t n_scalar, const std::vector<std::vector<int64_t>>& shapes,
    const at::Tensor& bad_index, const at::Tensor& bad_matrix) {
  constexpr const char* op = kGroupCompute;
  TORCH_CHECK(bad_index.device().is_cpu() && bad_index.scalar_type() == at::kLong && bad_index.dim() == 1 &&
                  bad_index.is_contiguous(),
              op, ": argument 'bad_index' must be a contiguous 1-D int64 CPU tensor");
  const int64_t B = bad_index.numel();
  TORCH_CHECK(bad_matrix.device().is_cpu() && bad_matrix.scalar_type() == at::kDouble && bad_matrix.dim() == 2 &&
                  bad_matrix.size(1) == B && bad_matrix.is_contiguous(),
              op, ": argument 'bad_matrix' must be a contiguous float64 CPU tensor [R, ", B, "], got ",
              bad_matrix.sizes());
  const int64_t* idx = bad_index.data_ptr<int64_t>();
  for (int64_t j = 0; j < B; ++j) {
    TORCH_CHECK(0 <= idx[j] && idx[j] < sum.numel(), op, ": argument 'bad_index' holds ", idx[j],
                ", outside the SUM buffer of ", sum.numel());
  }
  at::Tensor out = host_values_out(sum, max, replica, program, beta, out_size, n_scalar);
  std::vector<at::Tensor> values = value_views(op, out, n_scalar, shapes);
  const double* s = sum.data_ptr<double>();
  const double* m = bad_matrix.data_ptr<double>();
  std::vector<double> counts(static_cast<size_t>(bad_matrix.size(0)), 0.0);
  for (size_t r = 0; r < counts.size(); ++r) {
    for (int64_t j = 0; j < B; ++j) counts[r] += m[static_cast<int64_t>(r) * B + j] * s[idx[j]];
  }
  return {std::move(values), std::move(out), std::move(counts)};
}

}  // namespace

at::Tensor value_view(const at::Tensor& x, int64_t offset, int64_t stride, c10::IntArrayRef sizes) {
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(x.storage()), x.key_set(), x.dtype());
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_storage_offset(offset);
  if (sizes.empty() || stride == 1) {
    impl->set_sizes_contiguous(sizes);
  } else {
    std::vector<int64_t> strides(sizes.size());
    int64_t s = stride;
    for (size_t d = sizes.size(); d-- > 0;) {
      strides[d] = s;
      s *= sizes[d];
    }
    impl->set_sizes_and_strides(sizes, strides);
  }
  return t;
}

at::Tensor host_values_out(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                           const at::Tensor& program, const at::Tensor& beta, int64_t out_size, int64_t n_scalar) {
  constexpr const char* op = kGroupCompute;
  TORCH_CHECK(sum.device().is_cpu(), op, ": argument 'sum' must be on the CPU, got ", sum.device());
  TORCH_CHECK(0 <= n_scalar && n_scalar <= out_size, op, ": argument 'n_scalar' must lie in [0, out_size = ",
              out_size, "], got ", n_scalar);
  at::Tensor out = at::detail::empty_cpu({out_size}, at::kDouble, std::nullopt, std::nullopt, std::nullopt,
                                         std::nullopt);
  group_values_cpu(sum, max, replica, program, beta, out);
  return out;
}

// Adds scalar_views and group_compute to the module; without them (an error
// here) compute() takes the dispatched ops.
void add_group_compute(PyObject* module) {
  try {
    py::module_ m = py::reinterpret_borrow<py::module_>(module);
    m.def("scalar_views", &scalar_views, "x.unbind(0) of a 1-D tensor, without the dispatcher");
    m.def("group_compute", &group_compute, "a group's values and raising bad counts from CPU buffers");
  } catch (const std::exception&) {
    PyErr_Clear();
  }
}

}  // namespace d9d
