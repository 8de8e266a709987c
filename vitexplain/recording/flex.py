"""FlexAttention capture: records of ``torch.nn.attention.flex_attention.flex_attention`` calls.

``flex_attention(q, k, v, score_mod, block_mask, scale, enable_gqa)`` computes
``softmax(score_mod(q k^T * scale))`` over the keys its ``block_mask`` keeps, in a fused
kernel: eager calls compile its higher-order op internally, so neither the probabilities nor
the op's arguments are visible to Python while it runs. The capture sees the call *before*
that: the first torch operation issued from ``flex_attention``'s own frame (or a validation
helper it calls) hands the recorder that frame, whose locals are the real q, k, v,
``score_mod``, ``block_mask``, ``scale`` and ``enable_gqa``. The kernel then runs unchanged.

A :class:`~vitexplain.recording.flex_records.FlexAttentionRecord` recomputes the probabilities the
kernel used, in float32 (its ``score_mod`` and block mask evaluated as the kernel does: see
:mod:`vitexplain.recording.flex_records`).

Gradients: with ``O = A V``, ``dy/dA = dO @ V^T`` as for SDPA; dO is taken by a tensor hook
on the kernel's output, found as the first tensor the caller receives whose autograd node
points back at q, k or v. FlexAttention has no backward on CPU (torch raises when any of
q, k, v requires grad there), so gradient methods on a FlexAttention model need a CUDA
device; on CPU the capture raises a :class:`~vitexplain.errors.CaptureError` saying so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..errors import CaptureError
from .flex_records import FlexAttentionRecord
from .records import AttentionRecord
from .sink import RecordSink, in_backward
from .mod_witness import captured
from .witness import block_tensors, key_witness, query_witness, tensor_versions, value_witness

__all__ = [
    "FlexWatcher",
    "BlockView",
    "flex_code",
    "flex_op",
    "flex_frame",
    "flex_arguments",
    "refuse_cpu_backward",
    "flex_configured",
    "traced_call",
    "traced_arguments",
    "find_output",
    "keep_uncompiled",
]

_MODULE = "torch.nn.attention.flex_attention"
_OP_MODULE = "torch._higher_order_ops.flex_attention"


def flex_code() -> Optional[CodeType]:
    """The code object of ``flex_attention``, or None when FlexAttention was never imported.

    (A model cannot call FlexAttention without importing it; importing it here would cost ~1 s.)
    """
    module = sys.modules.get(_MODULE)
    return None if module is None else module.flex_attention.__code__


def flex_op() -> Any:
    """FlexAttention's higher-order op (what compiled code calls), or None when not imported."""
    module = sys.modules.get(_OP_MODULE)
    return None if module is None else module.flex_attention


@dataclass(frozen=True)
class BlockView:
    """The parts of a ``BlockMask`` that decide which entries are kept (rebuilt from its tuple form).

    Compiled code passes a block mask to FlexAttention's op as ``BlockMask.as_tuple()``:
    ``(q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, ...,
    Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)`` (see :func:`traced_call`).
    """

    seq_lengths: tuple[int, int]
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Optional[Tensor]
    full_kv_indices: Optional[Tensor]
    BLOCK_SIZE: tuple[int, int]
    mask_mod: Callable



def traced_call(args: tuple) -> tuple:
    """What the recorder keeps of a call of FlexAttention's op while dynamo traces it.

    Dynamo replays the keeping on every call with the real values. Numbers that may be symbolic
    under dynamic shapes (the scale, the sequence lengths) are not kept as Python numbers, which
    dynamo cannot rebuild: the scale goes in a tensor, the lengths are read from q and k later.
    """
    q, k, v, score_mod, parts, scale = args[:6]
    blocks = (parts[2], parts[3], parts[4], parts[5], torch.tensor(parts[-3]), torch.tensor(parts[-2]), parts[-1])
    return q, k, v, score_mod, blocks, torch.tensor(scale, dtype=torch.float64)


def traced_arguments(call: tuple) -> dict[str, Any]:
    """q, k, v, score_mod, block_mask and scale of a call kept by :func:`traced_call`."""
    q, k, v, score_mod, blocks, scale = call
    kv_num, kv_idx, full_num, full_idx, q_block, kv_block, mask_mod = blocks
    view = BlockView((q.shape[-2], k.shape[-2]), kv_num, kv_idx, full_num, full_idx, (int(q_block), int(kv_block)), mask_mod)
    return {"query": q, "key": k, "value": v, "score_mod": score_mod, "block_mask": view, "scale": float(scale)}


_UNCOMPILED: set[CodeType] = set()


