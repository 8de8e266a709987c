"""Per-word maps of decoder-only vision-language models, over their image tokens.

The map of answer word t reads row ``start - 1 + t`` of the language model's attention (the row
that predicts word t) at the image-token columns (docs/methods.md, "Vision-language models"):

- ``cross``: that row's attention, fused over heads and layers (or over chosen ``(layer, head)``
  pairs: Kang et al. 2025 find a few localisation heads);
- ``cross_grad``: the gradient-weighted attention of that row, ``mean_h clamp(A * dlog p(w_t)/dA, 0)``,
  averaged over layers (the per-layer term of Chefer et al. 2021; ViCrop's gradient-weighted map);
- ``cross_generic``: Chefer, Gur & Wolf (ICCV 2021) over the whole multimodal sequence:
  ``R = I; R += Abar_l @ R`` for every layer, the map is ``R[row, image columns]`` (their
  encoder-decoder rules where the image enters through cross-attention layers: mllama).

With cross-attention layers (mllama) the "layers" are those layers and the image columns are
their keys: ``cross`` and ``cross_grad`` read the predicting row of each cross-attention call.

Every method returns, per image b, a (T, n_b) tensor of scores over its image tokens; the
adapter maps them to pixels. Batched: prompts are left-padded to one length, so every image
reads the same rows; each image keeps its own columns. Only the teacher-forced forward is read
(the default runs generation first and then teacher-forces the generated ids).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..errors import OptionError, UnsupportedMethodError
from ..recording import AttentionRecord
from ..recording.scores import fuse_heads
from .families import VLM
from .options import Option, check_index, check_indices
from .registry import register
from .vlm_context import VLMContext
from .vlm_cross import cross_layer_relevance
from .vlm_encdec import encoder_decoder_generic

__all__ = ["cross", "cross_grad", "cross_generic", "pick_layers", "check_reach", "rollout_reach"]

_LAYERS = Option(int, optional=True, sequence=True, help="language-model layers (None = all)")
_REFERENCE = "docs/methods.md 'Vision-language models'"


def pick_layers(method: str, records: Sequence[AttentionRecord], layers: Union[None, int, Sequence[int]]) -> list[AttentionRecord]:
    """The records of the chosen language-model layers (indices, negatives count from the last)."""
    if layers is None:
        return list(records)
    return [records[i] for i in check_indices(method, "layers", layers, len(records), "language-model layers")]


def check_reach(ctx: VLMContext, attention: Tensor, method: str, chosen: str, composed: bool = False) -> None:
    """Refuse maps that would be 0 everywhere because the chosen attention never reaches an image's tokens.

    Softmax weights are exactly 0 only where the mask hides a key: a sliding-window layer whose window ends after
    the image (Gemma 3, Mistral) gives the answer rows no weight on it, so a word's map over those layers alone says
    nothing about the image.

    Args:
        ctx: the teacher-forced forward.
        attention: (B, T, N) non-negative attention of the rows predicting the words (heads and layers summed or fused).
        method: the method name (for the message).
        chosen: which layers or heads were read, as the user gave them (for the message).
        composed: ``attention`` is where the layers' attention, followed from layer to layer, reaches
            (:func:`rollout_reach`), not one layer's.

    Raises:
        OptionError: ``layers=`` / ``heads=`` chose only such layers.
        UnsupportedMethodError: no layer of the language model reaches the image tokens from the answer.
    """
    for b, scores in enumerate(ctx.gather(attention)):
        dead = (scores[: int(ctx.lengths[b])].sum(dim=-1) == 0).nonzero()[:, 0].tolist()
        if not dead or scores.shape[-1] == 0:
            continue
        what = (f"{method}: the attention of {chosen}{', followed from layer to layer,' if composed else ''} gives "
                f"answer word(s) {dead} of image {b} no weight at all on its "
                f"{scores.shape[-1]} image tokens (the mask hides them, as a sliding-window layer's does once the window has "
                "passed the image; or every weight underflowed to 0), so their maps would be 0 everywhere")
        if chosen == "every language-model layer":
            raise UnsupportedMethodError(f"{what}; give a shorter prompt, so that the image lies within the window")
        raise OptionError(f"{what}; choose layers whose attention reaches the image (layers=None: all of them)")


def rollout_reach(ctx: VLMContext, records: Sequence[AttentionRecord]) -> Tensor:
    """Which tokens the rows predicting the words reach through the layers' attention, followed from the last layer
    down as ``cross_generic`` follows its relevance (``v <- v + v A_l``, heads summed) but with A_l's support only
    (weight > 0, so nothing underflows): (B, T, N) float32, 1 where reached, else 0.

    ``cross_generic``'s relevance is 0 wherever this is 0 (its ``Abar_l`` is 0 where ``A_l`` is): sliding-window
    layers only (LLaVA with a Mistral LM) whose windows, chained over the layers, end after the image give it no path
    to the image at all.
    """
    rows = ctx.rows
    reach = None
    for record in reversed(records):
        support = (record.probs().detach().sum(dim=1) > 0).float()  # (B, N, N)
        if reach is None:  # the rows themselves, then what they attend to
            reach = torch.zeros(support.shape[0], ctx.num_words, support.shape[-1], device=support.device)
            reach[:, torch.arange(ctx.num_words), torch.arange(rows.start, rows.stop)] = 1.0
        reach = ((reach + torch.bmm(reach, support)) > 0).float()
    return reach


def _head_pairs(records: Sequence[AttentionRecord], heads: Sequence[tuple]) -> dict[int, list[int]]:
    """``[(layer, head), ...]`` checked against the model, grouped by layer."""
    grouped: dict[int, list[int]] = {}
    for pair in heads:
        if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
            raise OptionError(f"cross option 'heads' takes (layer, head) pairs of integers, got {pair!r}")
        layer = check_index("cross", "heads", pair[0], len(records), "language-model layers")
        head = check_index("cross", "heads", pair[1], records[layer].num_heads, f"heads in layer {layer}")
        if head in grouped.get(layer, []):  # the pairs are averaged: one given twice would count double
            raise OptionError(f"cross option 'heads' names the head {(layer, head)} more than once (got "
                              f"{list(heads)!r}; negative indices count from the last); list each pair once")
        grouped.setdefault(layer, []).append(head)
    return grouped


@register(
    "cross", VLM,
    options={
        "layers": _LAYERS,
        "heads": Option(tuple, optional=True, sequence=True,
                        help="(layer, head) pairs to average instead of all heads (None = fuse heads and layers)"),
        "head_fusion": Option(str, choices=("mean", "max", "min"), help="how heads are fused"),
    },
    requires=("image_attention",), class_sensitive=False,
    summary="attention of the row predicting each word over the image tokens (heads and layers fused)",
    reference=_REFERENCE,
)
def cross(ctx: VLMContext, *, layers: Union[None, int, Sequence[int]] = None,
          heads: Optional[Sequence[tuple]] = None, head_fusion: str = "mean") -> list[Tensor]:
    """Attention of the predicting rows over the image tokens.

    Args:
        ctx: the teacher-forced forward.
        layers: language-model layers to average (None = all); not with ``heads``.
        heads: ``[(layer, head), ...]``: average exactly these heads, each pair once (e.g. localisation
            heads); ``layers`` and a ``head_fusion`` other than the mean do not apply with it (OptionError).
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.

    Returns:
        Per image b, (T, n_b) float32.
    """
    records = ctx.layers()
    if heads is not None:
        given = (("layers", layers is not None), ("head_fusion", head_fusion != "mean"))
        unused = [name for name, set_ in given if set_]
        if unused:  # heads= is the exact set of heads averaged: an option that would be ignored is refused
            raise OptionError(f"cross option 'heads' averages exactly the (layer, head) pairs given, so {unused} do "
                              "not apply with it; pass heads= alone, or layers= / head_fusion= without heads=")
        total, count = None, 0
        for layer, chosen in _head_pairs(records, heads).items():
            probs = records[layer].probs(queries=ctx.rows)[:, chosen]  # (B, h, T, N)
            part = probs.sum(dim=1)
            total = part if total is None else total + part
            count += len(chosen)
        check_reach(ctx, total, "cross", f"heads={list(heads)!r}")
        return ctx.gather(total / count)
    chosen_records = pick_layers("cross", records, layers)
    fused = sum(fuse_heads(r.probs(queries=ctx.rows), head_fusion) for r in chosen_records)
    check_reach(ctx, fused, "cross", "every language-model layer" if layers is None else f"layers={layers!r}")
    return ctx.gather(fused / len(chosen_records))


@register(
    "cross_grad", VLM,
    options={"layers": _LAYERS},
    grads=True, requires=("image_attention",), class_sensitive=False,
    summary="gradient-weighted attention of the row predicting each word (gradient of its log-probability)",
    reference="Chefer et al. 2021 (per-layer term); Zhang et al. 2025 (ViCrop); " + _REFERENCE,
)
def cross_grad(ctx: VLMContext, *, layers: Union[None, int, Sequence[int]] = None) -> list[Tensor]:
    """``mean_l mean_h clamp(A_l * d log p(w_t) / dA_l, 0)`` at the row predicting word t.

    One backward pass per word position, batched over images.

    Args:
        ctx: the teacher-forced forward, with gradients.
        layers: language-model layers to average (None = all).

    Returns:
        Per image b, (T, n_b) float32.
    """
    chosen = pick_layers("cross_grad", ctx.layers(), layers)
    rows = ctx.rows
    probs = [r.probs(queries=rows) for r in chosen]  # (B, H, T, N) each
    check_reach(ctx, sum(a.sum(dim=1) for a in probs), "cross_grad",
                "every language-model layer" if layers is None else f"layers={layers!r}")
    out = torch.zeros(ctx.batch_size, ctx.num_words, probs[0].shape[-1], device=probs[0].device)
    recorder = ctx.recorder
    for word in range(ctx.num_words):
        recorder.zero_grad()
        recorder.backward(ctx.word_scores(word).sum(), retain_graph=True)
        row = ctx.start - 1 + word
        for record, a in zip(chosen, probs):
            grad = record.grad_probs(queries=row)  # (B, H, 1, N)
            out[:, word] += (a[:, :, word : word + 1] * grad).clamp(min=0).mean(dim=1)[:, 0]
    recorder.zero_grad()
    return ctx.gather(out / len(chosen))


@register(
    "cross_generic", VLM,
    grads=True, requires=("image_attention", "rollout"), class_sensitive=False, dense_attention=True,
    summary="Chefer's relevance over the whole multimodal sequence, per word (gradient of its log-probability)",
    reference="Chefer, Gur & Wolf, ICCV 2021 (self-attention rules; encoder-decoder rules for cross-attention layers); "
              + _REFERENCE,
)
def cross_generic(ctx: VLMContext) -> list[Tensor]:
    """Chefer et al. (2021) relevance of the image tokens for each answer word.

    With ``Abar_l = mean_h clamp(A_l * d log p(w_t) / dA_l, 0)`` for every language-model layer,
    ``R = (I + Abar_L) ... (I + Abar_1)`` (the rule ``R += Abar_l @ R`` from ``R = I``), and the
    map is ``R[row_t, image columns]``. Only that row is needed, so it is propagated as a row
    vector from the last layer down (``v <- v + v @ Abar_l``): O(L N^2) per word, never N^3.
    The vision tower's own attention is not propagated: each image token is mapped to its
    pixels by the adapter. A model whose image enters through cross-attention layers (mllama)
    takes Chefer's encoder-decoder rules instead (:mod:`~vitexplain.methods.vlm_cross`).

    Returns:
        Per image b, (T, n_b) float32.
    """
    if getattr(ctx.adapter, "encoder_decoder", False):  # Florence-2, Pix2Struct: Chefer's encoder-decoder rules
        return encoder_decoder_generic(ctx)
    if ctx.cross_layers:  # mllama: the image only through cross-attention layers
        return cross_layer_relevance(ctx)
    records = ctx.layers()
    check_reach(ctx, rollout_reach(ctx, records), "cross_generic", "every language-model layer", composed=True)
    recorder = ctx.recorder
    b, n = ctx.batch_size, records[0].num_keys
    out = torch.zeros(b, ctx.num_words, n, device=records[0].device)
    for word in range(ctx.num_words):
        recorder.zero_grad()
        recorder.backward(ctx.word_scores(word).sum(), retain_graph=True)
        v = torch.zeros(b, 1, n, device=out.device)
        v[:, 0, ctx.start - 1 + word] = 1.0
        for record in reversed(records):
            abar = (record.probs() * record.grad_probs()).clamp(min=0).mean(dim=1)  # (B, N, N)
            v = v + torch.bmm(v, abar)
        out[:, word] = v[:, 0]
    recorder.zero_grad()
    return ctx.gather(out)
