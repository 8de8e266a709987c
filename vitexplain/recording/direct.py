"""Records of Hugging Face SDPA attention made from the attention function's own arguments.

After narrowing (``narrowing.py``), a Hugging Face attention module's call reaches the capture
through the ``"sdpa"`` tap of transformers' attention interface (``interface.py``), and the
capture's torch function mode is entered for the duration of transformers'
``sdpa_attention_forward`` so that its SDPA call is seen. That costs the mode's dispatch on each
of the function's torch calls (shape reads, reshapes) on every layer and decoding step.

This module computes, from the function's arguments, the arguments that function passes to
SDPA, as transformers does (``repeat_kv``, packed grouped-query decoding, the causal flag, the
key slice for an empty static cache), and makes the same record the mode would make, while the
function runs without the mode. It is trusted only where it was *checked*: the first call of each
kind (the function itself, the module's class, and every condition the function branches on or
that this module reads: mask or not, one query row or more, grouped-query handling, causal flag,
key slice, which keyword arguments are set) runs through the mode as before, and the record the
mode made is compared with the one computed here (name, shapes, causal flag, scale, dropout,
and q, k and mask values). Equal: later calls of that kind are recorded from the arguments.
Different (another transformers version that prepares SDPA's arguments otherwise): that kind
keeps going through the mode. Calls this module does not follow (a position bias, softcap,
``output_attentions``, a capture with gradients or materialized attention, tracing or
compiling) always go through the mode.

Lanes: once a module's call was recorded from its arguments, its later calls of the same shape
(:func:`_shape_key`: which arguments are given, the mask's rank, one query row or more, keys longer
than the queries, the causal flag, dropout; fresh keys only) take its *lane* without gradients, inside the
model's own forward or outside it (a VLM's ``generate`` encodes its images before its first forward: the
record's top-level call is then found by the frame walk the checked path makes): the call runs, and its
arguments are kept as the draft
(:class:`_Pending`); the plan is made when the records are read, out of the model's hot loop, and a
plan that is not a checked kind is refused then (:class:`~vitexplain.errors.CaptureError`), never
recorded unchecked. Lanes are kept with what the captures learned about the model
(``discovery.Learned.lanes``) for its later captures that declare no extractor.
"""

from __future__ import annotations

import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

from ..errors import CaptureError
from .attribution import frame_kind, never_issues, stable_kind
from .early import keeps_probs, with_probs
from .sink import Issuer, RecordSink
from .witness import held, key_witness, kept_mask, query_witness, tensor_version as _version

__all__ = ["DirectSDPA"]

_MODULE = "transformers.integrations.sdpa_attention"

# (function, module class, conditions) -> whether records computed here equal the mode's
_CHECKED: dict[tuple, bool] = {}
_lock = threading.Lock()


class _Source:
    """transformers' ``sdpa_attention_forward`` and the helpers it uses, read once per function object."""

    def __init__(self, original: Callable, source: Any) -> None:
        code = original.__code__
        names = code.co_varnames[1: code.co_argcount]  # after ``module``
        defaults = original.__defaults__ or ()
        self.names = names
        self.defaults = dict(zip(names[len(names) - len(defaults):], defaults))
        self.use_gqa = getattr(source, "use_gqa_in_sdpa", None)
        self.repeat = getattr(source, "repeat_kv", None)
        self.usable = not getattr(source, "_is_torch_npu_available", True) and {"query", "key", "value"} <= set(names)


_SOURCES: dict[int, tuple[Callable, Optional[_Source]]] = {}  # by id(original), the function held


def _source(original: Callable) -> Optional[_Source]:
    known = _SOURCES.get(id(original))
    if known is not None and known[0] is original:
        return known[1]
    module = sys.modules.get(_MODULE)
    found = None
    if module is not None and getattr(module, "sdpa_attention_forward", None) is original:
        found = _Source(original, module)
        found = found if found.usable else None
    _SOURCES[id(original)] = (original, found)
    return found


