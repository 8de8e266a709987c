"""The recorder of a capture: its scope, its records, their gradients.

How a capture works (see docs/methods.md, "How attention is captured"), one module each:

- :mod:`~vitexplain.recording.interception`: a torch function mode observes SDPA, 4-D softmax,
  ``nn.MultiheadAttention`` and FlexAttention calls (:mod:`~vitexplain.recording.flex`) and lets
  the fused kernels run (or computes the attention itself, :mod:`~vitexplain.recording.materialize`);
  Hugging Face's packed grouped-query decoding is undone (:mod:`~vitexplain.recording.packed`);
- :mod:`~vitexplain.recording.custom`: forward hooks on modules declared with an extractor;
  :mod:`~vitexplain.recording.activations`: on the modules whose outputs are asked for (Grad-CAM layers);
- :mod:`~vitexplain.recording.attribution`: the module, the kind and the top-level call of each
  call, from the Python stack (no hook on the model for this);
- :mod:`~vitexplain.recording.records`: what is kept, and the probabilities and gradients
  recomputed from it; :mod:`~vitexplain.recording.book`: records numbered and kept in call order;
  :mod:`~vitexplain.recording.gates`: CNN attention gates;
- :mod:`~vitexplain.recording.compiled`: ``torch.compile``-d models run eagerly in the scope;
  :mod:`~vitexplain.recording.gradients`: ``rec.backward``'s own pass to every record.

Everything the capture changes is restored on exit, also when the block raises: hooks (the
root's input hook and the optional activation, declared-module and CNN gate hooks), the MHA
fast-path flag and the ``torch.compile`` stance. The model's ``training`` flags, ``fused_attn``
flags, ``requires_grad`` and ``.grad`` are never touched.

The recorder does not recognise models: ``rec.layout`` comes from the ``layout_fn`` it is given
(:func:`vitexplain.capture` gives the adapters' :func:`vitexplain.token_layout`).
"""

from __future__ import annotations

import sys
import threading
import weakref
import warnings
from types import FrameType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..errors import CaptureError, InputError, UnrecordedAttentionWarning
from ..layout import TokenLayout
from .attribution import Attribution
from .book import RecordBook
from .compiled import eager_stance, unwrap_compiled
from .custom import Extractor, declared_modules, module_hook
from .shared import HOOKS, hold_fastpath_off, release_fastpath
from . import discovery
from .direct import DirectSDPA
from .early import with_probs
from .flex import FlexWatcher
from .gates import GateHooks, GateRecord, checked_gates
from .gradients import backward_pass, backward_running, hooks_paused, zero_grads
from .interception import AttentionMode
from .materialize import check_heads, check_mode
from .narrowing import Narrowing
from .activations import activation_hook
from .checkpointing import checkpointing_off
from .activations import ActivationRecord
from .records import AttentionRecord
from .missing import SUPPORTED, no_attention, unrecorded_note
from .sink import Issuer, in_backward

__all__ = ["capture", "Recorder", "LayoutFn", "SUPPORTED", "hooks_paused"]

LayoutFn = Callable[[nn.Module, tuple[int, int]], TokenLayout]
"""``layout_fn(model, (H, W)) -> TokenLayout``: the token layout of a model for an input size."""

