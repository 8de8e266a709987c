"""FlexAttention records: the probabilities a ``flex_attention`` call used, recomputed from what it was given.

A :class:`FlexAttentionRecord` (made by :class:`~vitexplain.recording.flex.FlexWatcher`, which sees the calls)
recomputes the probabilities the kernel used, in float32:

- scores ``q k^T * scale`` (grouped-query attention repeats key heads), then ``score_mod``
  applied per entry (vectorised with ``torch.vmap`` over batch, head, query and key index,
  as torch's own math path does);
- the block mask: entries where ``mask_mod(b, h, q_idx, kv_idx)`` is True are kept, the others
  are exactly 0 (rows with every key masked are all 0). Fused kernels keep the entries of
  *full* blocks, apply ``mask_mod`` in *partial* blocks and skip the other blocks, which is the
  same for a mask made by ``create_block_mask(mask_mod, ...)``; torch's unfused path (eager
  ``flex_attention``) applies ``mask_mod`` only. When the two disagree, ``probs()`` raises
  instead of guessing which one ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..errors import CaptureError
from .mod_witness import changed_read
from .records import AttentionRecord
from .scores import QuerySelect, _rows
from .witness import changed_tensor

__all__ = ["FlexAttentionRecord", "flex_scores", "flex_probs"]


def _expand_blocks(blocks: Tensor, rows: Tensor, n_k: int, block_size: tuple[int, int]) -> Tensor:
    """Block-level (B, H, Q_blocks, KV_blocks) bools -> entry-level (B, H, n, N_k) for query rows ``rows``."""
    q_bs, kv_bs = block_size
    per_row = blocks[:, :, rows // q_bs]  # (B, H, n, KV_blocks)
    return per_row[..., torch.arange(n_k, device=blocks.device) // kv_bs]


def _dense_mask(block_mask: Any, b: int, h: int, rows: Tensor, n_k: int, device: torch.device) -> Tensor:
    """(B, H, n, N_k) bool: the entries kept for the selected query rows.

    Raises:
        CaptureError: the blocks and the ``mask_mod`` disagree, so what is kept depends on how
            the call ran (fused kernels skip blocks; torch's unfused path applies ``mask_mod`` only).
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import BlockMask, _vmap_for_bhqkv

    size, lengths = block_mask.BLOCK_SIZE, block_mask.seq_lengths
    partial = BlockMask.from_kv_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, BLOCK_SIZE=size, seq_lengths=lengths)
    keep = _expand_blocks(partial.to_dense().bool(), rows, n_k, size)
    index = (torch.arange(b, device=device), torch.arange(h, device=device), rows, torch.arange(n_k, device=device))
    with TransformGetItemToIndex():  # the kernel calls mask_mod with the real batch and head indices
        mod = _vmap_for_bhqkv(block_mask.mask_mod, prefix=())(*index)
    mod = mod.bool()
    full = torch.zeros_like(keep)
    if block_mask.full_kv_num_blocks is not None:
        full_blocks = BlockMask.from_kv_blocks(
            block_mask.full_kv_num_blocks, block_mask.full_kv_indices, BLOCK_SIZE=size, seq_lengths=lengths
        )
        full = _expand_blocks(full_blocks.to_dense().bool(), rows, n_k, size)
    kernel = (keep & mod) | full  # what fused kernels keep
    if not torch.equal(kernel.expand_as(mod), mod):
        raise CaptureError(
            "this FlexAttention BlockMask's blocks disagree with its mask_mod (e.g. it was built with "
            "BlockMask.from_kv_blocks without a mask_mod): fused kernels skip the blocks, torch's unfused "
            "path (flex_attention without torch.compile) applies mask_mod only, so the attention depends "
            "on how the call ran. Build the mask with create_block_mask(mask_mod, ...), or give it a "
            "mask_mod that states the same mask"
        )
    return mod