def _plan(original: Callable, module: nn.Module, args: tuple, kwargs: dict,
          gqa: dict[tuple, bool]) -> Optional[tuple[tuple, dict[str, Any]]]:
    """(the call's kind, the record's fields) as ``sdpa_attention_forward`` would pass SDPA its
    arguments, or None where this is not followed.

    ``gqa``: what ``use_gqa_in_sdpa`` answered in this capture, by (mask or not, key and value head
    sizes, device): it reads the environment on every call, and answers the same for the same of these.
    """
    source = _source(original)
    if source is None or len(args) > len(source.names):
        return None
    bound = dict(zip(source.names, args))  # the function's arguments by name (one lookup each: this runs per call)
    if kwargs:
        bound.update(kwargs)
    get = bound.get
    defaults = source.defaults
    if get("softcap") is not None or get("output_attentions") or get("position_bias", defaults.get("position_bias")) is not None:
        return None
    query, key, mask = get("query"), get("key"), get("attention_mask")
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or key.dim() != 4:
        return None
    if (mask is not None and not isinstance(mask, Tensor)) or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    handling = "none"
    if isinstance(groups, int) and groups > 1:
        if source.use_gqa is None or source.repeat is None:
            return None
        value = get("value")
        asked = (source.use_gqa, mask is None, key.shape[-1], getattr(value, "shape", (None,))[-1], key.device.type)
        use = gqa.get(asked)
        if use is None:
            use = gqa[asked] = bool(source.use_gqa(mask, key, value))
        if use:
            handling = "enable_gqa"
        elif q_length == 1:
            handling = "packed"  # the record holds the query heads as heads, as the mode's (packed.py)
        else:
            handling = "repeat"
            key = source.repeat(key, groups)
    causal = get("is_causal", defaults.get("is_causal"))
    causal = causal if causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and mask is None and causal)
    sliced = causal and key.shape[2] > q_length
    if sliced:
        key = key[:, :, :q_length, :]
    dropout = float(get("dropout", defaults.get("dropout")) or 0.0)
    scaling = get("scaling", defaults.get("scaling"))
    given = tuple([name for name, v in kwargs.items() if v is not None])  # (defaults: the function's own)
    kind = (original, type(module), handling, None if mask is None else mask.dim(), q_length == 1, causal, sliced,
            dropout != 0.0, scaling is None, tuple([a is None for a in args[4:]]), given)
    fields = dict(source="sdpa", q_shape=query.shape, k_shape=key.shape, dropout_p=dropout, _scale=scaling,
                  _causal=causal, _q=held(query), _k=held(key), **kept_mask(mask), **query_witness(query),
                  **key_witness(key))
    return kind, fields


