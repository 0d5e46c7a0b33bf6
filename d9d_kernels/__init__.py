"""d9d_kernels: fused metric kernels and a metric library for large-scale PyTorch training.

``import d9d_kernels`` is cheap: names are resolved on first use (PEP 562),
so ``python -m d9d_kernels.trace`` never imports torch, and nothing here
initialises CUDA. The ops work without the compiled extension (see
``d9d_kernels.ops.backends()``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_SUBMODULES = ("ops", "reference", "functional", "checkpoint", "distributed", "metrics", "trace", "_extension", "d9d")

# module -> the public names it defines (a new metric: one line here)
_EXPORTS = {
    "d9d_kernels.distributed": ("DistributedContext",),
    "d9d_kernels.core.metric": ("Metric",),
    "d9d_kernels.core.group": ("MetricGroup",),
    "d9d_kernels.metrics.vocab_parallel": ("VocabShard",),
    "d9d_kernels.metrics.linear_logits": ("LinearLogits",),
    "d9d_kernels.metrics.aggregation": ("SumMetric", "WeightedMeanMetric", "MeanMetric", "MaxMetric", "MinMetric"),
    "d9d_kernels.metrics.classification": ("Accuracy", "Precision", "Recall", "F1Score", "FBetaScore", "Specificity",
                                           "JaccardIndex", "MatthewsCorrCoef", "CohenKappa", "ConfusionMatrix"),
    "d9d_kernels.metrics.classification_extended": ("StatScores", "HammingDistance", "ExactMatch",
                                                    "NegativePredictiveValue"),
    "d9d_kernels.metrics.ranking": ("AUROC", "AveragePrecision"),
    "d9d_kernels.metrics.curves": ("ROC", "PrecisionRecallCurve"),
    "d9d_kernels.metrics.curves_derived": ("LogAUC", "PrecisionAtFixedRecall", "RecallAtFixedPrecision",
                                           "SensitivityAtSpecificity", "SpecificityAtSensitivity"),
    "d9d_kernels.metrics.calibration": ("CalibrationError",),
    "d9d_kernels.metrics.regression": ("MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef",
                                       "ExplainedVariance"),
    "d9d_kernels.metrics.regression_extended": ("MeanSquaredLogError", "NormalizedRootMeanSquaredError",
                                                "WeightedMeanAbsolutePercentageError", "LogCoshError",
                                                "MinkowskiDistance", "RelativeSquaredError", "ConcordanceCorrCoef",
                                                "TweedieDevianceScore", "CriticalSuccessIndex"),
    "d9d_kernels.metrics.percentage_error": ("MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError"),
    "d9d_kernels.metrics.text": ("Perplexity",),
    "d9d_kernels.metrics.segmentation": ("Dice", "DiceScore", "GeneralizedDiceScore", "MeanIoU"),
    "d9d_kernels.metrics.similarity": ("KLDivergence", "CosineSimilarity"),
    "d9d_kernels.metrics.divergence": ("JensenShannonDivergence",),
    "d9d_kernels.metrics.running": ("RunningMean", "ExponentialMovingAverage"),
    "d9d_kernels.metrics.running_window": ("Running", "RunningSum"),
    "d9d_kernels.metrics.expert_load": ("ExpertLoad",),
}
# public name -> module that defines it
_NAMES = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [*_NAMES, *_SUBMODULES]


if TYPE_CHECKING:  # what __getattr__ resolves, spelled out for type checkers
    from d9d_kernels.core.group import MetricGroup
    from d9d_kernels.core.metric import Metric
    from d9d_kernels.metrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
    from d9d_kernels.metrics.classification import Accuracy, ConfusionMatrix, F1Score, Precision, Recall
    from d9d_kernels.metrics.expert_load import ExpertLoad
    from d9d_kernels.metrics.text import Perplexity


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
