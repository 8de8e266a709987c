"""The record book of a capture: records numbered per module, kept in call order, and drafts made when read.

:class:`RecordBook` is the bookkeeping behind the :class:`~vitexplain.recording.sink.RecordSink` side of
:class:`~vitexplain.recording.Recorder`: it numbers each new record of a module (its ``step``, its kind and its
top-level call), keeps the records made at the call and the drafts to be made when the records are next read
(:meth:`RecordSink.add_draft`, a lane's pending call of ``direct.py``), and notes the attention seen and not
recorded. It knows nothing of the scope, the hooks or narrowing (the recorder tells narrowing what was issued).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .attribution import frame_kind
from .records import AttentionRecord
from .sink import Issuer

__all__ = ["RecordBook"]


class RecordBook:
    """The records of one capture, numbered as they are issued and kept in call order.

    Args:
        forward_index: ``forward_index(issuer)``: the top-level call a record of ``issuer`` made now belongs to.

    Attributes:
        drafts: records to make (:meth:`add_draft`, :meth:`add_lane_draft`), in call order after those made:
            ``(name, kind, step, forward_index, fields)``, ``fields`` a dict or a lane's pending call.
        unrecorded: attention seen and not recorded: module name -> why (:meth:`not_recorded`).
        unrecorded_told: whether reading the records warned of :attr:`unrecorded`.
    """

    def __init__(self, forward_index: Callable[[Issuer], int]) -> None:
        self._forward_index = forward_index
        self._made: list[AttentionRecord] = []
        self.drafts: list[tuple] = []
        self._steps: dict[str, int] = {}
        self.unrecorded: dict[str, str] = {}
        self.unrecorded_told = False

    def numbered(self, issuer: Issuer, kind: Optional[str] = None) -> tuple[str, str, int, int]:
        """(name, kind, step, top-level call) of a new record of ``issuer``, counted now (kind: from the
        issuer's frame unless given)."""
        name = issuer.name
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        return name, kind or frame_kind(issuer.module, issuer.frame), step, self._forward_index(issuer)

    def add(self, issuer: Issuer, record_type: type, kind: Optional[str], fields: dict[str, Any]) -> AttentionRecord:
        """Create, number and keep a record of ``issuer`` (kind: from the issuer unless given)."""
        name, kind, step, forward_index = self.numbered(issuer, kind)
        record = record_type(name=name, kind=kind, index=len(self.records()), step=step, forward_index=forward_index,
                             **fields)
        self._made.append(record)
        return record

    def add_draft(self, issuer: Issuer, fields: dict[str, Any]) -> None:
        """Keep a record of ``issuer``, numbered now, to be made from ``fields`` when the records are next read."""
        self.drafts.append((*self.numbered(issuer), fields))

    def add_lane_draft(self, name: str, kind: str, forward_index: int, pending: Any) -> None:
        """Keep a record of module ``name`` whose fields ``pending.resolve()`` makes when the records are read."""
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        self.drafts.append((name, kind, step, forward_index, pending))

    def records(self) -> list[AttentionRecord]:
        """Every record so far, in call order (drafts made into records first); the book's own list."""
        if self.drafts:
            drafts, self.drafts = self.drafts, []
            made = self._made
            for name, kind, step, forward_index, fields in drafts:
                if not isinstance(fields, dict):  # a lane's pending call (direct.py): its fields made now
                    fields = fields.resolve()
                made.append(AttentionRecord(name=name, kind=kind, index=len(made), step=step,
                                            forward_index=forward_index, **fields))
        return self._made

    def not_recorded(self, name: str, reason: str) -> None:
        """Note an attention call of module ``name`` seen and not recorded, for ``reason`` (the first one kept)."""
        self.unrecorded.setdefault(name, reason)

    def clear(self) -> None:
        """Forget every record, draft, count and note."""
        self.unrecorded.clear()
        self.unrecorded_told = False
        self._made.clear()
        self.drafts.clear()
        self._steps.clear()
