"""Hugging Face's packed grouped-query decoding: query heads passed to SDPA as query rows.

With grouped-query attention (H query heads sharing H_kv key/value heads), a mask, and one
query token (a decoding step), ``transformers.integrations.sdpa_attention.sdpa_attention_forward``
does not repeat the keys: it reshapes the query (B, H, 1, E) to (B, H_kv, G, E), G = H / H_kv
(``pack_gqa``), so each key head attends with its G query heads as G query *rows*, and reshapes
the output back. Read as it reaches SDPA, row ``-1`` of that call is the last query *head*,
not the last query. The capture undoes the packing in the record: q (B, H, 1, E), the mask
(B, H, 1, N_k) when it was per head, and the output gradient (see
``AttentionRecord._as_4d``), so ``probs()`` is (B, H, 1, N_k) with the right rows.

A call is packed when it is made from ``sdpa_attention_forward`` and its query rows differ
from that function's own ``q_length`` (the query length before packing).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Optional

from torch import Tensor

__all__ = ["packed_groups", "unpack_query", "unpack_mask"]

_SDPA_MODULE = "transformers.integrations.sdpa_attention"


def packed_groups(start: Optional[FrameType], stop: Optional[FrameType], query: Tensor) -> int:
    """How many query heads share each query row of this SDPA call (1: not packed).

    Args:
        start: the frame that called SDPA.
        stop: the issuing module's frame (the search for transformers' caller ends there).
        query: the query SDPA received, (B, H_kv, G, E) when packed.
    """
    module = sys.modules.get(_SDPA_MODULE)
    forward = getattr(module, "sdpa_attention_forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or query.dim() != 4 or query.shape[-2] == 1:  # (one row: nothing packed into rows)
        return 1
    frame = start
    while frame is not None and frame is not stop:
        if frame.f_code is code:
            q_length = frame.f_locals.get("q_length")
            if q_length == 1 and query.shape[-2] > 1:
                return int(query.shape[-2])
            return 1
        frame = frame.f_back
    return 1


def unpack_query(query: Tensor, groups: int) -> Tensor:
    """(B, H_kv, G, E) packed queries -> (B, H_kv * G, 1, E), head h = kv head h // G."""
    b, h_kv, _, e = query.shape
    return query.reshape(b, h_kv * groups, 1, e)


def unpack_mask(mask: Optional[Tensor], groups: int) -> Optional[Tensor]:
    """A packed per-head mask (B, H_kv, G, N_k) -> (B, H_kv * G, 1, N_k); masks shared by the
    heads (transformers leaves them as they were, (B, 1, 1, N_k)) are returned as is."""
    if mask is None or mask.dim() != 4 or mask.shape[-3] == 1 or mask.shape[-2] != groups:
        return mask
    return mask.reshape(mask.shape[0], mask.shape[1] * groups, 1, mask.shape[-1])
