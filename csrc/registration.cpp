// Every op schema of d9d_kernels in one place. Backends only m.impl() these:
// csrc/cpu/<op>.cpp (CPU), csrc/cuda/<op>.cu (CUDA). The Python reference in
// d9d_kernels/reference.py is the specification of each op. The module's
// Python functions (csrc/host/) are the host glue, apart from the kernels.
#include <torch/library.h>

TORCH_LIBRARY(d9d_kernels, m) {
  m.def(
      "weighted_moments(Tensor x, Tensor? y, Tensor? weights, Tensor? mask, bool skip_bad, "
      "Tensor(a!) state, Tensor(b!) bad, Tensor(c!)? pivot) -> ()");
  m.def(
      "class_stats(Tensor preds, Tensor target, Tensor? mask, int num_classes, int? ignore_index, "
      "int[] top_ks, bool nll, Tensor(a!) stats, Tensor(b!)? confmat, Tensor(c!) extras, "
      "Tensor(d!) bad) -> ()");
  m.def(
      "binary_stats(Tensor preds, Tensor target, Tensor? mask, float threshold, int? ignore_index, "
      "int input_kind, Tensor(a!) state, Tensor(b!) bad) -> ()");
  m.def(
      "score_histogram(Tensor preds, Tensor target, Tensor? mask, int? ignore_index, int input_kind, "
      "bool multiclass, Tensor(a!) hist, Tensor(b!) bad) -> ()");
  m.def("running_extrema(Tensor x, Tensor? mask, bool skip_bad, Tensor(a!) state, Tensor(b!) bad) -> ()");
  m.def(
      "expert_histogram(Tensor indices, int[] layers, Tensor? probs, Tensor(a!) load, Tensor(b!)? gate, "
      "Tensor(c!) bad) -> ()");
  // Internal (CPU only, not in d9d_kernels._extension.OPS): the per-row partials
  // of a vocab-parallel shard, and their combination over the tp ranks added
  // to the class_stats state, csrc/cpu/vocab_partials.cpp.
  m.def("vocab_partials(Tensor x, Tensor target, int start, int kmax, bool sumexp, Tensor(a!) out) -> ()");
  m.def(
      "vocab_class_stats(Tensor g, Tensor target, Tensor? mask, int? ignore_index, Tensor? lse, int num_classes, "
      "int[] top_ks, bool nll, bool rows_by_lse, Tensor(a!) stats, Tensor(b!) extras, Tensor(c!) bad, "
      "Tensor(d!)? confmat) -> ()");
  // Internal (CPU only): the per-row reductions of hidden @ weight.T (+ bias, soft-cap)
  // for dk.LinearLogits, by blocks of rows x cols, into rows [N, 4], and each row's target
  // logit, csrc/cpu/linear_logits.cpp.
  m.def(
      "linear_logits_rows(Tensor hidden, Tensor weight, Tensor? bias, Tensor zt, Tensor tloc, int cols, int rows, "
      "float? softcap, bool sumexp, Tensor(a!) out) -> ()");
  m.def(
      "linear_logits_target(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int start, Tensor(a!) out) "
      "-> ()");
  // Internal: moment sums re-expressed about new pivots in place, and their
  // centres and off-centre flag, for the B entries a table addresses in flat
  // SUM / REPLICA buffers (a sync's pivoted statistics in one call each),
  // csrc/*/moments_pivot.*.
  m.def("moments_recenter(Tensor(a!) sums, Tensor(b!) pivots, Tensor new_pivots, Tensor table) -> ()");
  m.def(
      "moments_center(Tensor sums, Tensor pivots, Tensor table, float threshold, Tensor(a!) centre, "
      "Tensor(b!) off) -> ()");
}

