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

from torch import Tensor

from ..errors import UnsupportedMethodError
from .vlm_context import VLMContext
from .vlm_encdec import decoder_relevance

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
    return decoder_relevance(ctx, (), decoder, n, cross[0].num_keys)
