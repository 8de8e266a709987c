"""What a capture records: one :class:`AttentionRecord` per attention call.

A record keeps the tensors the model already computed (references, no copies) and
recomputes attention probabilities from them on demand, in float32:

- an SDPA record keeps ``q``, ``k`` (and ``v`` and the output gradient when gradients are
  captured), the mask, scale and causal flag, never the N x N probabilities;
- a decoding step's SDPA record over large keys, or keys a cache wrote in place, keeps the
  probabilities it computed at the call instead of q and k (:mod:`vitexplain.recording.early`);
- a *materialized* SDPA record (``vx.capture(..., attention_mode="materialize")``, see
  :mod:`vitexplain.recording.materialize`) keeps the probabilities the capture computed in
  place of the fused kernel, and the gradient that reaches them, like an eager record;
- an eager record (a model that computes ``softmax(q k^T)`` in Python) keeps the
  probabilities the model itself materialised, and the gradient that reaches them;
- a module record (attention declared by an extractor, :mod:`vitexplain.recording.custom`)
  keeps the weights the module used, and the gradient that reaches them.

Probabilities and their gradients can be requested for a subset of query rows
(``queries=``), which is how methods stay in O(block x N) memory per layer.

Kept by reference, those tensors can be written in place after the call (a static KV cache, a mask
buffer updated between decoding steps, an in-place op on another view of the same storage, weights a
module keeps in a buffer). A record notes at the call what tells such a write (version counters; sums
where they cannot tell; an inference-mode mask is copied, see :mod:`vitexplain.recording.witness`)
and, read after one, raises a :class:`~vitexplain.errors.CaptureError` naming the tensor instead of
recomputing from what it holds now.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor

from ..errors import CaptureError, UsageError
from .scores import Fusion, QuerySelect, _described, _repeat_heads, _rows, attention_probs, attention_scores, fuse_heads
from .witness import tensor_version as _version
from .witness import written_since

__all__ = ["AttentionRecord", "weak_grad_hook"]


@dataclass(eq=False)
class AttentionRecord:
    """One attention call seen during a captured forward.

    Attributes:
        name: module path of the issuing module, e.g. ``"blocks.3.attn"``.
        kind: ``"self"`` when queries and keys come from the same sequence, ``"cross"``
            otherwise (decided from the issuing module's arguments, see ``vx.capture``).
        index: position of this call among all records of the capture.
        step: how many times this module had issued attention before in this capture
            (0 for the first call; decoding steps with a KV cache count up).
        forward_index: which top-level call of the captured model issued it: 0 for the first
            one that recorded attention, one more for each later one. A top-level call is the
            model's forward, or a submodule called from outside the model (e.g. the image
            encoder that Hugging Face ``generate`` runs before its first forward); each
            ``generate`` step is one.
        source: ``"sdpa"`` (fused kernel observed), ``"eager"`` (softmax computed by the
            model in Python), ``"flex"`` (FlexAttention, see :mod:`vitexplain.recording.flex`)
            or ``"module"`` (weights read by an extractor from a module's call, see
            :mod:`vitexplain.recording.custom`).
        q_shape: (B, H, N_q, E) shape of the queries.
        k_shape: (B, H_kv, N_k, E) shape of the keys (for eager records: (B, H, N_k, -1)).
        dropout_p: attention dropout used by the call (0 in eval mode).
        materialized: an SDPA call that the capture computed itself (``attention_mode``):
            the record holds its probabilities and their gradient, not q and k.
        heads: ``"all"``, or the head fusion (``"mean"``, ``"max"``, ``"min"``) that is all
            a materialized record kept (``vx.capture(..., heads=...)``): then only
            ``fused_probs(heads)`` is available.
    """

    name: str
    kind: Literal["self", "cross"]
    index: int
    step: int
    source: Literal["sdpa", "eager", "module", "flex"]
    q_shape: torch.Size
    k_shape: torch.Size
    dropout_p: float = 0.0
    forward_index: int = 0
    materialized: bool = False
    heads: str = "all"
    _q: Optional[Tensor] = field(default=None, repr=False)
    _k: Optional[Tensor] = field(default=None, repr=False)
    _v: Optional[Tensor] = field(default=None, repr=False)
    _mask: Optional[Tensor] = field(default=None, repr=False)
    _scale: Optional[float] = field(default=None, repr=False)
    _causal: bool = field(default=False, repr=False)
    _masked: bool = field(default=False, repr=False)
    _probs: Optional[Tensor] = field(default=None, repr=False)
    _out: Optional[Tensor] = field(default=None, repr=False)
    _grad_out: Optional[Tensor] = field(default=None, repr=False)
    _grad_probs: Optional[Tensor] = field(default=None, repr=False)
    _grad_state: str = field(default="off", repr=False)
    _k_version: int = field(default=0, repr=False)
    _k_sums: Optional[Tensor] = field(default=None, repr=False)
    # what the record noted of the other tensors it keeps by reference (witness.py; -1 and no sums: nothing noted)
    _q_version: int = field(default=-1, repr=False)
    _q_sums: Optional[Tensor] = field(default=None, repr=False)
    _v_version: int = field(default=-1, repr=False)
    _v_sums: Optional[Tensor] = field(default=None, repr=False)
    _mask_version: int = field(default=-1, repr=False)
    _probs_version: int = field(default=-1, repr=False)
    _probs_sums: Optional[Tensor] = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        """B, the batch size of the call."""
        return int(self.q_shape[0])

    @property
    def num_heads(self) -> int:
        """H, the number of query heads (1 for an SDPA call on (B, N, E) without a head dimension)."""
        return int(self.q_shape[1]) if len(self.q_shape) > 3 else 1

    @property
    def num_queries(self) -> int:
        """N_q, the number of query tokens."""
        return int(self.q_shape[-2])

    @property
    def num_keys(self) -> int:
        """N_k, the number of key tokens."""
        return int(self.k_shape[-2])

    @property
    def rows_sum_to_one(self) -> bool:
        """True when every probability row sums to 1: an SDPA call (recomputed or
        materialized) without mask and not causal.

        Masked or causal calls can have rows in which every key is masked; those come out as
        zeros, and an eager model's softmax may be masked in ways the capture does not see,
        so their sums must be computed.
        """
        return self.source == "sdpa" and self._mask is None and not self._masked and not self._causal

    @property
    def _holds_probs(self) -> bool:
        """The probabilities were kept (eager, materialized, module), so dy/dA is hooked on them."""
        return self._probs is not None

    @property
    def device(self) -> torch.device:
        """The device the attention ran on."""
        tensor = self._q if self._q is not None else self._probs
        if tensor is None:
            raise CaptureError(f"record {self.name!r} holds no tensors (it was released)")
        return tensor.device

    def probs(self, queries: QuerySelect = None) -> Tensor:
        """Attention probabilities of this call in float32: recomputed from q and k, or
        the stored ones (eager and materialized records).

        A query row in which every key is masked: zeros in an SDPA or FlexAttention record (what the
        fused kernels compute, and SDPA's math path too); an eager or declared record holds the weights
        the model's own softmax gave, so NaN for a plain softmax over ``-inf`` scores (e.g.
        ``nn.MultiheadAttention`` with ``need_weights=True``) and uniform weights for a ``finfo.min``
        mask (Hugging Face's eager attention). Each record equals what its call computed.

        Args:
            queries: which query rows (None = all; an int, a slice or an index tensor).

        Returns:
            (B, H, n, N_k) float32 probabilities, n the number of selected rows.

        Raises:
            CaptureError: a tensor the record keeps (queries, keys, mask, weights) was written in place after
                the call, so the call's attention cannot be given (see :meth:`_check_kept`).
        """
        if self.heads != "all":
            raise CaptureError(
                f"record {self.name!r} kept only the {self.heads} over heads (vx.capture(..., heads="
                f"{self.heads!r})): use fused_probs({self.heads!r}), or capture with heads='all'"
            )
        if self._probs is not None:
            rows = _rows(queries, self.num_queries)
            self._check_kept()
            return self._probs[..., rows, :].float()
        if self._q is None or self._k is None:
            raise CaptureError(f"record {self.name!r} holds no queries/keys (it was released)")
        self._check_kept()
        self._check_keys_kept()
        probs = attention_probs(
            self._q,
            self._k,
            attn_mask=self._mask,
            scale=self._scale,
            is_causal=self._causal,
            queries=queries,
        )
        # an SDPA call on (B, N, E) has one head: (B, 1, n, N_k), as every record's probabilities (and gradients)
        return probs.unsqueeze(1) if probs.dim() == 3 else probs

    def _check_kept(self) -> None:
        """Raise when a tensor :meth:`probs` reads (other than the keys, :meth:`_check_keys_kept`) was written in
        place after the call: its queries, its mask or the weights it holds (``grad_probs`` checks the values).

        Why refuse rather than copy: records keep the call's tensors without copying them (a copy of q, v and the
        mask at every call would cost the capture memory and time on every model), a write after the call is rare
        (a buffer the model reuses, an in-place op on another view of the same storage), and the version counters
        that tell it cost nothing. A record that cannot give the call's attention raises a CaptureError naming the
        tensor and how to keep it; it never recomputes from what the tensor holds now. The one copy: a mask made
        under ``torch.inference_mode``, which keeps no version and has no cheap witness (``witness.kept_mask``).
        """
        if self._probs is not None:
            if written_since(self._probs, self._probs_version, self._probs_sums, -2) is not None:
                raise self._written("attention weights")
            return
        if written_since(self._q, self._q_version, self._q_sums) is not None:
            raise self._written("queries")
        if written_since(self._mask, self._mask_version, None) is not None:
            raise self._written("attention mask")

    def _written(self, what: str) -> CaptureError:
        """The error of :meth:`_check_kept`: ``what`` was written in place after the call, and what to do."""
        if self.source == "sdpa":
            remedy = ("read the records before the model writes them again, or capture with vx.capture(model, "
                      "attention_mode='materialize'), whose records keep each call's probabilities (and the gradient "
                      "reaching them) instead of its tensors")
        elif self.source == "module":
            remedy = ("have the extractor return a copy of the weights (e.g. weights.clone()), or read the records "
                      "before the module writes them again")
        else:
            remedy = "read the records before the model (or your code) writes them again"
        return CaptureError(
            f"the {what} of {self.name!r} (step {self.step}) were written in place after the call (the record keeps "
            f"them by reference: a buffer the model reuses, or an in-place op on another view of the same storage), "
            f"so this record cannot give the call's attention; {remedy}"
        )

    def _check_keys_kept(self) -> None:
        """Raise when the model wrote, after this call, into keys this call attended to (written in place
        before the call too, see :func:`key_witness`). Writes to keys the call masked out change nothing
        (a static cache filled at later positions); a sliding-window cache overwrites attended ones."""
        if self._k_version >= 0 and _version(self._k) == self._k_version:
            return  # not written since (an inference tensor keeps no count: its sums tell)
        if self._k_sums is None and self._k_version < 0:
            return  # (no witness kept)
        if self._k_sums is not None:
            changed = self._k.detach().float().sum(-1) != self._k_sums  # (B, H_kv, N_k) keys written since
            if not bool(changed.any()):
                return
            attended = (self._scores() > torch.finfo(torch.float32).min / 2).any(-2)  # (B, H, N_k): some query attends
            if changed.shape != attended.shape:  # grouped-query keys
                changed = _repeat_heads(changed[..., None], attended.shape[-2])[..., 0]
            if not bool((attended & changed).any()):
                return
        if self._k_version == 0:  # fresh keys (no cache wrote them before the call): a later write, or one of a view
            raise CaptureError(
                f"the keys of {self.name!r} (step {self.step}) were overwritten in place after the call (or another "
                "view of the same storage was: the record keeps them by reference), so its attention cannot be "
                "recomputed; read the records before the model writes them again"
                + (", or capture with vx.capture(model, attention_mode='materialize')" if self.source == "sdpa" else "")
            )
        raise CaptureError(
            f"the keys of {self.name!r} (step {self.step}) were overwritten in place after the call, as a "
            "static or sliding-window KV cache does, so its attention cannot be recomputed; read the records "
            "before the next call overwrites them, or generate with a dynamic cache "
            "(e.g. generate(..., cache_implementation='dynamic'))"
        )

    def _scores(self) -> Tensor:
        """(B, H, N_q, N_k) float32 masked scores from the keys held now (``-inf`` where masked)."""
        return attention_scores(self._q, self._k, attn_mask=self._mask, scale=self._scale, is_causal=self._causal)

    def fused_probs(self, fusion: Fusion = "mean", queries: QuerySelect = None) -> Tensor:
        """Head-fused probabilities.

        Args:
            fusion: ``"mean"``, ``"max"`` or ``"min"`` over heads.
            queries: which query rows (None = all).

        Returns:
            (B, n, N_k) float32.
        """
        kept_fused = self._probs is not None and self.heads != "all"
        if kept_fused and (self.heads == fusion or self.num_heads == 1):  # kept fused (one head: every fusion is it)
            return self._probs[..., _rows(queries, self.num_queries), :].float()
        return fuse_heads(self.probs(queries), fusion)

    def _check_grads(self, need_backward: bool = True) -> None:
        if self._grad_state == "off":
            raise CaptureError(
                f"no gradients were captured for {self.name!r}: use "
                "vx.capture(model, grads=True) and call backward() on a score before "
                "asking for grad_probs()"
            )
        if self._grad_state == "no_output":
            raise CaptureError(
                f"the output of the FlexAttention call {self.name!r} never reached another torch operation "
                "inside the captured forward, so its gradient could not be hooked"
            )
        if self._grad_state == "not_in_graph":
            raise CaptureError(
                f"the attention weights the extractor of {self.name!r} returned are not the tensor the "
                "module's output was computed from (a recomputation, a detached copy, or a view made in the "
                "extractor, e.g. .unsqueeze(1) or .view(B, H, N, N)), so the gradient reaching them is not "
                "dy/dA; return the module's own weights tensor, shaped (B, N_k), (B, N_q, N_k) or (B, H, N_q, N_k)"
            )
        if self._grad_state == "no_graph":
            raise CaptureError(
                f"the attention output of {self.name!r} was not part of an autograd graph "
                "(the forward ran under torch.no_grad(), neither the input nor any parameter "
                "requires grad, or the block ran under torch.utils.checkpoint(use_reentrant=True), "
                "whose forward builds no graph), so dy/dA cannot be computed; run the forward "
                "with gradients enabled, e.g. x.requires_grad_(True), and checkpointing off or "
                "with use_reentrant=False"
            )
        if need_backward and self._grad_out is None and self._grad_probs is None:
            raise CaptureError(
                f"no gradient has reached {self.name!r} yet: call backward() on a scalar "
                "score that depends on this attention before asking for grad_probs()"
            )

    @property
    def output(self) -> Tensor:
        """The attention output tensor, still in the autograd graph (grads=True only).

        For an SDPA record this is O = A V, shape (B, H, N_q, E_v); for an eager or a
        materialized record it is the probability tensor A itself (as the model made it: window
        attention keeps its extra dims here, (B, G, H, N, N), while the record's shapes fold them
        into B); for a module record the weights tensor as the extractor returned it. Use it with
        ``torch.autograd.grad`` to take the
        gradient of any other score (e.g. one score per layer, as LeGrad does) and pass
        that to ``grad_probs(d_out=...)``.
        """
        self._check_grads(need_backward=False)
        if self._out is None:
            raise CaptureError(f"record {self.name!r} holds no output (it was released)")
        return self._out

    def grad_probs(self, queries: QuerySelect = None, *, d_out: Optional[Tensor] = None) -> Tensor:
        """Gradient of the backpropagated score w.r.t. this call's attention probabilities.

        For an SDPA call, with O = A V, ``dy/dA = dO @ V^T`` where dO was captured by a
        tensor hook on the SDPA output: no eager attention is ever materialised. For eager,
        materialized and module records it is the gradient that reached the probabilities
        themselves. With
        attention dropout active (training mode) this is the gradient w.r.t. the
        post-dropout probabilities; explain models in eval mode.

        Args:
            queries: which query rows (None = all).
            d_out: use this gradient w.r.t. :attr:`output` instead of the one captured by
                the last backward (e.g. from ``torch.autograd.grad``).

        Returns:
            (B, H, n, N_k) float32.

        Raises:
            CaptureError: gradients were not captured, the forward had no autograd graph,
                no backward has reached this call yet, or the values it keeps (dO V^T) were
                written in place after the call.
        """
        self._check_grads(need_backward=d_out is None)
        rows = _rows(queries, self.num_queries)
        if d_out is not None:
            d_out = self._as_4d(d_out)
        if self._holds_probs:  # eager, materialized and module records: the gradient w.r.t. the weights
            grad = d_out if d_out is not None else self._grad_probs
            if grad is None:
                raise CaptureError(f"no gradient has reached {self.name!r}")
            return grad[..., rows, :].float()
        d_out = d_out if d_out is not None else self._grad_out
        if d_out is None or self._v is None:
            raise CaptureError(f"record {self.name!r} holds no gradient or values (released, or no backward yet)")
        if written_since(self._v, self._v_version, self._v_sums) is not None:
            raise self._written("values")
        d_out = d_out[..., rows, :].float()
        v = self._v.float()
        if v.dim() == 3:  # SDPA on (B, N, E) without a head dimension (e.g. SAM folds heads into B)
            v = v[:, None]
        if v.shape[-3] != d_out.shape[-3]:
            v = v.repeat_interleave(d_out.shape[-3] // v.shape[-3], dim=-3)
        return torch.matmul(d_out, v.transpose(-2, -1))

    def release(self) -> None:
        """Drop every tensor this record holds (frees memory; the record becomes empty)."""
        self._q = self._k = self._v = self._mask = self._out = None
        self._probs = self._grad_out = self._grad_probs = self._k_sums = None
        self._q_sums = self._v_sums = self._probs_sums = None

    # -- called by the recorder -------------------------------------------------------
    def _as_4d(self, grad: Tensor) -> Tensor:
        """A gradient w.r.t. :attr:`output` as (B, H, N_q, last) (outputs with window dims, MHA's
        (B * H, N_q, N_k) weights and Hugging Face's packed grouped-query outputs (B, H_kv, G, E),
        see :mod:`vitexplain.recording.packed`, are recorded as (B, H, N_q, ...))."""
        if grad.dim() == 4 and grad.shape[1] == self.num_heads:
            return grad
        if grad.dim() == 0 or grad.numel() % (self.batch_size * self.num_heads * grad.shape[-1]) \
                or (self._out is not None and grad.numel() != self._out.numel()):
            shape = f" {tuple(self._out.shape)}" if self._out is not None else ""
            raise UsageError(
                f"the gradient given for {self.name!r} ({_described(grad)}) does not have the shape of its "
                f"output{shape}: pass d_out = the gradient w.r.t. record.output"
            )
        return grad.reshape(self.batch_size, self.num_heads, -1, grad.shape[-1])

    def _add_grad(self, grad: Tensor) -> None:
        """Accumulate a gradient w.r.t. :attr:`output` (like ``.grad`` does)."""
        grad = self._as_4d(grad.detach())  # also a module's (B, N_k) or (B, N_q, N_k) weights
        if self._holds_probs:
            self._grad_probs = grad if self._grad_probs is None else self._grad_probs + grad
        else:
            self._grad_out = grad if self._grad_out is None else self._grad_out + grad

    def _attach_grad_hook(self, output: Tensor, enabled: Callable[[], bool]) -> None:
        """Capture the gradient reaching ``output`` (SDPA output or eager probs) in any backward."""
        if not output.requires_grad:
            self._grad_state = "no_graph"
            return
        self._grad_state = "waiting"
        self._out = output
        output.register_hook(weak_grad_hook(self, enabled))


def weak_grad_hook(record: Any, enabled: Callable[[], bool]) -> Callable[[Tensor], None]:
    """A tensor hook that passes the gradient to ``record._add_grad`` while ``enabled()`` (an attention record's,
    or an :class:`~vitexplain.recording.activations.ActivationRecord`'s).

    The hook lives in autograd's C++ graph, which Python's garbage collector cannot see
    through; the record holds the hooked tensor, so a strong reference from the hook back to
    the record (or to the recorder behind ``enabled``) would form a cycle that is never freed,
    and every gradient capture would keep its records and autograd graph alive. The hook
    therefore holds both weakly.
    """
    ref = weakref.ref(record)
    check = weakref.WeakMethod(enabled) if inspect.ismethod(enabled) else (lambda: enabled)

    def hook(grad: Tensor) -> None:
        target, is_enabled = ref(), check()
        if target is not None and is_enabled is not None and is_enabled():
            target._add_grad(grad)

    return hook