def keep_uncompiled(code: CodeType) -> None:
    """Keep dynamo from compiling ``code`` (a torch function mode's ``__torch_function__``) as a frame of its own.

    When a ``torch.compile``-d function falls back to running eagerly (a compiled FlexAttention call on the CPU whose
    inputs require grad: torch's check raised while dynamo traced it), dynamo compiles every new frame that the
    eager run enters, a mode's ``__torch_function__`` among them, guarded on the identity of short-lived
    method-wrappers (``Tensor.device.__get__``) whose ids are reused: later calls then ran the code compiled for
    another call (``query.device`` returned a bool), and every later capture of the model failed with
    ``'bool' object has no attribute 'type'``. Skipped, the frame runs as written (and its own refusal is reached);
    dynamo still inlines it while it traces a call (how compiled FlexAttention calls are recorded). A no-op until
    dynamo is imported (nothing is compiled before).
    """
    if code in _UNCOMPILED:
        return
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and hasattr(eval_frame, "skip_code"):
        eval_frame.skip_code(code)
        _UNCOMPILED.add(code)


def flex_frame(caller: FrameType, code: CodeType) -> Optional[FrameType]:
    """The ``flex_attention`` frame when ``caller`` is it or a helper it called directly."""
    if caller.f_code is code:
        return caller
    parent = caller.f_back
    return parent if parent is not None and parent.f_code is code else None


def _runs_compiled_code(frame: FrameType) -> bool:
    """Whether ``frame`` runs code that dynamo transformed (a ``torch.compile``-d function)."""
    utils = sys.modules.get("torch._dynamo.utils")
    table = getattr(utils, "orig_code_map", None)
    return table is not None and frame.f_code in table


