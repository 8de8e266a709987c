"""How good is a map: metrics that score saliency maps against ground truth and the model.

Definitions: docs/methods.md ("Metrics").

- :mod:`~vitexplain.metrics.localisation`: :func:`pointing_game` / :func:`pointing_accuracy`
  (Zhang et al. 2018; the map's maximum at image resolution, invariant to positive affine rescaling
  and to the ties bilinear upsampling makes), :func:`relevance_mass` and
  :func:`relevance_rank_accuracy` (Arras et al. 2022), :func:`top_k_intersection` (Theiner et al. 2021).
- :mod:`~vitexplain.metrics.perturbation`: :func:`deletion_insertion`, :func:`deletion_auc`,
  :func:`insertion_auc` (Petsiuk et al. 2018, RISE).
- :mod:`~vitexplain.metrics.imputation`: :func:`road` (Rong et al. 2022, MoRF / LeRF with noisy linear
  imputation) and :func:`noisy_linear_imputation`.
- :mod:`~vitexplain.metrics.robustness`: :func:`max_sensitivity`, :func:`avg_sensitivity` (Yeh et al. 2019)
  and the per-sample :func:`sensitivities`.
- :mod:`~vitexplain.metrics.concentration`: :func:`sparseness` (Gini index, Chalasani et al. 2020),
  :func:`complexity` (entropy, Bhatt et al. 2020), :func:`histogram_entropy`.
- :mod:`~vitexplain.metrics.correlation`: :func:`rank_correlation` (Spearman, average ranks for
  ties), :func:`pearson_correlation`, :func:`class_sensitivity`.
- :mod:`~vitexplain.metrics.sanity`: :func:`randomization_check` (Adebayo et al. 2018, model-parameter
  randomisation, top layer first), :func:`randomization_layers` and :func:`randomized_copy`.
- :mod:`~vitexplain.metrics.mprt`: :func:`efficient_mprt` and :func:`smooth_mprt` (Hedström et al. 2023).
- :mod:`~vitexplain.metrics.validation`: the input checks they share.

Everything is batched and stays in torch on the device of its inputs. Maps are ``(B, h, w)`` at any
resolution (a model's patch grid, or pixels); masks and images set the image resolution ``(H, W)``.
NumPy arrays are accepted wherever a tensor is. Bad shapes are a ``UsageError`` (a ``ValueError``)
that names the expected shape; a NaN or infinite value in a map is an error, never a silent NaN score.
"""

from __future__ import annotations

from .concentration import complexity, histogram_entropy, sparseness
from .correlation import class_sensitivity, pearson_correlation, rank_correlation
from .localisation import (
    PEAK_RTOL,
    TOLERANCE_AT_224,
    default_tolerance,
    peak_locations,
    pointing_accuracy,
    pointing_game,
    relevance_mass,
    relevance_rank_accuracy,
    top_k_intersection,
    upsample_maps,
)
from .mprt import EfficientMPRTResult, efficient_mprt, smooth_mprt
from .perturbation import DeletionInsertionResult, deletion_auc, deletion_insertion, insertion_auc
from .imputation import ROAD_FRACTIONS, RoadResult, noisy_linear_imputation, road
from .robustness import avg_sensitivity, max_sensitivity, sensitivities
from .sanity import RandomizationResult, randomization_check, randomization_layers, randomized_copy

__all__ = [
    "default_tolerance",
    "upsample_maps",
    "peak_locations",
    "pointing_game",
    "pointing_accuracy",
    "relevance_mass",
    "relevance_rank_accuracy",
    "top_k_intersection",
    "DeletionInsertionResult",
    "deletion_insertion",
    "deletion_auc",
    "insertion_auc",
    "RoadResult",
    "ROAD_FRACTIONS",
    "road",
    "noisy_linear_imputation",
    "sensitivities",
    "max_sensitivity",
    "avg_sensitivity",
    "sparseness",
    "complexity",
    "histogram_entropy",
    "rank_correlation",
    "pearson_correlation",
    "class_sensitivity",
    "RandomizationResult",
    "randomization_layers",
    "randomized_copy",
    "randomization_check",
    "EfficientMPRTResult",
    "efficient_mprt",
    "smooth_mprt",
    "TOLERANCE_AT_224",
    "PEAK_RTOL",
]
