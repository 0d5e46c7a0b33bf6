// moments_recenter and moments_center on CPU: one loop over the table's
// entries (a storage holds a few; no threads). Specification:
// d9d_kernels/reference.py::moments_recenter, ::moments_center.
#include <torch/library.h>

#include "../kernels/moments_pivot.h"
#include "../kernels/moments_pivot_checks.h"

namespace d9d {

namespace {

// Entry e's offsets (sums, pivots), checked against the buffers' sizes.
std::pair<int64_t, int64_t> offsets(const char* op, const int64_t* t, int64_t e, const at::Tensor& sums,
                                    const at::Tensor& pivots) {
  const int64_t mo = t[3 * e], po = t[3 * e + 1];
  D9D_CHECK(mo >= 0 && mo + kMomentsSize <= sums.numel() && po >= 0 && po + 2 <= pivots.numel(), op, "table",
            "row ", e, " = (", mo, ", ", po, ") is outside sums [", sums.numel(), "] / pivots [", pivots.numel(), "]");
  return {mo, po};
}

void moments_recenter_cpu(const at::Tensor& sums, const at::Tensor& pivots, const at::Tensor& new_pivots,
                          const at::Tensor& table) {
  const char* op = "moments_recenter";
  const int64_t b = check_moments_pivot(op, sums, pivots, new_pivots, "new_pivots", table);
  const int64_t* t = table.const_data_ptr<int64_t>();
  for (int64_t e = 0; e < b; ++e) offsets(op, t, e, sums, pivots);  // all rows before any write
  double* m = sums.data_ptr<double>();
  double* p = pivots.data_ptr<double>();
  const double* q = new_pivots.const_data_ptr<double>();
  for (int64_t e = 0; e < b; ++e) recenter_entry(m + t[3 * e], p + t[3 * e + 1], q + t[3 * e + 1]);
}

void moments_center_cpu(const at::Tensor& sums, const at::Tensor& pivots, const at::Tensor& table, double threshold,
                        const at::Tensor& centre, const at::Tensor& off) {
  const char* op = "moments_center";
  const int64_t b = check_moments_pivot(op, sums, pivots, centre, "centre", table);
  check_off(off, sums);
  const int64_t* t = table.const_data_ptr<int64_t>();
  for (int64_t e = 0; e < b; ++e) offsets(op, t, e, sums, pivots);
  const double* m = sums.const_data_ptr<double>();
  const double* p = pivots.const_data_ptr<double>();
  double* c = centre.data_ptr<double>();
  bool any = false;
  for (int64_t e = 0; e < b; ++e) {
    const int64_t po = t[3 * e + 1];
    any = center_entry(m + t[3 * e], p + po, t[3 * e + 2] != 0, threshold, c + po) || any;
  }
  if (any) *off.data_ptr<bool>() = true;
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) {
  m.impl("moments_recenter", &d9d::moments_recenter_cpu);
  m.impl("moments_center", &d9d::moments_center_cpu);
}
