"""Per-word maps of captioners: cross-attention and Chefer's encoder-decoder relevance.

``cross``: for generated word t, the cross-attention of text query t over the image keys,
fused over heads and over decoder layers (or per layer), as in Show, Attend and Tell. With a
KV cache each decoding step issues one query; the steps are stitched into a (T, N_image) map.

``cross_generic``: Chefer, Gur & Wolf (ICCV 2021) rules for encoder-decoder attention, with the
gradient of each word's log-probability in turn (docs/methods.md, `cross_generic`).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from ..recording import AttentionRecord
from ..recording.scores import fuse_heads
from ..errors import UnsupportedMethodError
from .context import CaptionContext
from .options import Option, check_indices
from .families import CAPTION
from .registry import register

__all__ = ["cross", "cross_generic", "stitch_cross", "normbar"]


def _layers(cross: list[AttentionRecord], layers: Union[None, int, Sequence[int]]) -> list[str]:
    names = list(dict.fromkeys(r.name for r in cross))
    if layers is None:
        return names
    return [names[i] for i in check_indices("cross", "layers", layers, len(names), "decoder cross-attention layers")]


def stitch_cross(
    records: Sequence[AttentionRecord], num_words: int, head_fusion: str = "mean", *, teacher_forced: bool = False
) -> Tensor:
    """Cross-attention rows of one layer, one row per explained word.

    Teacher-forced: one call whose query row t predicts word t, or (a recurrent decoder that
    attends once per step, e.g. Show, Attend and Tell) one call per step. Generation: one call
    per decoding step (one query with a KV cache, the whole prefix without); the last query
    row of step s predicts word s (the first step may hold a longer prompt).

    Args:
        records: one layer's cross-attention records in call order.
        num_words: T, the number of explained words.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.
        teacher_forced: the records come from one teacher-forced forward.

    Returns:
        (B, T, N_image) float32.
    """
    _check_query_rows(records, num_words, teacher_forced)
    if teacher_forced and len(records) == 1:
        stitched = fuse_heads(records[0].probs(), head_fusion)
    else:
        stitched = torch.cat([fuse_heads(r.probs(queries=-1), head_fusion) for r in records], dim=1)  # type: ignore[arg-type]
    if stitched.shape[1] < num_words:
        raise UnsupportedMethodError(
            f"the cross-attention calls cover {stitched.shape[1]} query positions, but {num_words} words "
            "are explained; the decoder must issue one cross-attention call per step"
        )
    return stitched[:, :num_words]


def _check_query_rows(records: Sequence[AttentionRecord], num_words: int, teacher_forced: bool) -> None:
    """Refuse cross-attention calls whose query rows are not one per word (teacher-forced) or one per step (a KV
    cache) / the growing prefix (none): a decoder that runs several query streams through its cross-attention
    (ProphetNet's n-gram predicting streams, rows [main, stream 1, ...]) would have another stream's row read as the
    word's.

    Raises:
        UnsupportedMethodError: the rows are not laid out so.
    """
    counts = [int(r.num_queries) for r in records]
    if teacher_forced and len(records) == 1:
        bad = counts[0] != num_words
    else:
        bad = any(n not in (1, before + 1) for before, n in zip(counts, counts[1:]))
    if bad:
        name = getattr(records[0], "name", "?")
        raise UnsupportedMethodError(
            f"the decoder cross-attention {name!r} issued {counts[:8]} query rows in its "
            f"{'teacher-forced call' if teacher_forced and len(records) == 1 else 'decoding steps'} for {num_words} "
            "words, not one row per word (or per step): the decoder runs its cross-attention over more than the "
            "caption's tokens (several query streams, as ProphetNet's n-gram decoder does), so the row of each word "
            "is not known; vitexplain explains decoders with one query stream (GPT-2, BERT, BART, TrOCR, ...)")


def _check_cross(ctx: CaptionContext) -> list[AttentionRecord]:
    cross = ctx.adapter.cross_records(ctx.recorder.records)
    if not cross:
        raise UnsupportedMethodError(
            f"no cross-attention was seen in {type(ctx.adapter.model).__name__}'s decoder; a cross-attention "
            "module must have is_cross_attention=True or receive the image tokens as "
            "encoder_hidden_states / memory / key_value_states"
        )
    for record in cross:
        ctx.layout.check(record.num_keys)
    return cross


@register(
    "cross", CAPTION,
    requires=("cross", "word_queries"),
    options={
        "layers": Option(int, optional=True, sequence=True, help="decoder layers (None = mean over all)"),
        "head_fusion": Option(str, choices=("mean", "max", "min"), help="how heads are fused"),
    },
    class_sensitive=False,
    summary="per-word cross-attention of the decoder over the image patches (heads and layers fused)",
    reference="Xu et al. 2015 (Show, Attend and Tell); docs/methods.md 'Captioners'",
)
def cross(ctx: CaptionContext, *, layers: Union[None, int, Sequence[int]] = None, head_fusion: str = "mean") -> Tensor:
    """Cross-attention maps per word.

    Args:
        ctx: the captured generation or teacher-forced forward.
        layers: decoder cross-attention layer(s) to average (indices), None = all.
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.

    Returns:
        (B, T, gh, gw) float32.
    """
    records = _check_cross(ctx)
    t = ctx.ids.shape[1]
    maps = []
    for name in _layers(records, layers):
        layer = [r for r in records if r.name == name]
        maps.append(stitch_cross(layer, t, head_fusion, teacher_forced=ctx.teacher_forced))
    fused = torch.stack(maps).mean(dim=0)
    return ctx.layout.to_grid(fused)


def normbar(r: Tensor) -> Tensor:
    """Chefer's normalisation ``rownorm(R - I) + I``; rows of R - I that are all zero stay zero.

    Args:
        r: (B, n, n) relevance.

    Returns:
        (B, n, n).
    """
    eye = torch.eye(r.shape[-1], device=r.device, dtype=r.dtype)
    off = r - eye
    sums = off.sum(dim=-1, keepdim=True)
    safe = torch.where(sums == 0, torch.ones_like(sums), sums)
    return torch.where(sums == 0, torch.zeros_like(off), off / safe) + eye


def _abar(record: AttentionRecord) -> Tensor:
    """``mean_h(clamp(dy/dA * A, 0))`` of one call: (B, N_q, N_k)."""
    return (record.grad_probs() * record.probs()).clamp(min=0).mean(dim=1)


def _abar_per_module(records: Sequence[AttentionRecord], num_words: int) -> list[tuple[str, Tensor]]:
    """``Abar`` of each decoder attention module, in order of first call: (kind, (B, T, N_k)).

    A module called once (a transformer decoder under teacher forcing) gives its rows as they
    are; a module called once per step with one query (a recurrent decoder) gives its steps
    stacked as rows, so that row t is the attention of the step that predicts word t.
    """
    grouped: dict[str, list[AttentionRecord]] = {}
    for record in records:
        grouped.setdefault(record.name, []).append(record)
    out = []
    for name, calls in grouped.items():
        if (len(calls) == 1 and calls[0].num_queries != num_words) or (len(calls) > 1 and (
                len(calls) < num_words or any(r.num_queries != 1 for r in calls))):
            raise UnsupportedMethodError(
                f"the decoder attention {name!r} was called {len(calls)} times with "
                f"{[r.num_queries for r in calls]} queries for {num_words} words; cross_generic needs one "
                "teacher-forced call with a query per word, or one call per word with one query"
            )
        abar = torch.cat([_abar(r) for r in calls], dim=1)
        out.append((calls[0].kind, abar[:, :num_words]))
    return out


def _joint_relevance(decoder: Sequence[AttentionRecord], r_ii: Tensor, t: int) -> Tensor:
    """Chefer's self-attention rule on a joint [image, text] decoder (GIT), (B, t, N_image).

    The relevance of each decoder token over the image patches starts as ``R_ii`` for the
    image tokens (they are the vision encoder's outputs) and 0 for the text tokens; each
    decoder layer applies ``S <- S + Abar @ S``. Word t's map is the row of its text position.
    """
    b, n_img = r_ii.shape[0], r_ii.shape[1]
    s = torch.zeros(b, decoder[0].num_keys, n_img, device=r_ii.device)
    s[:, :n_img] = r_ii
    for record in decoder:
        s = s + _abar(record) @ s
    return s[:, -t:]


@register(
    "cross_generic", CAPTION,
    grads=True,
    requires=("encoder_attention", "word_queries"),
    summary="Chefer encoder-decoder relevance per word (gradient of each word's log-probability)",
    reference="Chefer, Gur & Wolf, ICCV 2021 (encoder-decoder rules); docs/methods.md",
    dense_attention=True,
)
def cross_generic(ctx: CaptionContext) -> Tensor:
    """Chefer et al. (2021) relevance of the image patches for each word.

    For word t the score is its log-probability under teacher forcing. Image tokens i,
    text tokens t: ``R_ii`` from the encoder's self-attention (``R = I``,
    ``R += Abar @ R``); ``R_tt = I``, ``R_ti = 0``; decoder self-attention:
    ``R_tt += Abar_tt @ R_tt``, ``R_ti += Abar_tt @ R_ti``; decoder cross-attention:
    ``R_ti += normbar(R_tt)^T @ Abar_ti @ normbar(R_ii)``. The map of word t is
    ``R_ti[t, patches]``. One backward pass per word position, batched over images. A joint
    decoder (GIT: one self-attention over [image, text]) uses the self-attention rule on the
    whole sequence, starting from ``R_ii`` for the image tokens (:func:`_joint_relevance`).

    A recurrent decoder that attends once per step (Show, Attend and Tell) has no decoder
    self-attention: its steps' attention rows are stacked into one cross-attention matrix, and
    with ``R_tt = I`` (and ``R_ii = I`` for a CNN encoder) the map of word t is its own step's
    gradient-weighted attention ``clamp(A_t * d log p(w_t) / dA_t, 0)``. What the LSTM state
    carries from earlier steps is not attention and is not propagated by these rules.

    Returns:
        (B, T, gh, gw) float32.
    """
    if ctx.logits is None:
        raise UnsupportedMethodError("cross_generic needs a teacher-forced forward with gradients")
    records = ctx.recorder.records
    encoder = ctx.adapter.encoder_records(records)
    decoder = ctx.adapter.decoder_records(records)
    _check_cross(ctx)
    b, t = ctx.ids.shape
    n_img = ctx.layout.num_tokens
    device = ctx.logits.device
    log_probs = torch.log_softmax(ctx.logits.float(), dim=-1)
    out = torch.zeros(b, t, n_img, device=device)
    for word in range(t):
        ctx.recorder.zero_grad()
        score = log_probs[:, word].gather(1, ctx.ids[:, word : word + 1])
        ctx.recorder.backward(score, retain_graph=True)
        r_ii = torch.eye(n_img, device=device).expand(b, n_img, n_img).clone()
        for record in encoder:
            r_ii = r_ii + _abar(record) @ r_ii
        if ctx.adapter.joint:
            out[:, word] = _joint_relevance(decoder, r_ii, t)[:, word]
            continue
        r_tt = torch.eye(t, device=device).expand(b, t, t).clone()
        r_ti = torch.zeros(b, t, n_img, device=device)
        for kind, abar in _abar_per_module(decoder, t):
            if kind == "self":
                r_tt, r_ti = r_tt + abar @ r_tt, r_ti + abar @ r_ti
            else:
                r_ti = r_ti + normbar(r_tt).transpose(1, 2) @ abar @ normbar(r_ii)
        out[:, word] = r_ti[:, word]
    ctx.recorder.zero_grad()
    return ctx.layout.to_grid(out)