class Recorder:
    """Records the attention calls (and optionally activations) of one model.

    Use through :func:`vitexplain.capture`. After the forward, ``rec.records`` lists one
    :class:`AttentionRecord` per attention call in call order; ``rec.layout`` gives the
    token layout of the image input; ``rec.activations[name]`` the recorded module calls.
    The arguments are those of :func:`vitexplain.capture`, plus ``layout_fn``.

    Attributes:
        model: the captured model.
        grads: whether gradients w.r.t. attention (and activations) are captured.
        attention_mode: ``"fused"``, ``"materialize"`` or ``"auto"`` (see :func:`vitexplain.capture`).
        layout_fn: ``layout_fn(model, (H, W)) -> TokenLayout`` behind :attr:`layout`, or None.
        input_size: (H, W) of the last image tensor the model received, if any.
        forward_count: how many times the model's own forward ran inside the scope, in the thread that
            entered it (calls from other threads are not this capture's).
    """

    #: Intercept every torch call in the scope (True), or narrow interception to where attention is
    #: issued after the first forward (False, the default; recording/narrowing.py). Private: the
    #: tests' oracle sets it on a recorder before entering it.
    _full_interception = False

    def __init__(
        self,
        model: nn.Module,
        *,
        grads: bool = False,
        activations: Sequence[str] = (),
        attention: Union[bool, Mapping[str, Extractor]] = True,
        gates: bool = False,
        attention_mode: str = "fused",
        heads: str = "all",
        layout_fn: Optional[LayoutFn] = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"vx.capture expects an nn.Module, got {type(model).__name__}")
        self.model = unwrap_compiled(model)
        self._compiled = self.model is not model
        self.grads = bool(grads)
        self.attention = bool(attention) or isinstance(attention, Mapping)
        self._extractors: dict[str, Extractor] = dict(attention) if isinstance(attention, Mapping) else {}
        self.attention_mode = check_mode(attention_mode)
        self.heads = check_heads(heads)
        self.layout_fn = layout_fn
        self.activation_names = tuple(activations)
        self.capture_gates = bool(gates)
        self.input_size: Optional[tuple[int, int]] = None
        self.forward_count = 0
        self._other_thread_forwards = 0  # forwards of the model in other threads while the scope was active
        self.activations: dict[str, list[ActivationRecord]] = {n: [] for n in self.activation_names}
        self._gates: list[GateRecord] = []
        self._gate_hooks: Optional[GateHooks] = None
        self._attribution = Attribution()
        self._book = RecordBook(self._attribution.forward_index)  # the records, numbered and in call order
        # the interceptors reach the recorder weakly: a recorder the caller drops goes (with the attention its records
        # hold) at once, not when the garbage collector finds a cycle through them (they run inside its scope only)
        sink = weakref.proxy(self)
        self._flex = FlexWatcher(sink, AttentionMode.__torch_function__.__code__)
        self._mode = AttentionMode(sink, self._flex, self.attention_mode, self.heads)
        self._narrowing = Narrowing(self._mode, self.model, DirectSDPA(sink, not self.grads and self.attention_mode == "fused"))
        self._mode_entered = False
        self._handles: list[RemovableHandle] = []
        self._fastpath = False  # whether this capture holds MHA's fast path off (shared.py)
        self._stance: Any = None
        self._active = False
        self._thread = 0  # the thread the scope was entered in
        self._root_depth = 0  # calls of the model itself in progress in that thread
        self._checkpointing: Optional[Callable[[], None]] = None  # puts gradient checkpointing back on

    # -- context manager --------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if self._active:
            raise CaptureError("this recorder is already active; create a new vx.capture(...)")
        surveyed = discovery.survey(self.model)  # (the one walk over the modules)
        modules = surveyed.modules
        missing = [n for n in self.activation_names if n not in modules]
        if missing:
            raise CaptureError(
                f"no module named {missing} in {type(self.model).__name__}; module names "
                f"look like {list(modules)[1:6]} (see model.named_modules())"
            )
        with HOOKS:  # every hook of the scope is registered with it held (see shared.py)
            try:
                self._stance = eager_stance(self._compiled or surveyed.compiled)
                self._thread = threading.get_ident()
                self._handles.append(
                    self.model.register_forward_pre_hook(self._on_model_input, with_kwargs=True)
                )
                self._handles.append(self.model.register_forward_pre_hook(self._on_root_start, prepend=True))
                self._handles.append(self.model.register_forward_hook(self._on_root_end, always_call=True))
                if self.activation_names and not self.attention:  # (checkpoint_seq bypasses stages: checkpointing.py)
                    self._checkpointing = checkpointing_off(self.model)
                for name in self.activation_names:
                    self._handles.append(
                        modules[name].register_forward_hook(activation_hook(self, name), with_kwargs=True)
                    )
                if self.capture_gates:
                    self._gate_hooks = GateHooks(self.model, self._gates, self.in_scope_thread)
                    self._handles.extend(self._gate_hooks.register())
                declared = (declared_modules(self.model, self._extractors, modules, surveyed.by_type)
                            if self.attention else {})
                self._narrowing.share_lanes = not declared  # (a lane's issuer name holds when no module is declared)
                self._attribution.start(surveyed.names, declared)
                if self.attention:
                    for name, (module, extractor) in declared.items():
                        self._handles.append(
                            module.register_forward_hook(module_hook(self, name, extractor), with_kwargs=True)
                        )
                    self._fastpath = hold_fastpath_off()
                    self._flex.start()
                    self._mode_entered = True
                    self._narrowing.enabled = not self._full_interception
                    self._narrowing.start(surveyed)
            except BaseException:
                self._restore()
                raise
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore(clean=exc_type is None)
        return None  # never swallow exceptions

    def _restore(self, clean: bool = False) -> None:
        try:
            if self._mode_entered:
                self._mode_entered = False
                try:
                    self._narrowing.stop(clean)
                finally:
                    self._flex.stop()
        finally:
            self._attribution.stop()
            self._root_depth = 0
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self._fastpath:
                self._fastpath = False
                release_fastpath()
            if self._stance is not None:
                release, self._stance = self._stance, None
                release()
            if self._checkpointing is not None:
                restore, self._checkpointing = self._checkpointing, None
                restore()
            self._active = False

    # -- the record sink (what the interceptors use, see recording/sink.py) ----------------
    def issuer(self, start: FrameType) -> Optional[Issuer]:
        """The captured module that issued a call made from ``start`` (None: not recorded)."""
        return self._attribution.attention_issuer(start)

    def issuer_of(self, module: nn.Module, frame: FrameType) -> Optional[Issuer]:
        """``module`` as the issuer of a call made from ``frame`` (see :class:`RecordSink`)."""
        if in_backward():  # a checkpointed forward recomputed: through the mode, which does not record it again
            return None
        return self._attribution.issuer_of(module, frame)

    def add_record(
        self, issuer: Issuer, record_type: type = AttentionRecord, *, kind: Optional[str] = None, **fields: Any
    ) -> AttentionRecord:
        """Create, number and keep a record of ``issuer`` (kind: from the issuer unless given)."""
        if fields.get("source") != "module":  # attention seen by the mode: it stays on inside this class
            self._narrowing.issued(issuer.module)
        return self._book.add(issuer, record_type, kind, fields)

    def add_draft(self, issuer: Issuer, fields: dict[str, Any]) -> None:
        """Keep a record of ``issuer`` to be made when the records are next read (see :class:`RecordSink`); a
        decoding step's record keeps its probabilities, computed now, instead of q and k (:mod:`.early`)."""
        self._narrowing.issued(issuer.module)
        if not self.grads:
            fields = with_probs(fields, self.heads) or fields
        self._book.add_draft(issuer, fields)

    def lane_index(self, issuer: Issuer) -> Optional[int]:
        """The top-level call a lane's record of ``issuer`` belongs to, or None (see :class:`RecordSink`)."""
        return None if in_backward() else self._attribution.forward_index(issuer)

    def add_lane_draft(self, name: str, kind: str, forward_index: int, pending: Any) -> None:
        """Keep a record of module ``name`` whose fields ``pending.resolve()`` makes when the records are read
        (see :class:`RecordSink`)."""
        self._book.add_lane_draft(name, kind, forward_index, pending)

    @property
    def _records(self) -> list[AttentionRecord]:
        """Every record so far, in call order (drafts made into records first)."""
        return self._book.records()

    def last_record(self) -> Optional[AttentionRecord]:
        """The latest record, or None."""
        return self._records[-1] if self._records else None

    def in_scope_thread(self) -> bool:
        """Whether the calling thread is the one that entered the scope (see :class:`RecordSink`)."""
        return threading.get_ident() == self._thread

    def hooks_enabled(self) -> bool:
        """Whether gradient hooks collect: not while :meth:`backward` of this or of any other recorder runs
        its own pass (a capture nested in another, e.g. an explainer's inside a user's: each recorder's
        pass reaches the records it targets, not the other recorder's, whose hooks see the same graph)."""
        return not backward_running()

    # -- results ----------------------------------------------------------------------
    @property
    def records(self) -> list[AttentionRecord]:
        """All attention records, in call order.

        Raises:
            NoAttentionError: no attention call was seen (no forward ran, or the model
                has no attention this capture can observe).
            CaptureError: a compiled FlexAttention call could not be attributed to a module.
        """
        self._flex.check()
        unrecorded = unrecorded_note(self._book.unrecorded)
        if not self._records:
            raise no_attention(type(self.model).__name__, self.forward_count, self._other_thread_forwards, unrecorded)
        if unrecorded and not self._book.unrecorded_told:
            self._book.unrecorded_told = True
            warnings.warn(f"these records are not all of {type(self.model).__name__}'s attention: {unrecorded}",
                          UnrecordedAttentionWarning, stacklevel=2)
        return list(self._records)

    def not_recorded(self, issuer: Issuer, reason: str) -> None:
        """Note an attention call seen and not recorded (see :class:`RecordSink`)."""
        self._book.not_recorded(issuer.name, reason)

    def select(
        self,
        *,
        kind: Optional[str] = None,
        prefix: Optional[str] = None,
        step: Optional[int] = None,
        forward_index: Optional[int] = None,
    ) -> list[AttentionRecord]:
        """Records filtered by kind (``"self"``/``"cross"``), module-name prefix, step and top-level call."""
        return [
            r
            for r in self.records
            if (kind is None or r.kind == kind)
            and (prefix is None or r.name == prefix or r.name.startswith(prefix + "."))
            and (step is None or r.step == step)
            and (forward_index is None or r.forward_index == forward_index)
        ]

    @property
    def layout(self) -> TokenLayout:
        """Token layout (prefix tokens, patch grid) of the model for the recorded input size.

        Returns:
            a :class:`vitexplain.layout.TokenLayout`, from ``layout_fn`` (``vx.capture`` gives the
            model's adapter).

        Raises:
            CaptureError: no image tensor reached the model, or the recorder has no ``layout_fn``.
        """
        if self.input_size is None:
            raise CaptureError(
                "no image tensor (B, C, H, W) reached the model's forward inside the capture, "
                "so the patch grid is unknown; call vx.token_layout(model, (H, W)) directly"
            )
        if self.layout_fn is None:
            raise CaptureError(
                "this recorder knows no token layout: vitexplain.recording.capture does not recognise "
                "models; use vx.capture(model), or pass layout_fn=vx.token_layout"
            )
        return self.layout_fn(self.model, self.input_size)

    def activation(self, name: str, step: int = -1) -> ActivationRecord:
        """The recorded call ``step`` (default: last) of the activation module ``name``."""
        if name not in self.activations:
            raise CaptureError(
                f"{name!r} was not captured; pass it in vx.capture(model, activations=[...])"
            )
        calls = self.activations[name]
        if not calls:
            raise CaptureError(f"module {name!r} did not run during the captured forward")
        return calls[step]

    @property
    def gates(self) -> list[GateRecord]:
        """CNN attention gates (SE, ECA, CBAM, ...), one :class:`GateRecord` per module call, in call order.

        Each record holds the channel gate (B, C) and/or spatial gate (B, h, w) the module
        multiplied its input by, and that input (B, C, h, w); see ``vitexplain.recording.gates``.

        Raises:
            CaptureError: gates were not captured (``vx.capture(model, gates=True)``), no
                forward ran, or the model has none of the supported gate modules (the
                message lists them).
        """
        if not self.capture_gates:
            raise CaptureError("gates were not captured; use vx.capture(model, gates=True)")
        return checked_gates(self.model, self._gates, self.forward_count)

    def backward(self, score: Tensor, *, retain_graph: bool = False) -> None:
        """Backpropagate ``score`` to every captured attention output and activation.

        Unlike ``score.backward()`` this reaches every record, also attention whose inputs do
        not depend on the model input (e.g. a decoder's first self-attention over text
        tokens), and it never writes ``.grad`` of parameters or inputs. Gradients accumulate
        like ``.grad`` does (see :meth:`zero_grad`).

        Args:
            score: a scalar (or a tensor, which is summed) computed from the model outputs.
            retain_graph: keep the graph for another backward.

        Raises:
            InputError: ``score`` is not a float tensor.
            CaptureError: gradients were not captured, nothing captured or ``score`` is in no autograd
                graph, or the graph was freed by an earlier backward.
        """
        backward_pass(self, score, retain_graph)

    def zero_grad(self) -> None:
        """Forget captured gradients (each backward through the graph accumulates into them)."""
        zero_grads(self)

    def clear(self) -> None:
        """Forget all records (e.g. between two forwards in one scope; an explanation done with its capture lets go
        of the attention its records hold now, not when the garbage collector finds the recorder's cycle with its
        interceptors)."""
        self._book.clear()
        self._attribution.reset()
        for calls in self.activations.values():
            calls.clear()
        self._gates.clear()
        if self._gate_hooks is not None:
            self._gate_hooks.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return (
            f"Recorder(model={type(self.model).__name__}, records={len(self._records)}, "
            f"grads={self.grads}, active={self._active})"
        )

    # -- hooks ------------------------------------------------------------------------
    def _on_model_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self._thread:  # not this capture's call (its mode is the scope thread's)
            self._other_thread_forwards += 1
            return
        self.forward_count += 1
        candidates: Iterable[Any] = (*args, kwargs.get("pixel_values"), kwargs.get("x"), kwargs.get("images"))
        for value in candidates:
            if isinstance(value, Tensor) and value.dim() == 4 and value.is_floating_point():
                self.input_size = (int(value.shape[-2]), int(value.shape[-1]))
                return

    def _on_root_start(self, module: nn.Module, args: tuple) -> None:
        """The model's forward starts (first of its pre-hooks): in the scope's thread, the outermost one is
        the top-level call of its records, and where narrowing decides (recording/narrowing.py)."""
        if threading.get_ident() != self._thread:
            return
        self._root_depth += 1
        if self._root_depth == 1:
            self._attribution.enter_root()
            self._narrowing.root_started()

    def _on_root_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if threading.get_ident() != self._thread or self._root_depth == 0:
            return
        self._root_depth -= 1
        if self._root_depth == 0:
            self._attribution.exit_root()
            self._narrowing.root_ended(failed=sys.exc_info()[0] is not None)


#: ``vitexplain.recording.capture(model, ...)``: the recorder without model recognition (its
#: ``rec.layout`` needs ``layout_fn``), for code that never reads the layout. The front door,
#: with the arguments documented, is :func:`vitexplain.capture`.
capture = Recorder
