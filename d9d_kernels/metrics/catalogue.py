"""The metric catalogue: classification, ranking, regression, text;
calibration, segmentation, similarity, percentage errors, running mean.

Re-exported by ``d9d_kernels`` (``dk.Accuracy``, ``dk.AUROC``, ...).
"""

from d9d_kernels.metrics.classification import (
    Accuracy,
    CohenKappa,
    ConfusionMatrix,
    F1Score,
    FBetaScore,
    JaccardIndex,
    MatthewsCorrCoef,
    Precision,
    Recall,
    Specificity,
)
from d9d_kernels.metrics.ranking import AUROC, AveragePrecision
from d9d_kernels.metrics.regression import (
    ExplainedVariance,
    MeanAbsoluteError,
    MeanSquaredError,
    PearsonCorrCoef,
    R2Score,
)
from d9d_kernels.metrics.text import Perplexity
from d9d_kernels.metrics.calibration import CalibrationError
from d9d_kernels.metrics.segmentation import Dice, DiceScore, GeneralizedDiceScore, MeanIoU
from d9d_kernels.metrics.similarity import CosineSimilarity, KLDivergence
from d9d_kernels.metrics.percentage_error import MeanAbsolutePercentageError, SymmetricMeanAbsolutePercentageError
from d9d_kernels.metrics.running import ExponentialMovingAverage, RunningMean
from d9d_kernels.metrics.regression_extended import (
    ConcordanceCorrCoef,
    CriticalSuccessIndex,
    LogCoshError,
    MeanSquaredLogError,
    MinkowskiDistance,
    NormalizedRootMeanSquaredError,
    RelativeSquaredError,
    TweedieDevianceScore,
    WeightedMeanAbsolutePercentageError,
)
from d9d_kernels.metrics.classification_extended import ExactMatch, HammingDistance, NegativePredictiveValue, StatScores
from d9d_kernels.metrics.divergence import JensenShannonDivergence
from d9d_kernels.metrics.running_window import Running, RunningSum
from d9d_kernels.metrics.curves import ROC, PrecisionRecallCurve
from d9d_kernels.metrics.curves_derived import (
    LogAUC,
    PrecisionAtFixedRecall,
    RecallAtFixedPrecision,
    SensitivityAtSpecificity,
    SpecificityAtSensitivity,
)

__all__ = [
    "Accuracy",
    "Precision",
    "Recall",
    "F1Score",
    "FBetaScore",
    "Specificity",
    "JaccardIndex",
    "MatthewsCorrCoef",
    "CohenKappa",
    "ConfusionMatrix",
    "AUROC",
    "AveragePrecision",
    "MeanSquaredError",
    "MeanAbsoluteError",
    "R2Score",
    "PearsonCorrCoef",
    "ExplainedVariance",
    "Perplexity",
    "CalibrationError",
    "Dice",
    "DiceScore",
    "GeneralizedDiceScore",
    "MeanIoU",
    "KLDivergence",
    "CosineSimilarity",
    "MeanAbsolutePercentageError",
    "SymmetricMeanAbsolutePercentageError",
    "RunningMean",
    "ExponentialMovingAverage",
    "MeanSquaredLogError",
    "NormalizedRootMeanSquaredError",
    "WeightedMeanAbsolutePercentageError",
    "LogCoshError",
    "MinkowskiDistance",
    "RelativeSquaredError",
    "ConcordanceCorrCoef",
    "TweedieDevianceScore",
    "CriticalSuccessIndex",
    "StatScores",
    "HammingDistance",
    "ExactMatch",
    "NegativePredictiveValue",
    "Running",
    "RunningSum",
    "JensenShannonDivergence",
    "ROC",
    "PrecisionRecallCurve",
    "LogAUC",
    "PrecisionAtFixedRecall",
    "RecallAtFixedPrecision",
    "SensitivityAtSpecificity",
    "SpecificityAtSensitivity",
]
