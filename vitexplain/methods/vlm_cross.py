"""``cross_generic`` for a vision-language model whose image enters through cross-attention layers.

mllama (Llama 3.2 Vision) keeps its image out of the language model's sequence: the text
positions read the vision tokens only in the cross-attention layers (keys =
``cross_attention_states``), interleaved with ordinary self-attention layers over the text. Chefer,
Gur & Wolf (ICCV 2021) give the rules for exactly this case (their encoder-decoder rules, the same
as the CAPTION family's ``cross_generic`` in :mod:`vitexplain.methods.caption`), with text tokens t
(the whole sequence: prompt and answer) and image tokens i:

- start: ``R_tt = I``, ``R_ti = 0``, ``R_ii = I`` (the vision tower's attention is not propagated:
  each vision token is mapped to its own pixels by the adapter, as for the other VLMs);
- self-attention layer: ``R_tt += Abar_tt @ R_tt`` and ``R_ti += Abar_tt @ R_ti``;
- cross-attention layer: ``R_ti += normbar(R_tt)^T @ Abar_ti @ normbar(R_ii)``
  (``normbar(I) = I``), with ``normbar(R) = rownorm(R - I) + I``;

where ``Abar = mean_h clamp(A * d log p(w_t) / dA, 0)`` for the word being explained. The map of
word t is ``R_ti[row_t, image keys]``, ``row_t`` the position that predicts it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError
from .caption import normbar
from .vlm_context import VLMContext

__all__ = ["cross_layer_relevance"]


def cross_layer_relevance(ctx: VLMContext) -> list[Tensor]:
    """Chefer's encoder-decoder relevance of each image token for each answer word.

    One backward pass per word position, batched over images; per layer O(N^2 (N + K)) for N text
    positions and K image keys (the text sequence of a cross-attention VLM holds no image tokens).

    Args:
        ctx: the teacher-forced forward with gradients, of an adapter with ``cross_layers``.

    Returns:
        Per image b, (T, n_b) float32.

    Raises:
        UnsupportedMethodError: the language model's self-attention calls were not recorded.
    """
    cross = ctx.layers()
    decoder = ctx.adapter.decoder_records(ctx.recorder.records)
    if not any(r.kind == "self" for r in decoder):
        raise UnsupportedMethodError(
            f"{ctx.method}: no self-attention call of {type(ctx.adapter.model).__name__}'s language model was "
            "recorded; load the model with attn_implementation='sdpa' (or 'eager')"
        )
    n = next(r.num_keys for r in decoder if r.kind == "self")
    k = cross[0].num_keys
    b = ctx.batch_size
    device = cross[0].device
    recorder = ctx.recorder
    out = torch.zeros(b, ctx.num_words, k, device=device)
    eye = torch.eye(n, device=device).expand(b, n, n)
    for word in range(ctx.num_words):
        recorder.zero_grad()
        recorder.backward(ctx.word_scores(word).sum(), retain_graph=True)
        r_tt = eye.clone()
        r_ti = torch.zeros(b, n, k, device=device)
        for record in decoder:
            abar = (record.probs() * record.grad_probs()).clamp(min=0).mean(dim=1)  # (B, N, N) or (B, N, K)
            if record.kind == "self":
                r_tt, r_ti = r_tt + abar @ r_tt, r_ti + abar @ r_ti
            else:
                r_ti = r_ti + normbar(r_tt).transpose(1, 2) @ abar
        out[:, word] = r_ti[:, ctx.start - 1 + word]
    recorder.zero_grad()
    return ctx.gather(out)
