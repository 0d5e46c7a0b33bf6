// group_values: the values of many metrics from a group's packed float64
// buffers in one call (the fused compute and forward's batch values). Each
// program row names one metric's formula and where its statistics sit; the
// formulas are those of d9d_kernels/metrics/formulas/classification.py and
// metrics/formulas/fused.py, operation for operation, so only the order of
// the class sums can differ from them. Shared by csrc/cpu/group_values.cpp
// (one row after another) and csrc/cuda/group_values.cu (a block per row).
//
// A row whose offsets fall outside the buffers writes NaN (or nothing, when
// its output does): the program is built by our own plan, and the check keeps
// a wrong one from reading out of bounds without a host read on CUDA.
#pragma once

#include <cfloat>
#include <cstdint>

#include "common.h"

namespace d9d {
namespace group_values {

// Columns of a program row (int64 [K, kCols]).
enum Col : int {
  kFormula,    // Formula
  kAverage,    // Average (classification)
  kLayout,     // Layout (classification)
  kTopKRule,   // 1: a class absent from the target is left out of "macro" (top_k > 1)
  kClasses,    // C (classes or labels)
  kOffset,     // SUM: stats [3, C] / state [C, 4] / moments [w, Σx] / confmat [C, C]; MAX: the extremum
  kCount,      // SUM: valid rows n (class rows); REPLICA: the moments' pivot
  kNonfinite,  // SUM: non-finite rows (nan_strategy="propagate"), -1 none
  kOut,        // first output element
  kCols
};

// kConfmat: a multiclass confusion matrix, [C, C] counts at kOffset (ConfusionMatrix, normalize=None).
enum Formula : int64_t {
  kMean,
  kSum,
  kMax,
  kMin,
  kAccuracy,
  kPrecision,
  kRecall,
  kFBeta,
  kSpecificity,
  kJaccard,
  kConfmat
};
enum Average : int64_t { kMicro, kMacro, kWeighted, kNone };
// kClassRows: class_stats' [3, C] (tp, predicted, target) and n (multiclass);
// kLabelRows: binary_stats' [C, 4] (tp, fp, tn, fn) per label (binary, multilabel).
enum Layout : int64_t { kClassRows, kLabelRows };

struct Buffers {
  const double* sum;
  int64_t n_sum;
  const double* max;
  int64_t n_max;
  const double* replica;
  int64_t n_replica;
};

struct Counts {
  double tp, fp, tn, fn;
};

// A class-sum partial: the micro sums and the weighted score sums.
struct Partial {
  double tp = 0.0, fp = 0.0, tn = 0.0, fn = 0.0, ws = 0.0, w = 0.0;
};

// formulas.classification.safe_div: 0 where the denominator is 0.
D9D_HD inline double safe_div(double num, double den) { return den != 0.0 ? num / den : 0.0; }

D9D_HD inline bool in_range(int64_t off, int64_t len, int64_t n) { return off >= 0 && len >= 0 && off + len <= n; }

// Elements the row writes to `out`.
D9D_HD inline int64_t out_len(const int64_t* r) {
  if (r[kFormula] == kConfmat) return r[kClasses] * r[kClasses];
  return r[kFormula] >= kAccuracy && r[kAverage] == kNone ? r[kClasses] : 1;
}

// The row reads inside the buffers.
D9D_HD inline bool reads_ok(const int64_t* r, const Buffers& b) {
  const int64_t f = r[kFormula], C = r[kClasses];
  if (f == kMean || f == kSum) return in_range(r[kOffset], 2, b.n_sum) && in_range(r[kCount], 1, b.n_replica);
  if (f == kMax || f == kMin) return in_range(r[kOffset], 1, b.n_max);
  if (f == kConfmat) {
    return C >= 1 && C <= b.n_sum / C && in_range(r[kOffset], C * C, b.n_sum) &&
           (r[kNonfinite] < 0 || in_range(r[kNonfinite], 1, b.n_sum));
  }
  if (f > kJaccard || C < 1 || r[kAverage] < kMicro || r[kAverage] > kNone) return false;
  if (r[kNonfinite] >= 0 && !in_range(r[kNonfinite], 1, b.n_sum)) return false;
  if (r[kLayout] == kLabelRows) return C <= b.n_sum / 4 && in_range(r[kOffset], 4 * C, b.n_sum);
  return r[kLayout] == kClassRows && C <= b.n_sum / 3 && in_range(r[kOffset], 3 * C, b.n_sum) &&
         in_range(r[kCount], 1, b.n_sum);
}

// The row reads and writes inside the buffers and `out`.
D9D_HD inline bool row_ok(const int64_t* r, const Buffers& b, int64_t n_out) {
  return reads_ok(r, b) && in_range(r[kOut], out_len(r), n_out);
}

D9D_HD inline Counts counts_of(const int64_t* r, const double* sum, int64_t c) {
  if (r[kLayout] == kLabelRows) {
    const double* s = sum + r[kOffset] + 4 * c;
    return {s[0], s[1], s[2], s[3]};
  }
  const int64_t C = r[kClasses];
  const double* s = sum + r[kOffset];
  const double tp = s[c], fp = s[C + c] - tp, fn = s[2 * C + c] - tp;
  return {tp, fp, sum[r[kCount]] - tp - fp - fn, fn};
}

// The per-class score of formula `f` (multilabel: accuracy counts tn).
D9D_HD inline double class_score(int64_t f, bool multilabel, double beta2, const Counts& k) {
  switch (f) {
    case kAccuracy:
      return multilabel ? safe_div(k.tp + k.tn, k.tp + k.tn + k.fp + k.fn) : safe_div(k.tp, k.tp + k.fn);
    case kPrecision:
      return safe_div(k.tp, k.tp + k.fp);
    case kRecall:
      return safe_div(k.tp, k.tp + k.fn);
    case kFBeta:
      return safe_div((1 + beta2) * k.tp, (1 + beta2) * k.tp + beta2 * k.fn + k.fp);
    case kSpecificity:
      return safe_div(k.tn, k.tn + k.fp);
    default:  // kJaccard
      return safe_div(k.tp, k.tp + k.fp + k.fn);
  }
}

// Class c's contribution to the row's partial; with average "none" its score goes to out.
D9D_HD inline void add_class(const int64_t* r, double beta2, const double* sum, int64_t c, Partial& p, double* out) {
  const Counts k = counts_of(r, sum, c);
  const int64_t avg = r[kAverage];
  const bool multilabel = r[kLayout] == kLabelRows;
  p.tp += k.tp;
  p.fp += k.fp;
  p.tn += k.tn;
  p.fn += k.fn;
  if (avg == kMicro) return;
  const double s = class_score(r[kFormula], multilabel, beta2, k);
  if (avg == kNone) {
    out[r[kOut] + c] = s;
    return;
  }
  double w = 1.0;
  if (avg == kWeighted) {
    w = k.tp + k.fn;
  } else if (!multilabel) {
    const bool absent = r[kTopKRule] ? (k.tp + k.fn == 0.0) : (k.tp + k.fp + k.fn == 0.0);
    w = absent ? 0.0 : 1.0;
  }
  p.ws += w * s;
  p.w += w;
}

// torch.nan_to_num(v, nan=0.0): NaN -> 0, +-Inf -> the largest finite double.
D9D_HD inline double nan_to_num(double v) {
  if (is_nan(v)) return 0.0;
  if (v == INFINITY) return DBL_MAX;
  if (v == -INFINITY) return -DBL_MAX;
  return v;
}

// A moments / extrema row's value (one element).
D9D_HD inline double scalar_value(const int64_t* r, const Buffers& b) {
  switch (r[kFormula]) {
    case kMean: {  // NaN when Σw == 0 (WeightedMeanMetric's documented value)
      const double* m = b.sum + r[kOffset];
      return m[0] == 0.0 ? NAN : m[1] / m[0] + nan_to_num(b.replica[r[kCount]]);
    }
    case kSum: {
      const double* m = b.sum + r[kOffset];
      return m[1] + m[0] * nan_to_num(b.replica[r[kCount]]);
    }
    case kMax:
      return b.max[r[kOffset]];
    default:  // kMin: stored negated beside the max
      return -b.max[r[kOffset]];
  }
}

// A classification row's value from its summed partial (writes out[r[kOut]],
// or, with NaN propagation, overwrites the "none" scores).
D9D_HD inline void finish_class(const int64_t* r, double beta2, const double* sum, const Partial& p, double* out) {
  const int64_t avg = r[kAverage], o = r[kOut];
  const bool propagate_nan = r[kNonfinite] >= 0 && sum[r[kNonfinite]] > 0.0;
  if (avg == kNone) {
    if (propagate_nan)
      for (int64_t c = 0; c < r[kClasses]; ++c) out[o + c] = NAN;
    return;
  }
  double v;
  if (avg == kMicro) {
    // class_score of the summed counts is each formula's micro value
    v = class_score(r[kFormula], r[kLayout] == kLabelRows, beta2, Counts{p.tp, p.fp, p.tn, p.fn});
  } else {
    v = safe_div(p.ws, p.w);
  }
  out[o] = propagate_nan ? NAN : v;
}

// Element i of a confusion-matrix row: the count, or NaN once a prediction
// was non-finite under nan_strategy="propagate".
D9D_HD inline double confmat_value(const int64_t* r, const double* sum, int64_t i) {
  const bool propagate_nan = r[kNonfinite] >= 0 && sum[r[kNonfinite]] > 0.0;
  return propagate_nan ? NAN : sum[r[kOffset] + i];
}

// The row's outputs are NaN (row_ok is false), where its output fits.
D9D_HD inline void write_nan(const int64_t* r, double* out, int64_t n_out) {
  const int64_t len = out_len(r);
  if (!in_range(r[kOut], len, n_out)) return;
  for (int64_t i = 0; i < len; ++i) out[r[kOut] + i] = NAN;
}

}  // namespace group_values
}  // namespace d9d
