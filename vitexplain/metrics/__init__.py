"""How good is a map: metrics that score saliency maps against ground truth and the model.

Definitions: docs/methods.md ("Metrics").

- :mod:`~vitexplain.metrics.localisation`: :func:`pointing_game` / :func:`pointing_accuracy`
  (Zhang et al. 2018; the map's maximum at image resolution, invariant to positive affine rescaling
  and to the ties bilinear upsampling makes) and :func:`relevance_mass` (Arras et al. 2022).
- :mod:`~vitexplain.metrics.perturbation`: :func:`deletion_insertion`, :func:`deletion_auc`,
  :func:`insertion_auc` (Petsiuk et al. 2018, RISE).
- :mod:`~vitexplain.metrics.correlation`: :func:`rank_correlation` (Spearman, average ranks for
  ties), :func:`pearson_correlation`, :func:`class_sensitivity`.
- :mod:`~vitexplain.metrics.sanity`: :func:`randomization_check` (Adebayo et al. 2018, model-parameter
  randomisation, top layer first) and :func:`randomization_layers`.
- :mod:`~vitexplain.metrics.validation`: the input checks they share.

Everything is batched and stays in torch on the device of its inputs. Maps are ``(B, h, w)`` at any
resolution (a model's patch grid, or pixels); masks and images set the image resolution ``(H, W)``.
NumPy arrays are accepted wherever a tensor is. Bad shapes are a ``UsageError`` (a ``ValueError``)
that names the expected shape; a NaN or infinite value in a map is an error, never a silent NaN score.
"""

from __future__ import annotations

from .correlation import class_sensitivity, pearson_correlation, rank_correlation
from .localisation import (
    PEAK_RTOL,
    TOLERANCE_AT_224,
    default_tolerance,
    peak_locations,
    pointing_accuracy,
    pointing_game,
    relevance_mass,
    upsample_maps,
)
from .perturbation import DeletionInsertionResult, deletion_auc, deletion_insertion, insertion_auc
from .sanity import RandomizationResult, randomization_check, randomization_layers

__all__ = [
    "default_tolerance",
    "upsample_maps",
    "peak_locations",
    "pointing_game",
    "pointing_accuracy",
    "relevance_mass",
    "DeletionInsertionResult",
    "deletion_insertion",
    "deletion_auc",
    "insertion_auc",
    "rank_correlation",
    "pearson_correlation",
    "class_sensitivity",
    "RandomizationResult",
    "randomization_layers",
    "randomization_check",
    "TOLERANCE_AT_224",
    "PEAK_RTOL",
]