def flex_scores(
    q: Tensor,
    k: Tensor,
    *,
    score_mod: Optional[Callable] = None,
    block_mask: Any = None,
    scale: Optional[float] = None,
    queries: QuerySelect = None,
) -> Tensor:
    """``score_mod(q k^T * scale)``, ``-inf`` where ``block_mask`` drops the entry, in float32.

    Args:
        q: (B, H, N_q, E) queries.
        k: (B or 1, H_kv, N_k, E) keys; H must be a multiple of H_kv (grouped-query attention).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, or None.
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask``, or None.
        scale: score scale; None means ``1 / sqrt(E)``.
        queries: which query rows (None = all; an int, a slice or an index tensor).

    Returns:
        (B, H, n, N_k) float32 scores.
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    b, h, n_q, e = q.shape
    n_k = k.shape[-2]
    rows = torch.arange(n_q, device=q.device)[_rows(queries, n_q)]
    kf = k.float()
    if kf.shape[1] != h:
        kf = kf.repeat_interleave(h // kf.shape[1], dim=1)
    scale = e**-0.5 if scale is None else float(scale)
    scores = torch.matmul(q[:, :, rows].float(), kf.expand(b, -1, -1, -1).transpose(-2, -1)) * scale
    if score_mod is not None:
        index = (torch.arange(b, device=q.device), torch.arange(h, device=q.device), rows, torch.arange(n_k, device=q.device))
        with TransformGetItemToIndex():
            scores = _vmap_for_bhqkv(score_mod, prefix=(0,))(scores, *index).float()
    if block_mask is not None:
        scores = scores.masked_fill(~_dense_mask(block_mask, b, h, rows, n_k, q.device), float("-inf"))
    return scores


def flex_probs(
    q: Tensor,
    k: Tensor,
    *,
    score_mod: Optional[Callable] = None,
    block_mask: Any = None,
    scale: Optional[float] = None,
    queries: QuerySelect = None,
) -> Tensor:
    """``softmax(score_mod(q k^T * scale))`` over the entries ``block_mask`` keeps, in float32.

    Args: as :func:`flex_scores`.

    Returns:
        (B, H, n, N_k) float32; masked entries are exactly 0.
    """
    scores = flex_scores(q, k, score_mod=score_mod, block_mask=block_mask, scale=scale, queries=queries)
    return torch.nan_to_num_(torch.softmax(scores, dim=-1), nan=0.0)


@dataclass(eq=False)
class FlexAttentionRecord(AttentionRecord):
    """A FlexAttention call: the SDPA fields plus its ``score_mod`` and ``block_mask``.

    Attributes:
        score_mod: the call's ``score_mod`` (None: identity).
        block_mask: the call's ``BlockMask`` (None: every key).
    """

    score_mod: Optional[Callable] = field(default=None, repr=False)
    block_mask: Any = field(default=None, repr=False)
    _mod_versions: tuple = field(default=(), repr=False)  # (tensor, _version) the mods read (mod_witness.py)
    _mod_reads: tuple = field(default=(), repr=False)  # the names the mods read, with their values (mod_witness.py)
    _block_versions: tuple = field(default=(), repr=False)  # (tensor, _version) of the block mask's blocks

    @property
    def rows_sum_to_one(self) -> bool:
        return self.block_mask is None and self.score_mod is None

    def probs(self, queries: QuerySelect = None) -> Tensor:
        """Probabilities the kernel used, recomputed in float32 (see :func:`flex_probs`).

        Returns:
            (B, H, n, N_k) float32.
        """
        if self._q is None or self._k is None:
            raise CaptureError(f"record {self.name!r} holds no queries/keys (it was released)")
        self._check_kept()  # (the queries, written in place after the call: refused)
        if changed_tensor(self._block_versions) is not None:  # (before the keys: their check reads the blocks)
            raise CaptureError(
                f"the BlockMask of the FlexAttention call {self.name!r} (step {self.step}) was written in place after "
                "the call (its block counts or indices: a mask reused across calls), so its attention cannot be "
                "recomputed; read the records before the model writes it again, or give each call its own BlockMask"
            )
        self._check_keys_kept()  # (keys of a static KV cache, written again after the call: refused)
        read = changed_read(self._mod_reads)
        if read is not None:
            raise CaptureError(
                f"the score_mod or mask_mod of the FlexAttention call {self.name!r} (step {self.step}) reads "
                f"{read.describe()}, which changed after the call (e.g. a decoding position the module advances, or a "
                "parameter replaced), so its attention cannot be recomputed; read the records before it changes, or copy "
                "the value into a local variable at the call (pos = self.pos) and let the score_mod read that"
            )
        changed = changed_tensor(self._mod_versions)
        if changed is not None:
            raise CaptureError(
                f"a tensor of shape {tuple(changed.shape)} that the score_mod or mask_mod of the FlexAttention call "
                f"{self.name!r} (step {self.step}) reads was written in place after the call (e.g. a decoding offset "
                "updated at every step, or a bias an optimizer stepped), so its attention cannot be recomputed; read "
                "the records before the model writes it again"
            )
        return flex_probs(
            self._q, self._k, score_mod=self.score_mod, block_mask=self.block_mask, scale=self._scale, queries=queries
        )


    def _scores(self) -> Tensor:
        return flex_scores(self._q, self._k, score_mod=self.score_mod, block_mask=self.block_mask, scale=self._scale)