// Meta: each op's argument checks alone (csrc/kernels/*_checks.h, the ones the
// CPU and CUDA entry points run first). FakeTensor and torch.compile run
// these, and dk.ops runs them before a Triton or PyTorch-reference backend, so
// every backend refuses the same arguments with the same message. The ops
// write in place and return nothing: checking is all a meta kernel does.
#include "kernels/binary_checks.h"
#include "kernels/class_stats_checks.h"
#include "kernels/expert_histogram_checks.h"
#include "kernels/running_extrema_checks.h"
#include "kernels/weighted_moments_checks.h"

namespace d9d {
namespace {

using OptTensor = std::optional<at::Tensor>;

void weighted_moments_meta(const at::Tensor& x, const OptTensor& y, const OptTensor& weights, const OptTensor& mask,
                           bool, const at::Tensor& state, const at::Tensor& bad, const OptTensor& pivot) {
  check_weighted_moments(x, y, weights, mask, state, bad, pivot);
}

void class_stats_meta(const at::Tensor& preds, const at::Tensor& target, const OptTensor& mask, int64_t num_classes,
                      std::optional<int64_t>, at::IntArrayRef top_ks, bool nll, const at::Tensor& stats,
                      const OptTensor& confmat, const at::Tensor& extras, const at::Tensor& bad) {
  check_class_stats(preds, target, mask, num_classes, top_ks, nll, stats, confmat, extras, bad);
}

void binary_stats_meta(const at::Tensor& preds, const at::Tensor& target, const OptTensor& mask, double,
                       std::optional<int64_t>, int64_t input_kind, const at::Tensor& state, const at::Tensor& bad) {
  check_binary_stats(preds, target, mask, input_kind, state, bad);
}

void score_histogram_meta(const at::Tensor& preds, const at::Tensor& target, const OptTensor& mask,
                          std::optional<int64_t>, int64_t input_kind, bool multiclass, const at::Tensor& hist,
                          const at::Tensor& bad) {
  check_score_histogram(preds, target, mask, input_kind, multiclass, hist, bad);
}

void running_extrema_meta(const at::Tensor& x, const OptTensor& mask, bool, const at::Tensor& state,
                          const at::Tensor& bad) {
  check_running_extrema(x, mask, state, bad);
}

void expert_histogram_meta(const at::Tensor& indices, at::IntArrayRef layers, const OptTensor& probs,
                           const at::Tensor& load, const OptTensor& gate, const at::Tensor& bad) {
  check_expert_histogram(indices, layers, probs, load, gate, bad);
}

// The internal ops are called only by library code that shapes their
// arguments itself: shape-free meta kernels.
void vocab_partials_meta(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool, const at::Tensor&) {}
void vocab_class_stats_meta(const at::Tensor&, const at::Tensor&, const OptTensor&, std::optional<int64_t>,
                            const OptTensor&, int64_t, at::IntArrayRef, bool, bool, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const OptTensor&) {}
void linear_logits_rows_meta(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&,
                             const at::Tensor&, int64_t, int64_t, std::optional<double>, bool, const at::Tensor&) {}
void moments_recenter_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {}
void moments_center_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                         const at::Tensor&) {}
void linear_logits_target_meta(const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&, int64_t,
                               const at::Tensor&) {}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, Meta, m) {
  m.impl("weighted_moments", &d9d::weighted_moments_meta);
  m.impl("class_stats", &d9d::class_stats_meta);
  m.impl("binary_stats", &d9d::binary_stats_meta);
  m.impl("score_histogram", &d9d::score_histogram_meta);
  m.impl("running_extrema", &d9d::running_extrema_meta);
  m.impl("expert_histogram", &d9d::expert_histogram_meta);
  m.impl("vocab_partials", &d9d::vocab_partials_meta);
  m.impl("vocab_class_stats", &d9d::vocab_class_stats_meta);
  m.impl("linear_logits_rows", &d9d::linear_logits_rows_meta);
  m.impl("linear_logits_target", &d9d::linear_logits_target_meta);
  m.impl("moments_recenter", &d9d::moments_recenter_meta);
  m.impl("moments_center", &d9d::moments_center_meta);
}
