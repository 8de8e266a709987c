"""``vx.capture``: a scoped recorder of attention calls that keeps fused attention on.

How it works (see docs/methods.md, "How attention is captured"):

- A :class:`torch.overrides.TorchFunctionMode` observes every
  ``F.scaled_dot_product_attention`` call (q, k, v, mask, scale, causal flag) and lets the
  fused kernel run unchanged. It also observes 4-D ``softmax`` calls made inside modules
  (models that compute attention in Python, e.g. timm with ``fused_attn=False`` or
  Hugging Face "eager"), and ``nn.MultiheadAttention``'s functional forward, whose inner
  SDPA / softmax call it makes visible for the duration of that call only.
- FlexAttention calls are recorded with their ``score_mod`` and ``block_mask`` (see
  :mod:`vitexplain.recording.flex`), and modules declared with an extractor (additive,
  multiplicative, local, recurrent-decoder attention) by a forward hook on each (see
  :mod:`vitexplain.recording.custom`).
- Each call is attributed to the module that issued it by walking the Python stack to the
  nearest frame whose ``self`` is a submodule of the captured model. No hook is put on
  the model for this, and calls from other models are ignored.
- Gradients: a tensor hook on the SDPA output captures dO; ``dy/dA = dO @ V^T``.
- ``attention_mode="materialize"`` (or ``"auto"`` on a CPU) computes
  ``P = softmax(q k^T * scale + mask)`` and ``O = P V`` itself instead of calling the fused
  kernel, keeps P in the record and hooks the gradient on P (see
  :mod:`vitexplain.recording.materialize`): cheaper when every layer's probabilities are read.

Everything the capture changes is restored on exit, also when the block raises: hooks
(only the root's input hook and the optional activation and CNN gate hooks), the MHA
fast-path flag, and the ``torch.compile`` stance.

``torch.compile``: a compiled model (an ``OptimizedModule``) is unwrapped (``_orig_mod``) and
recorded as the original module; inside the scope the compiler's stance is ``"force_eager"``,
so calling the compiled model runs the original module eagerly (every attention call is
seen, the maps equal the uncompiled model's) and nothing is compiled or recompiled. The
compiled code is reused unchanged after the scope.
The model's ``training`` flags, ``fused_attn`` flags, ``requires_grad`` and ``.grad`` are
never touched.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..errors import CaptureError, InputError, NoAttentionError
from .custom import Extractor, ModuleInputs, as_weights, declared_modules, in_graph, is_inside
from .flex import FlexRecording, flex_code, flex_op, traced_call
from .gates import GateHooks, GateRecord, checked_gates
from . import materialize
from .materialize import attention_with_probs, can_materialize, check_heads, check_mode
from .records import ActivationRecord, AttentionRecord, weak_grad_hook

__all__ = ["capture", "Recorder"]

_SDPA = F.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
_SOFTMAX = (torch.softmax, torch.Tensor.softmax, F.softmax, torch.special.softmax)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# Argument names that, when a tensor is passed, mean the keys come from another sequence.
CROSS_ARGUMENT_NAMES = (
    "encoder_hidden_states",
    "key_value_states",
    "memory",
    "context",
    "cross_attn_states",
    "encoder_out",
)

SUPPORTED = (
    "torch.nn.functional.scaled_dot_product_attention (timm ViT/DeiT/EVA/BEiT/Swin, "
    "torchvision, Hugging Face attn_implementation='sdpa'), FlexAttention, attention modules "
    "that compute softmax(q k^T) in Python (timm fused_attn=False, Hugging Face 'eager'), "
    "nn.MultiheadAttention / nn.Transformer* layers, and modules declared with "
    "vx.capture(model, attention={name: extractor}) or vx.recording.register_attention"
)


def _fold(t: Tensor) -> Tensor:
    """(..., H, N, E) with extra leading dims (windows, groups) as (B', H, N, E)."""
    return t if t.dim() <= 4 else t.reshape(-1, *t.shape[-3:])


def _bind_sdpa(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map SDPA's positional and keyword arguments to names."""
    bound = dict(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


class _AttentionMode(TorchFunctionMode):
    """Routes attention-related torch calls to the recorder; everything else runs as is."""

    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
        self.recorder = recorder
        self.flex = flex_code()  # None unless FlexAttention was imported
        self.flex_op = flex_op()
        self.flex_calls: list[tuple] = []  # appended while dynamo traces FlexAttention's op, see _watch_flex

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if func is _SDPA:
            return self.recorder._on_sdpa(func, args, kwargs)
        if func in _SOFTMAX:
            return self.recorder._on_softmax(func, args, kwargs)
        if func is _MHA_FORWARD:
            return self.recorder._on_mha(func, args, kwargs)
        if func is self.flex_op and self.flex_op is not None:
            # reached while dynamo traces FlexAttention (eager flex_attention compiles its op, and so
            # does torch.compile): dynamo replays this append with the real arguments on every call
            self.flex_calls.append(traced_call(args))
            return func(*args, **kwargs)
        # nothing else of the recorder can run while dynamo traces
        if self.flex is not None and not torch.compiler.is_dynamo_compiling():
            self.recorder._watch_flex(self.flex, args, kwargs)
        return func(*args, **kwargs)


class Recorder(FlexRecording):
    """Records the attention calls (and optionally activations) of one model.

    Use through :func:`capture`. After the forward, ``rec.records`` lists one
    :class:`AttentionRecord` per attention call in call order; ``rec.layout`` gives the
    token layout of the image input; ``rec.activations[name]`` the recorded module calls.

    Attributes:
        model: the captured model.
        grads: whether gradients w.r.t. attention (and activations) are captured.
        attention_mode: ``"fused"``, ``"materialize"`` or ``"auto"`` (see :func:`capture`).
        input_size: (H, W) of the last image tensor the model received, if any.
        forward_count: how many times the model's own forward ran inside the scope.
    """

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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputError(f"vx.capture expects an nn.Module, got {type(model).__name__}")
        from ..adapters.base import unwrap_compiled

        self.model = unwrap_compiled(model)
        self._compiled = self.model is not model
        self.grads = bool(grads)
        self.attention = bool(attention) or isinstance(attention, Mapping)
        self._extractors: dict[str, Extractor] = dict(attention) if isinstance(attention, Mapping) else {}
        self._declared: dict[str, tuple[nn.Module, Extractor]] = {}
        self.attention_mode = check_mode(attention_mode)
        self.heads = check_heads(heads)
        self._materialized_bytes = 0
        self.activation_names = tuple(activations)
        self.capture_gates = bool(gates)
        self.input_size: Optional[tuple[int, int]] = None
        self.forward_count = 0
        self._records: list[AttentionRecord] = []
        self._steps: dict[str, int] = {}
        self.activations: dict[str, list[ActivationRecord]] = {n: [] for n in self.activation_names}
        self._gates: list[GateRecord] = []
        self._gate_hooks: Optional[GateHooks] = None
        self._names: dict[int, str] = {}
        self._handles: list[RemovableHandle] = []
        self._mode: Optional[_AttentionMode] = None
        self._fastpath: Optional[bool] = None
        self._stance: Any = None
        self._active = False
        self._in_backward = False
        self._flex_unattributed = 0
        self._flex_frame: Optional[FrameType] = None
        self._flex_pending: Optional[tuple[AttentionRecord, tuple[Tensor, Tensor, Tensor]]] = None

    # -- context manager --------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if self._active:
            raise CaptureError("this recorder is already active; create a new vx.capture(...)")
        modules = dict(self.model.named_modules())
        missing = [n for n in self.activation_names if n not in modules]
        if missing:
            raise CaptureError(
                f"no module named {missing} in {type(self.model).__name__}; module names "
                f"look like {list(modules)[1:6]} (see model.named_modules())"
            )
        self._names = {id(m): n for n, m in modules.items()}
        try:
            if self._compiled or any(hasattr(m, "_orig_mod") for m in modules.values()):
                # torch.compile-d: run the original modules eagerly inside the scope (so every
                # attention call is seen), without touching the compiled code's cache
                self._stance = torch.compiler.set_stance("force_eager")
            self._handles.append(
                self.model.register_forward_pre_hook(self._on_model_input, with_kwargs=True)
            )
            for name in self.activation_names:
                self._handles.append(
                    modules[name].register_forward_hook(self._activation_hook(name), with_kwargs=True)
                )
            if self.capture_gates:
                self._gate_hooks = GateHooks(self.model, self._gates)
                self._handles.extend(self._gate_hooks.register())
            if self.attention:
                self._declared = declared_modules(self.model, self._extractors)
                for name, (module, extractor) in self._declared.items():
                    self._handles.append(
                        module.register_forward_hook(self._module_hook(name, extractor), with_kwargs=True)
                    )
                if hasattr(torch.backends, "mha") and hasattr(torch.backends.mha, "get_fastpath_enabled"):
                    self._fastpath = torch.backends.mha.get_fastpath_enabled()
                    torch.backends.mha.set_fastpath_enabled(False)
                self._mode = _AttentionMode(self)
                self._mode.__enter__()
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore()
        return None  # never swallow exceptions

    def _restore(self) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._count_unattributed_flex(self._mode.flex_calls)
        finally:
            self._mode = None
            self._flex_frame = self._flex_pending = None
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self._fastpath is not None:
                torch.backends.mha.set_fastpath_enabled(self._fastpath)
                self._fastpath = None
            if self._stance is not None:
                self._stance.__exit__(None, None, None)
                self._stance = None
            self._active = False

    # -- results ----------------------------------------------------------------------
    @property
    def records(self) -> list[AttentionRecord]:
        """All attention records, in call order.

        Raises:
            NoAttentionError: no attention call was seen (no forward ran, or the model
                has no attention this capture can observe).
            CaptureError: a compiled FlexAttention call could not be attributed to a module.
        """
        self._check_flex_attributed()
        if not self._records:
            cls = type(self.model).__name__
            if self.forward_count == 0:
                raise NoAttentionError(
                    f"no forward of {cls} ran inside vx.capture(...): call the model inside "
                    "the `with` block, e.g. `with vx.capture(model) as rec: model(x)`"
                )
            raise NoAttentionError(
                f"no attention call was seen during the forward of {cls}. vitexplain "
                f"captures {SUPPORTED}. If {cls} is a CNN, use the CNN methods "
                "('gradcam', 'spatial', 'channel'); if it is TorchScript, capture the original "
                "nn.Module (torch.compile-d models are handled)."
            )
        return list(self._records)

    def select(
        self, *, kind: Optional[str] = None, prefix: Optional[str] = None, step: Optional[int] = None
    ) -> list[AttentionRecord]:
        """Records filtered by kind (``"self"``/``"cross"``), module-name prefix and step."""
        return [
            r
            for r in self.records
            if (kind is None or r.kind == kind)
            and (prefix is None or r.name == prefix or r.name.startswith(prefix + "."))
            and (step is None or r.step == step)
        ]

    @property
    def layout(self) -> "Any":
        """Token layout (prefix tokens, patch grid) of the model for the recorded input size.

        Returns:
            a :class:`vitexplain.layout.TokenLayout`.
        """
        from ..layout import token_layout

        if self.input_size is None:
            raise CaptureError(
                "no image tensor (B, C, H, W) reached the model's forward inside the capture, "
                "so the patch grid is unknown; call vx.token_layout(model, (H, W)) directly"
            )
        return token_layout(self.model, self.input_size)

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

    def _hooks_collect(self) -> bool:
        return not self._in_backward

    def backward(self, score: Tensor, *, retain_graph: bool = False) -> None:
        """Backpropagate ``score`` to every captured attention output and activation.

        Unlike ``score.backward()`` this reaches every record, also attention whose inputs do
        not depend on the model input (e.g. a decoder's first self-attention over text
        tokens), and it never writes ``.grad`` of parameters or inputs. Gradients accumulate
        like ``.grad`` does (see :meth:`zero_grad`).

        Args:
            score: a scalar (or a tensor, which is summed) computed from the model outputs.
            retain_graph: keep the graph for another backward.
        """
        if not self.grads:
            raise CaptureError("gradients were not captured: use vx.capture(model, grads=True)")
        targets: list[tuple[Any, Tensor]] = [(r, r._out) for r in self._records if r._out is not None]
        targets += [(a, a.output) for calls in self.activations.values() for a in calls if a.output.requires_grad]
        if not targets:
            raise CaptureError(
                "nothing captured is part of an autograd graph (the forward ran under torch.no_grad(), or "
                "neither the input nor any parameter requires grad)"
            )
        self._in_backward = True
        try:
            grads = torch.autograd.grad(
                score.sum(), [t for _, t in targets], retain_graph=retain_graph, allow_unused=True
            )
        finally:
            self._in_backward = False
        for (obj, tensor), grad in zip(targets, grads):
            obj._add_grad(grad if grad is not None else torch.zeros_like(tensor))

    def zero_grad(self) -> None:
        """Forget captured gradients (each backward through the graph accumulates into them)."""
        for record in self._records:
            record._grad_out = record._grad_probs = None
        for calls in self.activations.values():
            for call in calls:
                call.grad = None

    def clear(self) -> None:
        """Forget all records (e.g. between two forwards in one scope)."""
        self._records.clear()
        self._steps.clear()
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
        self.forward_count += 1
        candidates: Iterable[Any] = (*args, kwargs.get("pixel_values"), kwargs.get("x"), kwargs.get("images"))
        for value in candidates:
            if isinstance(value, Tensor) and value.dim() == 4 and value.is_floating_point():
                self.input_size = (int(value.shape[-2]), int(value.shape[-1]))
                return

    def _activation_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(out, Tensor):
                return
            inp = next((a for a in args if isinstance(a, Tensor)), None)
            record = ActivationRecord(
                name=name, step=len(self.activations[name]), input=inp, output=out, args=args,
                kwargs=dict(kwargs), tuple_output=out is not output,
            )
            if self.grads and out.requires_grad:
                out.register_hook(weak_grad_hook(record, self._hooks_collect))
            self.activations[name].append(record)

        return hook

    # -- attribution --------------------------------------------------------------------
    def _issuer(self, start: Optional[FrameType] = None) -> Optional[tuple[str, nn.Module, FrameType]]:
        """The innermost captured module on the Python stack (from ``start``), with its frame."""
        frame: Optional[FrameType] = start or sys._getframe(2)
        names = self._names
        while frame is not None:
            obj = frame.f_locals.get("self")
            if obj is not None:
                name = names.get(id(obj))
                # an nn.Softmax submodule is a tool of the attention module, not the issuer
                if name is not None and isinstance(obj, nn.Module) and not isinstance(obj, nn.Softmax):
                    return name, obj, frame
            frame = frame.f_back
        return None

    @staticmethod
    def _kind(module: nn.Module, frame: FrameType) -> str:
        flag = getattr(module, "is_cross_attention", None)
        if isinstance(flag, bool):
            return "cross" if flag else "self"
        local = frame.f_locals
        if isinstance(module, nn.MultiheadAttention):
            query, key = local.get("query"), local.get("key")
            return "cross" if isinstance(key, Tensor) and key is not query else "self"
        for arg in CROSS_ARGUMENT_NAMES:
            if isinstance(local.get(arg), Tensor):
                return "cross"
        return "self"

    def _new_record(self, name: str, kind: str, record_type: type = AttentionRecord, **fields: Any) -> AttentionRecord:
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        record = record_type(name=name, kind=kind, index=len(self._records), step=step, **fields)
        self._records.append(record)
        return record

    def _attention_issuer(self, start: Optional[FrameType] = None) -> Optional[tuple[str, nn.Module, FrameType]]:
        """The issuer of an SDPA/softmax call, or None when it is not recorded there.

        Calls from outside the model and calls inside a module whose attention an extractor
        declares (that module's record replaces them) are not recorded.
        """
        issuer = self._issuer(start or sys._getframe(3))
        if issuer is None or (self._declared and is_inside(issuer[0], self._declared)):
            return None
        return issuer

    # -- interception -------------------------------------------------------------------
    def _on_sdpa(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        issuer = self._attention_issuer()
        if issuer is None:
            return func(*args, **kwargs)
        bound = _bind_sdpa(args, kwargs)
        query, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        q = query
        name, module, frame = issuer
        if q.dim() > 4:  # windows or groups as extra leading dims: fold them into the batch
            if isinstance(mask, Tensor):
                mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
                mask = _fold(mask.expand(*q.shape[:-3], *mask.shape[-3:]))
            q, k, v = _fold(q), _fold(k), _fold(v)
        mask = mask if isinstance(mask, Tensor) else None
        dropout_p = float(bound.get("dropout_p", 0.0) or 0.0)
        fields = dict(
            source="sdpa", q_shape=q.shape, k_shape=k.shape, dropout_p=dropout_p,
            _mask=mask.detach() if mask is not None else None, _scale=bound.get("scale"),
            _causal=bool(bound.get("is_causal", False)),
        )
        kind = self._kind(module, frame)
        if self._materialize(q, k, v, mask, dropout_p, bool(bound.get("enable_gqa", False))):
            out, probs = attention_with_probs(
                q, k, v, attn_mask=mask, scale=fields["_scale"], is_causal=fields["_causal"], heads=self.heads
            )
            heads = self.heads if probs.dim() == 3 else "all"
            record = self._new_record(name, kind, materialized=True, heads=heads, _probs=probs.detach(), **fields)
            if self.grads:
                record._attach_grad_hook(probs, self._hooks_collect)
            return out.view(*query.shape[:-1], out.shape[-1])
        out = func(*args, **kwargs)
        record = self._new_record(name, kind, _q=q.detach(), _k=k.detach(), **fields)
        if self.grads:
            record._v = v.detach()
            record._attach_grad_hook(out, self._hooks_collect)
        return out

    def _materialize(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, gqa: bool) -> bool:
        """Whether this SDPA call is computed by the capture (see ``attention_mode``)."""
        if self.attention_mode == "fused" or not can_materialize(q, k, v, mask, dropout_p, gqa):
            return False
        if self.attention_mode == "materialize":
            return True
        if self.grads:  # auto: with a backward pass the fused kernels are faster (materialize.py)
            return False
        size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4
        kept = size // (1 if self.heads == "all" else q.shape[1])
        total = self._materialized_bytes + kept
        if q.device.type != "cpu" or size > materialize.AUTO_CALL_BYTES or total > materialize.AUTO_TOTAL_BYTES:
            return False
        self._materialized_bytes = total
        return True

    def _on_softmax(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor) or out.dim() < 3:
            return out
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim not in (-1, out.dim() - 1):
            return out
        issuer = self._attention_issuer()
        if issuer is None:
            return out
        name, module, frame = issuer
        probs = out
        if out.dim() == 3:
            # nn.MultiheadAttention with need_weights=True: (B * H, N_q, N_k)
            if not isinstance(module, nn.MultiheadAttention):
                return out
            heads = module.num_heads
            probs = out.view(out.shape[0] // heads, heads, *out.shape[1:])
        probs = _fold(probs)  # (B, G, H, N, N) window attention: (B * G, H, N, N)
        b, h, n_q, n_k = probs.shape
        record = self._new_record(
            name,
            self._kind(module, frame),
            source="eager",
            q_shape=torch.Size((b, h, n_q, 0)),
            k_shape=torch.Size((b, h, n_k, 0)),
            _probs=probs.detach(),
        )
        if self.grads:
            record._attach_grad_hook(out, self._hooks_collect)
        return out

    def _module_hook(self, name: str, extractor: Extractor) -> Callable:
        """A forward hook recording the weights ``extractor`` reads from a declared module."""

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            inputs = ModuleInputs(args, kwargs)
            checked = as_weights(extractor(module, inputs, output), name)
            if checked is None:
                return
            weights, view, kind = checked
            b, h, n_q, n_k = view.shape
            record = self._new_record(
                name,
                kind,
                source="module",
                q_shape=torch.Size((b, h, n_q, 0)),
                k_shape=torch.Size((b, h, n_k, 0)),
                _probs=view.detach(),
            )
            if self.grads:
                if weights.requires_grad and not in_graph(weights, output, inputs):
                    record._grad_state = "not_in_graph"
                else:
                    record._attach_grad_hook(weights, self._hooks_collect)

        return hook

    def _on_mha(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run MHA's functional forward with its inner SDPA/softmax calls visible."""
        original_sdpa, original_softmax = F.scaled_dot_product_attention, F.softmax

        def sdpa(*a: Any, **kw: Any) -> Any:
            return self._on_sdpa(original_sdpa, a, kw)

        def softmax(*a: Any, **kw: Any) -> Any:
            return self._on_softmax(original_softmax, a, kw)

        F.scaled_dot_product_attention, F.softmax = sdpa, softmax
        try:
            return func(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention, F.softmax = original_sdpa, original_softmax


def capture(
    model: nn.Module,
    *,
    grads: bool = False,
    activations: Sequence[str] = (),
    attention: Union[bool, Mapping[str, Extractor]] = True,
    gates: bool = False,
    attention_mode: str = "fused",
    heads: str = "all",
) -> Recorder:
    """Record every attention call of ``model`` while it runs its fused attention.

    Example::

        with vx.capture(model) as rec:
            logits = model(x)                 # x: (B, 3, H, W)
        rec.records[-1].probs()               # (B, heads, N_q, N_k) float32

    Attention is observed at ``F.scaled_dot_product_attention`` (the fused kernel keeps
    running), at FlexAttention calls (eager or ``torch.compile``-d ``flex_attention``), at
    softmax calls of modules that compute attention in Python, inside
    ``nn.MultiheadAttention`` (whose C++ fast path is switched off inside the scope only,
    so its SDPA call is visible), and at the modules declared through ``attention=``. Attention
    computed with extra leading dimensions (windows or groups: (B, G, H, N_q, N_k) in MaxViT,
    Twins, ...) is recorded with them folded into the batch, (B * G, H, N_q, N_k). A record's
    ``kind`` is ``"cross"`` when the issuing
    module has ``is_cross_attention=True``, is an ``nn.MultiheadAttention`` called with a
    key that is not its query, or received a tensor argument named one of
    ``encoder_hidden_states``, ``key_value_states``, ``memory``, ``context``,
    ``cross_attn_states``, ``encoder_out``; otherwise ``"self"``.

    Args:
        model: the model whose attention is recorded (only calls issued by its own
            submodules are recorded).
        grads: also capture gradients: after ``backward()`` each record gives
            ``grad_probs()`` (dy/dA) and each activation record its ``grad``.
        activations: module names (as in ``model.named_modules()``) whose inputs and
            outputs are recorded, e.g. ``["blocks.11.norm1"]``.
        attention: set False to record activations only (no attention interception); or a
            dict ``{module name: extractor}`` declaring modules that compute attention their
            own way (additive, multiplicative, local, recurrent decoders), recorded in
            addition to the attention calls above; ``extractor(module, inputs, output)``
            returns an ``AttentionWeights(weights, kind)`` (see
            ``vitexplain.recording.custom``). Modules of a class registered with
            ``vx.recording.register_attention`` are declared without naming them.
        gates: record the gates of CNN attention modules (SE, ECA, CBAM, ...) in
            ``rec.gates``, see ``vitexplain.recording.gates``.
        attention_mode: ``"fused"`` (default): the fused SDPA kernel runs and probabilities
            are recomputed on demand, nothing N x N is kept. ``"materialize"``: the capture
            computes ``P = softmax(q k^T * scale + mask)`` and ``O = P V`` itself for every
            float32 call without dropout, keeps P in the record (``record.materialized``) and,
            with ``grads``, takes dy/dP from the backward pass: cheaper on a CPU when every
            layer's probabilities are read (the model's outputs equal the fused kernel's to
            float32 rounding). ``"auto"``: materialise on a CPU, without gradients, while the
            probabilities kept stay small (see :mod:`vitexplain.recording.materialize`), fused otherwise.
        heads: what materialized records keep without gradients: ``"all"`` heads (default),
            or only their ``"mean"``, ``"max"`` or ``"min"`` (H times less memory; then
            ``record.probs()`` raises and ``record.fused_probs(heads)`` works). With
            ``grads`` every head is kept (the backward pass needs them).

    Returns:
        A :class:`Recorder`, to be used as a context manager. Records stay readable
        after the block ends.
    """
    return Recorder(
        model, grads=grads, activations=activations, attention=attention, gates=gates,
        attention_mode=attention_mode, heads=heads,
    )
