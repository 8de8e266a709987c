"""Records that keep a call's probabilities, computed at the call, instead of its queries and keys.

A record of a fused SDPA call keeps q and k by reference and computes the probabilities when it is read
(:mod:`.records`): free for a vision transformer, whose keys are tensors of its own forward. A decoding step of a
language model is the opposite case, one query row (or a few) against a KV cache:

- a dynamic cache grows by concatenation, so each step's keys are a new (B, H_kv, N_k, E) tensor that only the
  step's record keeps alive once the cache has moved on: T steps keep about T x N_k key rows per layer, where the
  cache itself holds N_k, and where the steps' probabilities, (B, H, 1, N_k) each, take E H_kv / H times fewer
  bytes (float32 probabilities against the keys' own dtype);
- a static or sliding-window cache is written in place: its keys had to be summed at the call (their witness, a
  pass over them), and a record whose attended keys a later step overwrote (a sliding window) could only refuse.

Such a call's record computes its probabilities at the call, with the function a record reads them with
(:func:`~vitexplain.recording.scores.attention_probs`: the same masks, scale, causal flag and grouped-query heads),
and keeps them instead of q, k and the mask, when no gradient is recorded, the probabilities take fewer bytes than
the keys, and the keys are either large (at least :data:`KEYS_BYTES`) or were written in place before the call.
Smaller fresh keys stay kept by reference (nothing computed in the model's loop: a small model's decoding step is
short).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from .scores import attention_probs, fuse_heads

__all__ = ["KEYS_BYTES", "keeps_probs", "with_probs"]

#: A decoding call whose keys take at least this many bytes keeps its probabilities instead of them (when those are
#: fewer bytes). A keys tensor this large is one of a model whose decoding step costs far more than the pass over
#: the keys that computing the probabilities takes.
KEYS_BYTES = 2**20

#: What a record made by :func:`with_probs` no longer keeps (the tensors and what it noted of them to tell a write).
_DROPPED = ("_q", "_k", "_mask", "_q_version", "_q_sums", "_k_version", "_k_sums", "_mask_version")


def keeps_probs(q: Tensor, k: Tensor, written: bool) -> bool:
    """Whether a call on these queries and keys keeps its probabilities (see the module docstring).

    Args:
        q: (B, H, N_q, E) or (B, N_q, E) queries (as the record keeps them).
        k: (B, H_kv, N_k, E) or (B, N_k, E) keys.
        written: the keys had been written in place before the call (a static or sliding-window cache).
    """
    keys = k.numel() * k.element_size()
    heads = q.shape[-3] if q.dim() >= 4 else 1
    probs = q.shape[0] * heads * q.shape[-2] * k.shape[-2] * 4
    return probs < keys and (written or keys >= KEYS_BYTES)


def with_probs(fields: dict[str, Any], heads: str = "all") -> Optional[dict[str, Any]]:
    """The fields of a record that keeps the call's probabilities instead of its tensors, or None when
    :func:`keeps_probs` says the record keeps q and k.

    Args:
        fields: a no-gradient SDPA record's fields as the capture makes them (``_q``, ``_k``, ``_mask``,
            ``_scale``, ``_causal`` and what it noted of them: ``_k_version`` not 0 when the keys had been
            written in place before the call).
        heads: the capture's ``heads``: ``"all"``, or the head fusion that is all such a record keeps (as a
            materialized record does, ``vx.capture(..., heads=...)``).

    Returns:
        the same fields without q, k, the mask and their witnesses, with ``_probs`` (B, H, N_q, N_k) float32, or
        (B, N_q, N_k) fused over heads, ``heads`` and ``_masked`` (whether the call had a mask); or None.
    """
    q, k = fields.get("_q"), fields.get("_k")
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or not keeps_probs(q, k, fields.get("_k_version", 0) != 0):
        return None
    mask = fields.get("_mask")
    with torch.no_grad():
        probs = attention_probs(q, k, attn_mask=mask, scale=fields.get("_scale"), is_causal=fields.get("_causal", False))
    if probs.dim() == 3:  # an SDPA call on (B, N, E) has one head: (B, 1, N_q, N_k), as records give them
        probs = probs.unsqueeze(1)
    elif heads != "all" and probs.shape[1] > 1:  # (one head: every fusion is that head, kept as "all")
        probs = fuse_heads(probs, heads)  # type: ignore[arg-type]
    else:
        heads = "all"
    kept = {name: value for name, value in fields.items() if name not in _DROPPED}
    kept.update(_probs=probs, heads=heads, _masked=mask is not None or bool(fields.get("_masked", False)))
    return kept