def _shape_key(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What a module's calls share when :func:`_plan` gives them one kind: the module, which arguments are passed
    (and which are None), the mask's presence and rank, one query row or more, keys longer than the queries,
    the causal flag and dropout; only fresh keys (a static cache's keys, written in place, get their witness at
    call time on the checked path). None: not a call a lane takes. A lane's call whose kind still differs
    (something this key does not see) is refused when its record is made (``_Pending.resolve``)."""
    if len(args) < 4:
        return None
    query, key, mask = args[0], args[1], args[3]
    if mask is not None and not isinstance(mask, Tensor):
        return None  # (FlexAttention's BlockMask: _plan takes no such call either)
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or _version(key) > 0:
        return None  # (an inference tensor keeps no count, -1: the lane notes its key sums at call time, _Pending)
    q_length = query.size(2)
    return (id(module), len(args), tuple([k for k, v in kwargs.items() if v is not None]), mask is None,
            None if mask is None else mask.dim(), q_length == 1, q_length > 1 and key.size(2) > q_length,
            kwargs.get("is_causal"), bool(kwargs.get("dropout")),
            tuple([a is None for a in args[4:]]) if len(args) > 4 else ())


def _same(record: Any, issuer: Issuer, fields: dict[str, Any]) -> bool:
    """Whether the mode's record of a call equals the one computed from its arguments and its caller."""
    if record.name != issuer.name or record.kind != frame_kind(issuer.module, issuer.frame):
        return False
    if record.q_shape != fields["q_shape"] or record.k_shape != fields["k_shape"]:
        return False
    if record.dropout_p != fields["dropout_p"] or record._scale != fields["_scale"] or record._causal != fields["_causal"]:
        return False
    if record._q is None and record._probs is not None:  # the mode's record kept the call's probabilities (early.py)
        early = with_probs(fields, record.heads)
        return (early is not None and record._masked == early["_masked"]
                and torch.equal(record._probs, early["_probs"]))
    mask, expected = record._mask, fields["_mask"]
    if (mask is None) != (expected is None):
        return False
    if mask is not None and (mask.shape != expected.shape or not torch.equal(mask, expected)):
        return False
    return torch.equal(record._q, fields["_q"]) and torch.equal(record._k, fields["_k"])


class _Lane(NamedTuple):
    """What a checked call of one module decided that the module's later calls of the same shape reuse."""

    original: Callable
    code: CodeType  # the issuing method's code (the frame that called the interface)
    name: str
    kind: str  # "self" / "cross"
    plan: tuple  # the kind :func:`_plan` gave the checked call (still checked equal when a call takes the lane)


_NO_MASK = {"_mask_version": 0}  # (read only: what a lane's call without a mask notes of it)
_FRESH_QUERY = {"_q_version": 0, "_q_sums": None}  # (read only: query_witness of a query never written in place)


class _Pending:
    """A lane's call, kept as its arguments: :meth:`resolve` makes the record's fields when the records are read
    (out of the model's hot loop), as :func:`_plan` makes them at call time on the checked path."""

    __slots__ = ("original", "module", "args", "kwargs", "gqa", "sums", "noted")

    def __init__(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict, gqa: dict) -> None:
        self.original, self.module, self.args, self.kwargs, self.gqa = original, module, args, kwargs, gqa
        key = args[1]
        # an inference tensor keeps no count of its writes: its per-key sums now tell, when the record is made,
        # whether a later call wrote into it (a static cache under torch.inference_mode); a lane's keys are
        # otherwise fresh (version 0, _shape_key)
        inference = key.is_inference()
        self.sums = key.detach().float().sum(-1) if inference else None
        # the queries and the mask as the call saw them (versions, or an inference mask's copy), the keys' version:
        # the record is made later, from these tensors, which the model may write in place meanwhile
        query, mask = args[0], args[3]
        if mask is None:
            kept = _NO_MASK
        else:
            kept = kept_mask(mask) if mask.is_inference() else {"_mask_version": mask._version}
        fresh = not query.is_inference() and query._version == 0  # (query_witness's answer for a fresh query)
        self.noted = (_FRESH_QUERY if fresh else query_witness(query), kept, -1 if inference else 0)

    def resolve(self) -> dict[str, Any]:
        """The record's fields; they are what the capture's mode records for a call of a kind checked equal.

        Raises:
            CaptureError: the call was of a kind not checked (another branch of transformers' function than
                the module's first call of the same shape took): its record cannot be trusted.
        """
        plan = _plan(self.original, self.module, self.args, self.kwargs, self.gqa)
        if plan is not None:
            queries, mask, key_version = self.noted
            fields = dict(plan[1], **queries, **mask)
            if self.sums is not None:
                fields = _written_since(fields, self.args[1], self.sums)
            elif _version(self.args[1]) != key_version:  # fresh keys written since the call (the record's keys
                fields = _rewritten_keys(fields)  # may be a copy made now, repeat_kv: it cannot tell)
            plan = (plan[0], fields)
        if plan is None or _CHECKED.get(plan[0]) is not True:
            raise CaptureError(
                f"an attention call of {type(self.module).__name__} took another path through transformers' "
                "sdpa_attention_forward than its first call of the same shape, which the capture checked: its "
                "record cannot be trusted; please report this with your transformers version"
            )
        return plan[1]


class _Made:
    """A lane's call whose record's fields were made at the call (a decoding step that keeps its probabilities,
    :mod:`.early`): :meth:`resolve` gives them."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def resolve(self) -> dict[str, Any]:
        return self.fields


def _written_since(fields: dict[str, Any], key: Tensor, sums: Tensor) -> dict[str, Any]:
    """``fields`` whose key witness (sums of the planned keys, taken now) marks the keys written since the call
    (their sums then, ``sums``, (B, H_kv, N_k)) as changed: NaN, which equals nothing, where a sum differs."""
    changed = key.detach().float().sum(-1) != sums
    witness = fields.get("_k_sums")
    if witness is None or not bool(changed.any()):
        return fields
    if witness.shape[1] != changed.shape[1]:  # keys repeated for the query heads (repeat_kv)
        changed = changed.repeat_interleave(witness.shape[1] // changed.shape[1], dim=1)
    return dict(fields, _k_sums=witness.masked_fill(changed[..., : witness.shape[-1]], float("nan")))


def _rewritten_keys(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` whose key witness marks every key as written since the call (NaN sums, which equal nothing)."""
    k = fields["_k"]
    return dict(fields, _k_version=-1, _k_sums=torch.full(k.shape[:-1], float("nan"), device=k.device))


class DirectSDPA:
    """Records a capture's tapped SDPA calls from their arguments where that was checked (module docstring).

    Args:
        sink: the recorder.
        enabled: False for captures whose records need the SDPA call itself (gradients, materialized attention).
    """

    def __init__(self, sink: RecordSink, enabled: bool) -> None:
        self.sink = sink
        self.enabled = enabled
        self._gqa: dict[tuple, bool] = {}  # see _plan
        self._lanes: dict[tuple, _Lane] = {}  # by _shape_key: a module's calls that skip the plan (call())

    def use_lanes(self, lanes: dict) -> None:
        """Take and add to ``lanes``, the lanes of earlier captures of the same model (``discovery.Learned.lanes``:
        the model's modules, names and forwards unchanged since)."""
        self._lanes = lanes

    def call(self, original: Callable, module: nn.Module, args: tuple, kwargs: dict, frame: Optional[FrameType],
             through_mode: Callable[[Callable, nn.Module, tuple, dict], Any]) -> Any:
        """Run ``original(module, *args, **kwargs)`` and record its SDPA call.

        Args:
            original: the interface's attention function.
            module: the issuing module (one of the captured model's).
            args, kwargs: the call's other arguments.
            frame: the frame that called the interface (the module's forward).
            through_mode: runs ``original(module, *args, **kwargs)`` (given those four) with the capture's mode on
                (the record is then the mode's).
        """
        shape = _shape_key(module, args, kwargs) if self.enabled and frame is not None else None
        lane = self._lanes.get(shape) if shape is not None else None  # type: ignore[arg-type]
        if (lane is not None and lane.original is original and lane.code is frame.f_code  # type: ignore[union-attr]
                and not torch.is_grad_enabled() and _CHECKED.get(lane.plan) is True
                and not torch._C._is_tracing() and not torch.compiler.is_compiling()):  # (as _plan refuses those)
            # a module's later call of a shape whose first call was checked: its arguments are kept and the
            # record's fields made when the records are read (_Pending), the plan's cost out of the hot loop
            index = self.sink.lane_index(Issuer(lane.name, module, frame))  # type: ignore[arg-type]
            if index is not None:
                out = original(module, *args, **kwargs)
                pending: Any = _Pending(original, module, args, kwargs, self._gqa)
                if keeps_probs(args[0], args[1], args[1].is_inference()):  # its record keeps the probabilities,
                    fields = pending.resolve()                             # computed now (early.py)
                    pending = _Made(with_probs(fields, self.sink.heads) or fields)
                self.sink.add_lane_draft(lane.name, lane.kind, index, pending)
                return out
        plan = _plan(original, module, args, kwargs, self._gqa) if self.enabled else None
        if plan is None or frame is None:
            return through_mode(original, module, args, kwargs)
        kind, fields = plan
        checked = _CHECKED.get(kind)
        if checked is False:
            return through_mode(original, module, args, kwargs)
        issuer = self.sink.issuer_of(module, frame)
        if issuer is None:
            return through_mode(original, module, args, kwargs)
        if checked is None:
            before = self.sink.last_record()
            out = through_mode(original, module, args, kwargs)
            record = self.sink.last_record()
            with _lock:
                _CHECKED[kind] = record is not before and record is not None and _same(record, issuer, fields)
            return out
        out = original(module, *args, **kwargs)
        self.sink.add_draft(issuer, fields)
        self_or_cross = stable_kind(module, frame.f_code)
        if shape is not None and self_or_cross is not None:  # (shape: fresh keys; a lane is taken without gradients)
            self._lanes[shape] = _Lane(original, frame.f_code, issuer.name, self_or_cross, kind)
        return out


never_issues(DirectSDPA.call.__code__)  # on the stack between an HF attention module and SDPA (checked calls)
