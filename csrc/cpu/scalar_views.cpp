// scalar_views(x): x.unbind(0) of a 1-D tensor as 0-d tensors that share x's
// storage, each made directly as a TensorImpl at its offset. The fused compute
// of a group returns one fresh tensor per member from one packed output, and
// unbind's per-element select goes through the dispatcher and the view
// bookkeeping (~1 us a scalar). The results carry no autograd history: callers
// pass a plain tensor the op just wrote, outside torch.compile. Host code for
// any device: it lives with the CPU sources because the host compiler builds it.
#include <torch/extension.h>

#include <vector>

namespace py = pybind11;

namespace d9d {
namespace {

std::vector<at::Tensor> scalar_views(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1, "d9d_kernels._C.scalar_views: argument 'x' must be 1-D, got ", x.dim(), "-D");
  TORCH_CHECK(x.layout() == at::kStrided && x.has_storage() && !x.requires_grad() && !x.is_quantized(),
              "d9d_kernels._C.scalar_views: argument 'x' must be a plain strided tensor without grad");
  const int64_t n = x.size(0), stride = x.stride(0), offset = x.storage_offset();
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(x.storage()), x.key_set(), x.dtype());
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    impl->set_storage_offset(offset + i * stride);
    impl->set_sizes_contiguous({});
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace

// Adds scalar_views to the module; without it (an error here) callers unbind.
void add_scalar_views(PyObject* module) {
  try {
    py::module_ m = py::reinterpret_borrow<py::module_>(module);
    m.def("scalar_views", &scalar_views, "x.unbind(0) of a 1-D tensor, without the dispatcher");
  } catch (const std::exception&) {
    PyErr_Clear();
  }
}

}  // namespace d9d
