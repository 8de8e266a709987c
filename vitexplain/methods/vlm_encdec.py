"""``cross_generic`` of encoder-decoder vision-language models (Florence-2, Pix2Struct).

Chefer, Gur & Wolf (ICCV 2021) encoder-decoder rules, as for the captioners
(:func:`vitexplain.methods.caption.cross_generic`, docs/methods.md), with the gradient of each answer
word's log-probability. Encoder tokens e (Florence-2: image tokens and prompt tokens in one
sequence; Pix2Struct: the patches), decoder tokens d (the prefix and the answer):

- ``R_ee = I``; every encoder self-attention layer: ``R_ee += Abar @ R_ee``. The whole encoder
  sequence is propagated, so what the prompt tokens took from the image tokens (and back) is kept;
  only at the end are the image columns read;
- ``R_dd = I``, ``R_de = 0``; decoder self-attention: ``R_dd += Abar @ R_dd``, ``R_de += Abar @ R_de``;
  decoder cross-attention: ``R_de += normbar(R_dd)^T @ Abar @ normbar(R_ee)``;
- the map of word t is ``R_de[row_t, image columns]`` (row ``L - 1 + t``).

Padding: masked keys get zero attention, so a padded prompt token (Florence-2's encoder) or prefix
token (Pix2Struct's decoder, left-padded) adds nothing to a real token's row.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError
from .caption import normbar
from .vlm_context import VLMContext

__all__ = ["encoder_decoder_generic", "decoder_relevance"]


def _abar(record) -> Tensor:
    """``mean_h clamp(A * dy/dA, 0)`` of one call: (B, N_q, N_k)."""
    return (record.probs() * record.grad_probs()).clamp(min=0).mean(dim=1)


def encoder_decoder_generic(ctx: VLMContext) -> list[Tensor]:
    """Chefer's encoder-decoder relevance of the image tokens for each answer word.

    Returns:
        Per image b, (T, n_b) float32.

    Raises:
        UnsupportedMethodError: no encoder or decoder attention was recorded, or the decoder was not
            run teacher-forced in one call per layer.
    """
    adapter, recorder = ctx.adapter, ctx.recorder
    encoder = adapter.encoder_records(recorder.records)
    decoder = adapter.decoder_records(recorder.records)
    ctx.layers()  # checks that the decoder's cross-attention covers every explained row
    if not encoder or not decoder:
        raise UnsupportedMethodError(
            f"{ctx.method}: no self-attention of {type(adapter.model).__name__}'s encoder or decoder was recorded; "
            "load the model with attn_implementation='sdpa' (or 'eager')")
    n_d = decoder[0].num_queries
    if any(r.num_queries != n_d for r in decoder):
        raise UnsupportedMethodError(f"{ctx.method}: the decoder was not run teacher-forced in one call per layer")
    return decoder_relevance(ctx, encoder, decoder, n_d, encoder[0].num_keys)


def decoder_relevance(ctx: VLMContext, encoder: Sequence[Any], decoder: Sequence[Any], n_d: int, k: int) -> list[Tensor]:
    """The rules above for every answer word: one backward per word position, batched over images.

    Args:
        ctx: the teacher-forced forward with gradients.
        encoder: the encoder's self-attention calls, in order; none when the keys of the decoder's
            cross-attention are not propagated (``R_ee = I``: mllama's vision tokens, each mapped to its
            pixels by the adapter).
        decoder: the decoder's self- and cross-attention calls, in call order.
        n_d: decoder positions; k: keys of the cross-attention (encoder tokens).

    Returns:
        Per image b, (T, n_b) float32: ``R_de[row_t, image columns]``.
    """
    recorder, b = ctx.recorder, ctx.batch_size
    device = decoder[0].device
    out = torch.zeros(b, ctx.num_words, k, device=device)
    for word in range(ctx.num_words):
        recorder.zero_grad()
        recorder.backward(ctx.word_scores(word).sum(), retain_graph=True)
        r_ee = None
        if encoder:
            r_ee = torch.eye(k, device=device).expand(b, k, k).clone()
            for record in encoder:
                r_ee = r_ee + _abar(record) @ r_ee
            r_ee = normbar(r_ee)
        r_dd = torch.eye(n_d, device=device).expand(b, n_d, n_d).clone()
        r_de = torch.zeros(b, n_d, k, device=device)
        for record in decoder:
            abar = _abar(record)
            if record.kind == "cross":
                gained = normbar(r_dd).transpose(1, 2) @ abar
                r_de = r_de + (gained if r_ee is None else gained @ r_ee)
            else:
                r_dd, r_de = r_dd + abar @ r_dd, r_de + abar @ r_de
        out[:, word] = r_de[:, ctx.start - 1 + word]
    recorder.zero_grad()
    return ctx.gather(out)
