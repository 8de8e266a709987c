"""Accuracy of zoo models on fresh synthetic shapes images, and the metrics a trained checkpoint records.

Seed convention: training uses seeds ``< 9_000``, validation during training seed ``9_000``,
evaluation (tests, benchmarks, the numbers in the configs) seeds ``>= 10_000``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..data.synthetic import shapes
from .recipes import RunOptions

__all__ = ["EVAL_SEED", "VAL_SEED", "evaluate", "is_captioner", "final_metrics", "format_metrics"]

#: First seed reserved for evaluation; training never uses seeds >= 9_000.
EVAL_SEED = 10_000
#: Seed of the validation images printed during training.
VAL_SEED = 9_000


def is_captioner(model: nn.Module) -> bool:
    """True for the zoo captioner (it has ``generate`` and a ``vocab``)."""
    return hasattr(model, "generate") and hasattr(model, "vocab")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    n: int = 1000,
    seed: int = EVAL_SEED,
    batch_size: int = 250,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Score a zoo model on ``n`` fresh shapes images.

    Args:
        model: a zoo classifier ((B, 3, 64, 64) -> (B, 5) logits) or the captioner.
        n: number of images.
        seed: image stream (use ``>= EVAL_SEED`` for numbers you report).
        batch_size: images per forward pass.
        device: defaults to the model's device.

    Returns:
        Classifiers: ``{"n", "label_acc", "exact_acc"}`` (a label is predicted when its logit > 0;
        ``exact_acc`` needs the whole label set right). Captioner: ``{"n", "caption_acc",
        "word_acc"}`` (exact caption match; fraction of reference words reproduced in place).
    """
    if getattr(model, "vx_processor", None) is not None:  # shapes-vlm: prompt + generate through its processor
        from .vlm import caption_accuracy

        return caption_accuracy(model, model.vx_processor, n, seed)
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    try:
        correct_labels = correct_sets = correct_caps = words_ok = words_all = 0
        for s in range(0, n, batch_size):
            batch = shapes(min(batch_size, n - s), seed=seed, start=s)
            x = batch.tensor.to(device)
            if is_captioner(model):
                _, caps = model.generate(x)
                for ref, hyp in zip(batch.captions, caps):
                    correct_caps += int(ref == hyp)
                    r, h = ref.split(), hyp.split()
                    words_ok += sum(int(a == b) for a, b in zip(r, h))
                    words_all += len(r)
            else:
                pred = (model(x) > 0).float().cpu()
                ok = pred == batch.labels
                correct_labels += int(ok.sum())
                correct_sets += int(ok.all(dim=1).sum())
        if is_captioner(model):
            return {"n": n, "caption_acc": correct_caps / n, "word_acc": words_ok / max(words_all, 1)}
        num_labels = batch.labels.shape[1]
        return {"n": n, "label_acc": correct_labels / (n * num_labels), "exact_acc": correct_sets / n}
    finally:
        model.train(was_training)


def format_metrics(metrics: dict[str, Any]) -> str:
    """A metrics dict on one line for the training log: ``k=v`` pairs, floats to four decimals."""
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def final_metrics(name: str, model: nn.Module, run: RunOptions) -> dict[str, Any]:
    """The metrics a trained checkpoint records (``config["metrics"]``), each logged as it is computed.

    Args:
        name: the zoo model's name (for the log).
        model: the trained model.
        run: ``val_images`` (seed :data:`VAL_SEED`) and ``final_eval_images`` (seed :data:`EVAL_SEED`): how many
            images each evaluation scores (0: skipped); ``log``.

    Returns:
        ``{"val": {"seed", ...}, "eval": {"seed", ...}}`` (:func:`evaluate`'s scores), without those skipped.
    """
    metrics: dict[str, Any] = {}
    if run.val_images:
        metrics["val"] = {"seed": VAL_SEED, **evaluate(model, run.val_images, VAL_SEED)}
        run.log(f"[{name}] val (seed {VAL_SEED}): {format_metrics(metrics['val'])}")
    if run.final_eval_images:
        metrics["eval"] = {"seed": EVAL_SEED, **evaluate(model, run.final_eval_images, EVAL_SEED)}
        run.log(f"[{name}] held-out (seed {EVAL_SEED}): {format_metrics(metrics['eval'])}")
    return metrics
