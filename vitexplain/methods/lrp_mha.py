"""``nn.MultiheadAttention``'s functional forward as projections + SDPA, for the LRP rules.

:class:`~vitexplain.methods.lrp_rules.LRPRules` sees ``F.multi_head_attention_forward`` as one
call (torch function modes do not see the calls made inside a handled call), so the attention
rule could not reach its inner SDPA. This computes the same thing torch does (its
``need_weights=False`` path: in-projection, SDPA, out-projection) with the rule applied at SDPA.
What it does not handle (``bias_k``/``bias_v``, ``add_zero_attn``, ``static_k``/``static_v``)
raises instead of being approximated.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UnsupportedModelError

__all__ = ["multi_head_attention"]


def _float_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A bool mask (True = not allowed, MHA's convention) as an additive float mask."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def multi_head_attention(
    rules: Any, *, query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
    in_proj_weight: Optional[Tensor], in_proj_bias: Optional[Tensor], bias_k: Optional[Tensor],
    bias_v: Optional[Tensor], add_zero_attn: bool, dropout_p: float, out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor], training: bool = True, key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True, attn_mask: Optional[Tensor] = None, use_separate_proj_weight: bool = False,
    q_proj_weight: Optional[Tensor] = None, k_proj_weight: Optional[Tensor] = None,
    v_proj_weight: Optional[Tensor] = None, static_k: Optional[Tensor] = None, static_v: Optional[Tensor] = None,
    average_attn_weights: bool = True, is_causal: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``F.multi_head_attention_forward`` with the LRP rule at its SDPA call (``rules._qkv``).

    Args:
        rules: the active :class:`~vitexplain.methods.lrp_rules.LRPRules`.
        query, key, value: (L, N, E), (S, N, E), (S, N, E) (sequence first, as torch passes them),
            or unbatched (L, E), (S, E).
        **rest: ``F.multi_head_attention_forward``'s other arguments.

    Returns:
        (attention output (L, N, E), the attention weights (N, L, S), head-averaged when
        ``average_attn_weights``, detached, or None when ``need_weights`` is False).

    Raises:
        UnsupportedModelError: ``bias_k``/``bias_v``, ``add_zero_attn`` or static keys/values.
    """
    if bias_k is not None or bias_v is not None or add_zero_attn or static_k is not None or static_v is not None:
        raise UnsupportedModelError(
            "the LRP methods compute nn.MultiheadAttention as projections + scaled_dot_product_attention and do not "
            "support bias_k/bias_v, add_zero_attn or static keys/values; use 'generic' or 'integrated_gradients'"
        )
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    length, batch, embed = query.shape
    source = key.shape[0]
    head_dim = embed // num_heads
    if use_separate_proj_weight:
        b_q, b_k, b_v = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = rules.linear(query, q_proj_weight, b_q), rules.linear(key, k_proj_weight, b_k), rules.linear(value, v_proj_weight, b_v)
    elif query is key and key is value:
        q, k, v = rules.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    else:
        w_q, w_k, w_v = in_proj_weight.chunk(3)
        b_q, b_k, b_v = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = rules.linear(query, w_q, b_q), rules.linear(key, w_k, b_k), rules.linear(value, w_v, b_v)

    def heads(t: Tensor, n: int) -> Tensor:  # (n, N, E) -> (N, H, n, hd)
        return t.reshape(n, batch * num_heads, head_dim).transpose(0, 1).reshape(batch, num_heads, n, head_dim)

    q, k, v = heads(q, length), heads(k, source), heads(v, source)
    mask = _float_mask(attn_mask, q.dtype)
    if mask is not None and mask.dim() == 3:  # (N * H, L, S)
        mask = mask.view(batch, num_heads, length, source)
    if key_padding_mask is not None:
        padding = _float_mask(key_padding_mask, q.dtype).view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    causal = bool(is_causal) and mask is None
    weights = None
    if need_weights:  # for the caller only: detached, outside the relevance's path
        with torch.no_grad():
            scores = q @ k.transpose(-2, -1) / head_dim ** 0.5
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            weights = weights.mean(dim=1) if average_attn_weights else weights
            weights = weights.squeeze(0) if unbatched else weights
    q, k, v = rules._qkv(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0, is_causal=causal)
    out = out.permute(2, 0, 1, 3).reshape(length * batch, embed)
    out = rules.linear(out, out_proj_weight, out_proj_bias).view(length, batch, embed)
    return (out.squeeze(1) if unbatched else out), weights
