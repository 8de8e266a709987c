"""What a record notes of the tensors it keeps by reference, to tell when it is read whether they were written in
place since the call.

Records keep the call's own tensors (q, k, v, mask, the weights a model returned), no copies. A tensor's
``_version`` counts its in-place writes (one counter shared by every view of the same storage): noted at the call,
compared when the record is read, it costs nothing on the hot path. Where the version alone cannot tell (a tensor
already written before the call may be written again with the same values; an inference tensor keeps no count),
sums along one dimension are noted as well (:func:`noted`, :func:`written_since`).

A FlexAttention record also notes what its ``score_mod`` and ``mask_mod`` read (tensors with their versions, and
the names they read: :mod:`vitexplain.recording.mod_witness`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import Tensor

__all__ = ["changed_tensor", "noted", "written_since", "tensor_version", "block_tensors",
           "tensor_versions", "query_witness", "value_witness", "weights_witness", "kept_mask", "held", "key_witness"]

def tensor_version(t: Optional[Tensor]) -> int:
    """``t._version``: how many times it was written in place; 0 for None, -1 for an inference tensor
    (written only inside ``torch.inference_mode``, which keeps no count)."""
    if t is None:
        return 0
    return -1 if t.is_inference() else t._version


def noted(t: Optional[Tensor], dim: int = -1) -> tuple[int, Optional[Tensor]]:
    """What a record notes of a tensor it keeps: (its version now, its float32 sums along ``dim`` or None).

    A fresh tensor (version 0: never written in place) costs nothing: any later write means the record can no
    longer tell what the call saw. A tensor written before the call (version > 0), or an inference tensor (no
    count, -1), also gets its sums, one pass over it (``dim`` summed away: E times smaller than q, k or v), which
    tell a later write that changed nothing (or changed other rows) from one that did.
    """
    version = tensor_version(t)
    if version == 0 or t is None:
        return version, None
    return version, t.detach().float().sum(dim)


#: what :func:`written_since` gives for a tensor written with no sums to tell where (every slice may have changed)
_EVERYWHERE = torch.ones((), dtype=torch.bool)


def written_since(t: Optional[Tensor], version: int, sums: Optional[Tensor], dim: int = -1) -> Optional[Tensor]:
    """Whether ``t`` was written in place since :func:`noted` gave ``(version, sums)``.

    Returns:
        None when it reads as it did (same version; or same sums; or nothing was noted: version -1 and no sums);
        otherwise a bool tensor, the sums' shape, True where a slice changed (0-d True without sums).
    """
    if t is None or (version >= 0 and tensor_version(t) == version):
        return None
    if sums is None:
        return None if version < 0 else _EVERYWHERE
    now = t.detach().float().sum(dim)
    changed = (now != sums) & ~(now.isnan() & sums.isnan())  # (NaN as at the call: an eager softmax's masked row)
    return changed if bool(changed.any()) else None


def held(t: Optional[Tensor]) -> Optional[Tensor]:
    """What a record keeps of a tensor: the tensor itself unless it is part of an autograd graph
    (then detached; a detach costs a new tensor object, so it is not made otherwise)."""
    return t.detach() if t is not None and t.requires_grad else t


def key_witness(k: Optional[Tensor]) -> dict:
    """What a record notes of its keys to tell, when it is read, whether the model wrote into them since.

    Records keep the keys themselves (no copy). Keys that had been written in place before the call
    (``_version`` not 0: a static or sliding-window KV cache buffer, updated by ``index_copy_``) may be
    written again by later calls; for those, the per-key sums (B, H_kv, N_k) are kept as a witness
    (E times smaller than the keys). Freshly computed keys (version 0) cost nothing. Inference tensors
    (made under ``torch.inference_mode``) keep no count, so their sums are always kept.

    Returns:
        the record fields ``_k_version`` and ``_k_sums``.
    """
    version = tensor_version(k)
    if version == 0 or k is None:
        return {"_k_version": version, "_k_sums": None}
    return {"_k_version": version, "_k_sums": k.detach().float().sum(-1)}  # type: ignore[union-attr]


def query_witness(q: Optional[Tensor]) -> dict:
    """The record fields ``_q_version`` and ``_q_sums`` (see :func:`~vitexplain.recording.witness.noted`): what a
    record notes of the queries it keeps, so that a write into them after the call (a buffer reused, an in-place op
    on another view of the projection they live in) is refused when the record is read, not recomputed from."""
    version, sums = noted(q)
    return {"_q_version": version, "_q_sums": sums}


def value_witness(v: Optional[Tensor]) -> dict:
    """The record fields ``_v_version`` and ``_v_sums``: as :func:`query_witness`, for the values ``grad_probs``
    reads (``dO V^T``)."""
    version, sums = noted(v)
    return {"_v_version": version, "_v_sums": sums}


def weights_witness(weights: Tensor) -> dict:
    """The record fields ``_probs_version`` and ``_probs_sums``: as :func:`query_witness`, for the weights an eager
    softmax or an extractor returned (summed over the queries: a softmax's rows always sum to 1)."""
    version, sums = noted(weights, -2)
    return {"_probs_version": version, "_probs_sums": sums}


def kept_mask(mask: Optional[Tensor]) -> dict:
    """The record fields ``_mask`` and ``_mask_version``: the mask itself and its version, or, for an inference
    tensor (no version to compare), a copy of it.

    The mask is the one tensor without a cheap witness: a float mask's sums are -inf wherever a key is masked out
    (``-inf`` or ``finfo.min`` entries overflow), and a boolean mask's counts stay the same when a window moves.
    An inference mask is copied instead (one copy per call: (B, 1, 1, N_k) for a decoding step, (B, 1, N, N) for a
    prompt); the record then reads the mask as the call saw it, whatever the model writes into it later.
    """
    if mask is None:
        return {"_mask": None}
    if mask.is_inference():
        return {"_mask": mask.clone(), "_mask_version": -1}
    mask = mask.detach()
    return {"_mask": mask, "_mask_version": mask._version}


def block_tensors(block_mask: Any) -> tuple[Tensor, ...]:
    """The tensors of a FlexAttention ``BlockMask`` (or :class:`~vitexplain.recording.flex.BlockView`) that decide
    which entries its call kept: block counts and indices."""
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    found = (getattr(block_mask, name, None) for name in names)
    return tuple(t for t in found if isinstance(t, Tensor))


#: An inference tensor (``torch.inference_mode``) keeps no count of its writes: one of at most this many elements
#: is copied instead, and compared when the record is read (larger ones are not witnessed).
COPY_ELEMENTS = 4096


def tensor_versions(tensors: Iterable[Tensor]) -> tuple[tuple[Tensor, Any], ...]:
    """(tensor, its ``_version``, or a copy of it for a small inference tensor) for each of ``tensors``."""
    kept: list[tuple[Tensor, Any]] = []
    for t in tensors:
        if not t.is_inference():
            kept.append((t, t._version))
        elif t.numel() <= COPY_ELEMENTS:
            kept.append((t, t.clone()))
    return tuple(kept)


def changed_tensor(versions: tuple[tuple[Tensor, Any], ...]) -> Optional[Tensor]:
    """The first noted tensor written in place since it was noted, or None."""
    for tensor, noted in versions:
        if isinstance(noted, Tensor):
            if not torch.equal(tensor, noted):
                return tensor
        elif tensor._version != noted:
            return tensor
    return None
