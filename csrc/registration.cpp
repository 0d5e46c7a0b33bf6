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
  // Internal (CPU only, not in d9d_kernels._extension.OPS): the per-row partials
  // of a vocab-parallel shard, and their combination over the tp ranks added
  // to the class_stats state, csrc/cpu/vocab_partials.cpp.
  m.def("vocab_partials(Tensor x, Tensor target, int start, int kmax, bool sumexp, Tensor(a!) out) -> ()");
  m.def(
      "vocab_class_stats(Tensor g, Tensor target, Tensor? mask, int? ignore_index, Tensor? lse, int num_classes, "
      "int[] top_ks, bool nll, bool rows_by_lse, Tensor(a!) stats, Tensor(b!) extras, Tensor(c!) bad, "
      "Tensor(d!)? confmat) -> ()");
  // Internal (CPU only): one block of logits' per-row reductions for dk.LinearLogits,
  // folded into rows [n, 4], csrc/cpu/linear_logits.cpp.
  m.def("linear_logits_block(Tensor z, Tensor zt, Tensor tloc, int c0, bool sumexp, Tensor(a!) rows) -> ()");
}
