"""d9d_kernels: fused metric kernels and a metric library for large-scale PyTorch training.

``import d9d_kernels`` is cheap: names are resolved on first use (PEP 562),
so ``python -m d9d_kernels.trace`` never imports torch, and nothing here
initialises CUDA. The ops work without the compiled extension (see
``d9d_kernels.ops.backends()``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("ops", "reference", "functional", "checkpoint", "distributed", "metrics", "trace", "_extension", "d9d")

# public name -> module that defines it
_NAMES = {
    "DistributedContext": "d9d_kernels.distributed",
    "VocabShard": "d9d_kernels.metrics.vocab_parallel",
    "LinearLogits": "d9d_kernels.metrics.linear_logits",
    "Metric": "d9d_kernels.core.metric",
    "MetricGroup": "d9d_kernels.core.group",
    **{n: "d9d_kernels.metrics.aggregation" for n in ("SumMetric", "WeightedMeanMetric", "MeanMetric", "MaxMetric", "MinMetric")},
    **{
        n: "d9d_kernels.metrics.catalogue"
        for n in (
            "Accuracy", "Precision", "Recall", "F1Score", "FBetaScore", "Specificity", "JaccardIndex",
            "MatthewsCorrCoef", "CohenKappa", "ConfusionMatrix", "AUROC", "AveragePrecision",
            "MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance",
            "Perplexity",
            "CalibrationError", "Dice", "DiceScore", "GeneralizedDiceScore", "MeanIoU", "KLDivergence",
            "CosineSimilarity", "MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError", "RunningMean",
            "ExponentialMovingAverage",
            "MeanSquaredLogError", "NormalizedRootMeanSquaredError", "WeightedMeanAbsolutePercentageError",
            "LogCoshError", "MinkowskiDistance", "RelativeSquaredError", "ConcordanceCorrCoef",
            "TweedieDevianceScore", "CriticalSuccessIndex", "StatScores", "HammingDistance", "ExactMatch",
            "NegativePredictiveValue", "Running", "RunningSum", "JensenShannonDivergence", "ROC",
            "PrecisionRecallCurve",
            "LogAUC", "PrecisionAtFixedRecall", "RecallAtFixedPrecision", "SensitivityAtSpecificity",
            "SpecificityAtSensitivity",
        )
    },
}

__all__ = [*_NAMES, *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"d9d_kernels.{name}")
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'd9d_kernels' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


# with d9d installed every dk Metric is a d9d.metric.Metric, registered when
# both are imported (an import hook until then; imports neither d9d nor torch)
from d9d_kernels.d9d import install as _install_d9d  # noqa: E402

_install_d9d()

# torch.ops.d9d_kernels.* must exist as soon as d9d_kernels is imported in a
# process that uses torch; a torch-free process (the trace CLI: 2-6 s less
# start-up here) never loads it.
if "torch" in __import__("sys").modules:
    from d9d_kernels import ops  # noqa: E402,F401  (loads _C once)