def flex_arguments(frame: FrameType) -> dict[str, Any]:
    """q, k, v, score_mod, block_mask, scale and enable_gqa as ``flex_attention`` received them.

    Raises:
        CaptureError: q, k or v require grad on the CPU, where FlexAttention has no backward.
    """
    local = frame.f_locals
    args = {name: local.get(name) for name in ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa")}
    refuse_cpu_backward(args["query"], args["key"], args["value"])
    return args


def refuse_cpu_backward(q: Any, k: Any, v: Any) -> None:
    """Refuse a FlexAttention call whose q, k or v require grad on the CPU, where FlexAttention has no backward.

    Called where a capture first sees the call: at ``flex_attention``'s frame (:func:`flex_arguments`), and at
    transformers' ``flex_attention_forward`` (its tap, :mod:`~vitexplain.recording.interface`), whose ``torch.compile``-d ``flex_attention``
    runs as dynamo-transformed frames the watcher does not recognise (torch raised a bare NotImplementedError).

    Raises:
        CaptureError: they do.
    """
    tensors = [t for t in (q, k, v) if isinstance(t, Tensor)]
    if tensors and tensors[0].device.type == "cpu" and any(t.requires_grad for t in tensors):
        raise CaptureError(
            "this model calls FlexAttention, which has no backward pass on CPU (torch: 'FlexAttention "
            "does not support backward on CPU'), so gradient methods cannot run on it here: run them on "
            "a CUDA device, or use a method without gradients (raw, rollout; captioners: cross)"
        )


def flex_configured(model: Any) -> bool:
    """Whether a Hugging Face model was built with ``attn_implementation="flex_attention"`` (any of its modules'
    configs): its attention calls FlexAttention through transformers' ``torch.compile``-d ``flex_attention``."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == "flex_attention"
               for m in model.modules())


def find_output(args: tuple, kwargs: dict, q: Tensor, k: Tensor, v: Tensor) -> Optional[Tensor]:
    """The FlexAttention output among a torch call's tensor arguments, or None.

    It is the tensor whose autograd node takes q, k or v (directly) as an input.
    """
    sources = {id(t.grad_fn) for t in (q, k, v) if t.grad_fn is not None}
    leaves = {id(t) for t in (q, k, v) if t.grad_fn is None and t.requires_grad}
    for value in (*args, *kwargs.values()):
        node = getattr(value, "grad_fn", None) if isinstance(value, Tensor) else None
        if node is None:
            continue
        for parent, _ in node.next_functions:
            if parent is None:
                continue
            if id(parent) in sources or id(getattr(parent, "variable", None)) in leaves:
                return value
    return None


class FlexWatcher:
    """Records the FlexAttention calls of a capture (owned by the recorder, fed by its torch function mode).

    While FlexAttention is imported (:meth:`start` finds it), the mode hands over every torch
    call (:meth:`watch`) and every call of FlexAttention's op that dynamo traces (:meth:`traced`).
    The first torch call issued from a ``flex_attention`` frame records that call; calls seen by
    dynamo are recorded at the next torch call after them; while a record waits for its output
    (gradients captured), the calls after it are searched for it.

    Args:
        sink: where records go (the recorder).
        mode_code: the ``__torch_function__`` code of the mode that feeds the watcher (kept from being compiled
            alone: :func:`keep_uncompiled`).
    """

    def __init__(self, sink: RecordSink, mode_code: Optional[CodeType] = None) -> None:
        self.sink = sink
        self.mode_code = mode_code
        self.code: Optional[CodeType] = None  # flex_attention's code, while it is imported
        self.op: Any = None  # its higher-order op
        self._traced: list[tuple] = []  # appended while dynamo traces FlexAttention's op
        self._frame: Optional[FrameType] = None  # the flex_attention frame last recorded
        self._pending: Optional[tuple[AttentionRecord, tuple[Tensor, Tensor, Tensor]]] = None
        self._unattributed = 0

    def start(self) -> None:
        """At the start of a scope: look up FlexAttention (None unless a model imported it)."""
        self.code, self.op = flex_code(), flex_op()
        if self.code is not None and self.mode_code is not None:
            keep_uncompiled(self.mode_code)

    def stop(self) -> None:
        """At the end of a scope: count the compiled calls no later torch op could attribute."""
        self._unattributed += sum(not self._seen(traced_arguments(c)["query"]) for c in self._traced)
        self._traced.clear()
        self._frame = self._pending = None

    def check(self) -> None:
        """Raise when compiled FlexAttention calls are missing from the records.

        Raises:
            CaptureError: a compiled call returned its output without a further torch operation
                inside the capture, so no module could be named for it.
        """
        if self._unattributed:
            raise CaptureError(
                f"{self._unattributed} torch.compile-d FlexAttention call(s) returned their output without any "
                "further torch operation inside the capture, so they were not attributed to a module and are "
                "missing from the records; use the output inside the module (e.g. reshape it there)"
            )

    def traced(self, args: tuple) -> None:
        """A call of FlexAttention's op, while dynamo traces it (dynamo replays this on every call)."""
        self._traced.append(traced_call(args))

    def watch(self, caller: FrameType, args: tuple, kwargs: dict) -> None:
        """A torch call made from frame ``caller`` (see the class docstring)."""
        frame = flex_frame(caller, self.code) if self.code is not None else None
        if frame is not None:
            if frame is not self._frame:
                self._frame = frame
                self._record(flex_arguments(frame), frame.f_back)
            return
        while self._traced:  # calls seen by dynamo: attributed to the module that made this torch call
            bound = traced_arguments(self._traced.pop(0))
            if self._seen(bound["query"]):
                self._frame = None  # that call is over: do not keep its frame (and its callers) alive
            else:
                self._record(bound, caller, traced=True)
        if self._pending is not None:
            record, (q, k, v) = self._pending
            out = find_output(args, kwargs, q, k, v)
            if out is not None:
                self._pending = None
                record._attach_grad_hook(out, self.sink.hooks_enabled)

    def _seen(self, q: Tensor) -> bool:
        """Whether the last record already holds this FlexAttention call (seen at its frame)."""
        last = self.sink.last_record()
        return isinstance(last, FlexAttentionRecord) and last._q is not None and last._q.data_ptr() == q.data_ptr() \
            and last._q.shape == q.shape

    def _record(self, bound: dict[str, Any], caller: Optional[FrameType], traced: bool = False) -> None:
        issuer = self.sink.issuer(caller) if caller is not None else None
        if issuer is None or in_backward():  # (in_backward: a checkpointed forward recomputed, recorded before)
            return
        if traced and _runs_compiled_code(issuer.frame):
            # the module found runs dynamo-compiled code: the submodules it called (and the one that
            # called FlexAttention) were compiled into it, so the call cannot be attributed
            raise CaptureError(
                f"FlexAttention ran inside the torch.compile-d forward of {issuer.name or 'the model'!r}, whose "
                "submodules cannot be told apart; capture the uncompiled model (model._orig_mod), or compile "
                "flex_attention itself rather than the whole model"
            )
        q, k, v = bound["query"], bound["key"], bound["value"]
        mod_versions, mod_reads = captured(bound["score_mod"], getattr(bound["block_mask"], "mask_mod", None))
        record = self.sink.add_record(
            issuer,
            FlexAttentionRecord,
            source="flex",
            q_shape=q.shape,
            k_shape=k.shape,
            _q=q.detach(),
            _k=k.detach(),
            **query_witness(q),
            **key_witness(k),
            _scale=bound["scale"],
            score_mod=bound["score_mod"],
            block_mask=bound["block_mask"],
            _mod_versions=mod_versions,
            _mod_reads=mod_reads,
            _block_versions=tensor_versions(block_tensors(bound["block_mask"])),
        )
        if self.sink.grads:
            record._v = v.detach()
            witness = value_witness(v)
            record._v_version, record._v_sums = witness["_v_version"], witness["_v_sums"]
            if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
                record._grad_state = "no_output"  # until the output is seen (:meth:`watch`)
                self._pending = (record, (q, k, v))
            else:
                record._grad_state = "no_graph"
