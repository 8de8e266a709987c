"""Checks the batch commands share: which images of a batch have non-finite outputs or maps,
or a generated caption without a word.

A NaN or inf in a model's outputs or in one method's map fails that image with a message
(:func:`not_finite_error`), and so does an empty generated caption (:func:`empty_caption_error`);
the run goes on with the others. A captioner whose outputs are not finite on a blank image is a
usage error before anything is written (:func:`check_captioner_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["finite_rows", "not_finite_error", "empty_caption_error", "check_captioner_outputs"]


def finite_rows(maps: dict[str, "np.ndarray"], logits: Any) -> tuple[list[bool], list[list[str]]]:
    """Per image of a batch: whether the model's outputs are finite, and the methods whose map
    holds NaN/inf (one vectorised check per batch)."""
    import numpy as np
    import torch

    first = next(iter(maps.values()))
    n = int(first.shape[0])
    if isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.shape[0] == n:
        outputs_ok = torch.isfinite(logits.detach().reshape(n, -1)).all(dim=1).tolist()
    else:
        outputs_ok = [True] * n
    bad_maps: list[list[str]] = [[] for _ in range(n)]
    for name, m in maps.items():
        for b in np.flatnonzero(~np.isfinite(m.reshape(n, -1)).all(axis=1)):
            bad_maps[int(b)].append(name)
    return outputs_ok, bad_maps


def not_finite_error(what: str, outputs_ok: bool, bad_maps: list[str]) -> Optional[str]:
    """The error of an image whose outputs or maps hold NaN/inf, or None."""
    if not outputs_ok:
        return (f"the model's outputs for {what} are not finite (NaN or inf); its maps would be meaningless. "
                "Check the model's weights and the image")
    if bad_maps:
        return (f"the {', '.join(bad_maps)} map of {what} is not finite (NaN or inf): the method broke down "
                "numerically on this image")
    return None


def empty_caption_error(what: str, n_words: int, generated: bool) -> Optional[str]:
    """The error of an image whose generated caption (a captioner's, or a vision-language model's answer) has no word
    (nothing to explain), or None."""
    if n_words or not generated:
        return None
    return (f"the model generated an empty caption for {what} (it ended the caption at once): there is no word "
            "to explain; check the image, or pass --caption TEXT to explain given words")


def check_captioner_outputs(adapter: Any, device: Any, autocast_dtype: Any, input_size: Any) -> None:
    """A captioner whose next-word scores on a blank image are NaN/inf is a usage error (exit 2).

    Attention-only methods never read the decoder's outputs, and greedy decoding of NaN scores
    picks the first token id at every step: without this check such a model's "captions" (``<pad>
    <pad> ...``) and maps were written as results.

    Args:
        adapter: the captioner's adapter (its ``teacher_forced`` gives (B, T, V) scores).
        device: the model's device; autocast_dtype: the run's autocast dtype (None: none).
        input_size: the model's ``(H, W)``.

    Raises:
        UsageError: the scores are not finite.
    """
    import torch

    from ..adapters.captioning import model_runs_of
    from ..errors import UsageError
    from .distributed import autocast

    h, w = (int(v) for v in input_size)
    x = torch.zeros(1, 3, h, w, device=device)
    ids = torch.full((1, 1), int(adapter.end_id), dtype=torch.long, device=device)  # the first word's scores
    with torch.no_grad(), autocast(autocast_dtype), model_runs_of(adapter):  # (errors inside transformers: clear)
        scores = adapter.teacher_forced(x, ids)
    if isinstance(scores, torch.Tensor) and not bool(torch.isfinite(scores).all()):
        raise UsageError(
            f"the model's outputs (next-word scores) on a blank {h}x{w} image are not finite (NaN or inf), so its "
            "captions and maps would mean nothing: check its weights (--model)"
        )
