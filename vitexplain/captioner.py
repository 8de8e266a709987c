"""``Explainer.explain_caption`` for captioners (an image encoder and a text decoder): image -> per-word maps.

One way through: the caption, generated greedily under ``vx.capture`` (the steps' records stitched into one
map per word) or given and teacher-forced -> per method, the records of the generation, or of one
teacher-forced forward (with gradients when the method needs them) -> the method's (B, T, gh, gw) maps ->
:class:`~vitexplain.results.CaptionExplanation` (vision-language models: :mod:`vitexplain.vlm`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .adapters.captioning import model_runs_of
from .checks import check_finite_maps, check_gradients_allowed, check_not_underflowed, model_dtype
from .errors import UsageError
from .plan import Plan, capture_settings
from .recording import capture
from .recording.graph import embeddings_in_graph
from .results import CaptionExplanation
from .sizes import run_sized
from .targets import given_token_ids

__all__ = ["explain_captioner", "caption_ids"]


def explain_captioner(adapter: Any, plan: Plan, x: Tensor, regions: Any, sources: Any, caption: Any, max_len: int,
                      attention_mode: str, boxes: Any = None) -> list[CaptionExplanation]:
    """One :class:`CaptionExplanation` per step of ``plan`` for the (B, 3, H, W) input ``x``.

    Args:
        adapter: the captioner's adapter.
        plan: the checked plan (captioner family).
        x: (B, 3, H, W) the preprocessed images; ``regions``/``sources``/``boxes``: what the model saw, where
            from, and where in the original images (their crop boxes).
        caption: None (generate up to ``max_len`` tokens) or the caption(s) to explain (see :func:`caption_ids`).
        attention_mode: the Explainer's capture mode (see ``vx.capture``).
    """
    model = adapter.model
    check_gradients_allowed([s.name for s in plan.steps if s.spec.grads], "explain_caption")
    generated = None
    positions = getattr(adapter, "max_positions", None)
    if caption is None:
        if positions is not None:  # the last word is never fed back: max_len words take max_len positions
            max_len = min(max_len, positions)
        with torch.no_grad(), capture(model) as generated, model_runs_of(adapter, generating=True):
            ids = run_sized(adapter, x, lambda: adapter.generate(x, max_len))
    else:
        ids = caption_ids(adapter, caption, x.shape[0], x.device)
    lengths = [len(w) for w in adapter.words(ids)]
    t = max(max(lengths), 1)
    ids = ids[:, :t]
    if ids.shape[1] < t:
        ids = F.pad(ids, (0, t - ids.shape[1]), value=adapter.end_id)
    tokens = [words[:t] for words in adapter.words(ids)]
    layout = adapter.layout(tuple(x.shape[-2:]))
    context = plan.family.context
    results = []
    for step in plan.steps:
        if step.spec.grads:
            settings = capture_settings([step.spec], adapter, {step.name: dict(step.options)}, attention_mode)
            x_in = x.detach().clone().requires_grad_(True)
            with torch.enable_grad(), embeddings_in_graph(model), \
                    capture(model, grads=True, attention_mode=settings.attention_mode, heads=settings.heads) as rec, \
                    model_runs_of(adapter):
                # (the caption's embeddings in the graph: frozen weights)
                logits = run_sized(adapter, x, lambda: adapter.teacher_forced(x_in, ids))
            ctx = context(adapter, x_in, ids, rec, layout, True, logits, step.name)
        elif generated is not None:
            ctx = context(adapter, x, ids, generated, layout, False, None, step.name)
        else:
            with torch.no_grad(), capture(model) as rec, model_runs_of(adapter):
                run_sized(adapter, x, lambda: adapter.teacher_forced(x, ids))
            ctx = context(adapter, x, ids, rec, layout, True, None, step.name)
        with torch.set_grad_enabled(step.spec.grads or torch.is_grad_enabled()):  # (also under the caller's no_grad)
            maps = step.spec.fn(ctx, **step.options)
        if ctx.recorder is not generated:  # this step's own capture: its attention goes now (the generated one is shared)
            ctx.recorder.clear()
        maps = check_finite_maps(maps.detach().float(), step.name)
        maps = check_not_underflowed(maps, lengths, step.name, model_dtype(model))
        for i, n in enumerate(lengths):
            maps[i, n:] = 0.0
        results.append(
            plan.family.result(
                maps=maps,
                tokens=tokens,
                ids=ids,
                captions=[" ".join(w) for w in tokens],
                method=step.name,
                options=dict(step.options),
                input_size=(int(x.shape[-2]), int(x.shape[-1])),
                layout=layout,
                images=regions,
                sources=sources,
                signed=step.spec.signed,
                boxes=boxes,
            )
        )
    return results




def caption_ids(adapter: Any, caption: Any, batch: int, device: torch.device) -> Tensor:
    """(B, T) ids of given captions (:func:`vitexplain.targets.given_token_ids`), each followed by the end token.

    A caption ends at its first end token (what follows is padding, as in ``generate``'s output). Decoders whose
    start token is also their end token (GPT-2, TrOCR) get a leading start token dropped: Hugging Face's
    ``generate`` returns it first, and the caption would otherwise be read as empty.

    Raises:
        UsageError: not one caption or one per image, an empty caption, token ids that are not in the
            vocabulary, or a caption longer than the decoder's positions.
    """
    seqs = given_token_ids(caption, batch, adapter.encode_caption, vocab=getattr(adapter, "vocab_size", None))
    _warn_leading_start(seqs, adapter.start_id, adapter.end_id)
    seqs = [_words_of(seq, adapter.start_id, adapter.end_id) for seq in seqs]
    length = max(len(s) for s in seqs) + 1
    positions = getattr(adapter, "max_positions", None)
    if positions is not None and length - 1 > positions:  # fed: the start token and all words but the last
        raise UsageError(
            f"a caption of {length - 1} tokens does not fit the decoder, which has {positions} positions; "
            f"explain at most {positions} tokens per caption"
        )
    end = adapter.end_id
    return torch.tensor([s + [end] * (length - len(s)) for s in seqs], dtype=torch.long, device=device)


def _warn_leading_start(seqs: list[list[int]], start: int, end: int) -> None:
    """Warn when a caption begins with the decoder's start token where it differs from the end token (BERT decoders,
    BLIP, GIT): that token is explained as a first word, after the start token vitexplain puts first, which is right
    for ``e.ids`` of a caption whose first word it is, and wrong for ``model.generate``'s output, which begins with
    it (its first word's map would come from a forward that saw the start token twice): the two cannot be told
    apart from the ids."""
    first = [i for i, seq in enumerate(seqs) if start != end and len(seq) > 1 and seq[0] == start]
    if first:
        warnings.warn(
            f"caption(s) {first[:5]} begin with the decoder's start token (id {start}), explained as a first word after "
            "the start token vitexplain puts before every caption; if these ids come from model.generate (which "
            "returns the start token first), pass ids[:, 1:]", stacklevel=4)


def _words_of(seq: list[int], start: int, end: int) -> list[int]:
    """``seq`` without the leading start token ``generate`` puts first, for decoders whose start token is also their
    end token (GPT-2, TrOCR): such a caption would otherwise end before its first word. (Where the two differ, a
    leading start token stays a word, shown as one: ``generate(...)[:, 1:]`` or ``e.ids`` are the words.)"""
    return seq[1:] if start == end and len(seq) > 1 and seq[0] == start else seq
