"""What an interceptor of attention calls sees of the recorder: an issuer and a place for records.

The parts that observe attention (SDPA, softmax and MHA interception, FlexAttention, the hooks
of declared modules) find the module that issued a call and hand the recorder a new record.
They do that through :class:`RecordSink`, which :class:`~vitexplain.recording.Recorder`
implements, and never through the recorder's own state.
"""

from __future__ import annotations

from types import FrameType
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch import nn

from .records import AttentionRecord

__all__ = ["Issuer", "RecordSink", "in_backward"]


_graph_task = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread.

    Module code that runs then is a gradient-checkpointed forward being recomputed (timm's
    ``set_grad_checkpointing``, ``torch.utils.checkpoint``): its attention calls and module calls
    were recorded when the forward ran, so they are not recorded again.
    """
    return _graph_task is not None and _graph_task() != -1


class Issuer(NamedTuple):
    """The captured module that issued an attention call.

    Attributes:
        name: its name in ``model.named_modules()`` (``""`` for the model itself).
        module: the module.
        frame: the frame of the module's method that (directly or through helpers) made the call.
    """

    name: str
    module: nn.Module
    frame: FrameType


class RecordSink(Protocol):
    """The recorder as the interceptors use it.

    Attributes:
        grads: whether gradients are captured (records then hook their output).
        heads: what records holding probabilities the capture computed keep: ``"all"`` or a head fusion.
    """

    grads: bool
    heads: str

    def issuer(self, start: FrameType) -> Optional[Issuer]:
        """The module that issued a call made from frame ``start``, or None when the call is not
        recorded there (not from the captured model, or inside a module an extractor declares)."""

    def issuer_of(self, module: nn.Module, frame: FrameType) -> Optional[Issuer]:
        """``module`` as the issuer of a call made from ``frame`` (its method), when the caller knows the
        module (Hugging Face's attention interface passes it); None when not recorded there."""

    def add_record(
        self, issuer: Issuer, record_type: type = AttentionRecord, *, kind: Optional[str] = None, **fields: Any
    ) -> AttentionRecord:
        """Create, number and keep a record issued by ``issuer``; its kind is decided from the
        issuer (:func:`vitexplain.recording.attribution.frame_kind`) unless given."""

    def add_draft(self, issuer: Issuer, fields: dict[str, Any]) -> None:
        """Keep a record issued by ``issuer`` whose fields are all known now (``AttentionRecord`` keyword
        arguments other than name, kind, index, step and forward_index, which are decided now): the record
        itself is made when the records are next read (out of the model's hot loop; records keep call order).
        Nothing is held but ``fields`` (never the issuer's frame, which would keep its locals alive)."""

    def lane_index(self, issuer: Issuer) -> Optional[int]:
        """The number of the top-level call a record of ``issuer`` belongs to (as :meth:`add_draft` numbers it),
        or None when a lane cannot take the call (a backward pass runs: it is not recorded again)."""

    def add_lane_draft(self, name: str, kind: str, forward_index: int, pending: Any) -> None:
        """Keep a record of module ``name`` (kind ``kind``, top-level call ``forward_index`` from
        :meth:`lane_index`) whose fields ``pending.resolve()`` makes when the records are next read."""

    def last_record(self) -> Optional[AttentionRecord]:
        """The latest record, or None."""

    def not_recorded(self, issuer: Issuer, reason: str) -> None:
        """An attention call of ``issuer`` was seen and not recorded, for ``reason`` (what its layout is and why no
        record can hold it): reading the records says so (:class:`~vitexplain.errors.UnrecordedAttentionWarning`,
        or the :class:`~vitexplain.errors.NoAttentionError` when nothing was recorded)."""

    def hooks_enabled(self) -> bool:
        """Whether gradient hooks collect now (False while :meth:`Recorder.backward` runs its own pass)."""

    def in_scope_thread(self) -> bool:
        """Whether the calling thread is the one that entered the capture (module hooks fire for the model's
        calls in every thread; only this thread's are the capture's)."""
