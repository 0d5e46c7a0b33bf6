// moments_recenter and moments_center on CPU: one loop over the entries
// (a storage holds a few; no threads). Specification:
// d9d_kernels/reference.py::moments_recenter, ::moments_center.
#include <torch/library.h>

#include "../kernels/moments_pivot.h"
#include "../kernels/moments_pivot_checks.h"

namespace d9d {

namespace {

void moments_recenter_cpu(const at::Tensor& moments, const at::Tensor& pivot, const at::Tensor& new_pivot) {
  const int64_t b = check_moments_pivot("moments_recenter", moments, pivot, new_pivot, "new_pivot");
  double* m = moments.data_ptr<double>();
  double* p = pivot.data_ptr<double>();
  const double* q = new_pivot.const_data_ptr<double>();
  for (int64_t e = 0; e < b; ++e) recenter_entry(m + e * kMomentsSize, p + 2 * e, q + 2 * e);
}

void moments_center_cpu(const at::Tensor& moments, const at::Tensor& pivot, bool paired, double threshold,
                        const at::Tensor& centre, const at::Tensor& off) {
  const int64_t b = check_moments_pivot("moments_center", moments, pivot, centre, "centre");
  check_off(off, moments);
  const double* m = moments.const_data_ptr<double>();
  const double* p = pivot.const_data_ptr<double>();
  double* c = centre.data_ptr<double>();
  bool any = false;
  for (int64_t e = 0; e < b; ++e) any = center_entry(m + e * kMomentsSize, p + 2 * e, paired, threshold, c + 2 * e) || any;
  if (any) *off.data_ptr<bool>() = true;
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) {
  m.impl("moments_recenter", &d9d::moments_recenter_cpu);
  m.impl("moments_center", &d9d::moments_center_cpu);
}
