"""The torch function mode that sees attention calls: SDPA, 4-D softmax, MHA's functional forward, FlexAttention.

:class:`AttentionMode` observes every ``F.scaled_dot_product_attention`` call (q, k, v, mask,
scale, causal flag) and lets the fused kernel run unchanged, or, when ``attention_mode`` says so,
computes the attention itself and keeps the probabilities (:mod:`vitexplain.recording.materialize`).
It observes 4-D ``softmax`` calls made inside modules (models that compute attention in Python,
e.g. timm with ``fused_attn=False`` or Hugging Face "eager"), and ``nn.MultiheadAttention``'s
functional forward, whose inner SDPA / softmax call it makes visible for the duration of that
call only. Every other torch call goes to the FlexAttention watcher
(:class:`vitexplain.recording.flex.FlexWatcher`) while FlexAttention is imported.

Each call becomes a record handed to a :class:`~vitexplain.recording.sink.RecordSink` (the
recorder), which finds the module that issued it. Gradients: a tensor hook on the SDPA output
captures dO (``dy/dA = dO @ V^T``); on the probabilities for eager and materialized records.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from . import materialize
from .flex import FlexWatcher
from .materialize import attention_with_probs, can_materialize
from .packed import packed_groups, unpack_mask, unpack_query
from .sink import RecordSink, in_backward
from .workspace import workspace_for
from .witness import held, key_witness, kept_mask, query_witness, value_witness, weights_witness

__all__ = ["AttentionMode"]

_SDPA = F.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
_compiling = torch.compiler.is_dynamo_compiling
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _wrapper_codes() -> frozenset[int]:
    """Ids of the code of torch's Python wrappers that torch calls go through (``F.*``, ``torch.functional``,
    ``Tensor`` methods written in Python, ``handle_torch_function``): shared by every caller, so a frame
    of one of them says nothing about which module ran."""
    import torch.functional
    import torch.overrides

    found = {id(torch.overrides.handle_torch_function.__code__)}
    for namespace in (vars(F), vars(torch.functional), vars(torch.Tensor), vars(torch._tensor.Tensor)):
        for value in namespace.values():
            code = getattr(getattr(value, "__func__", value), "__code__", None)
            if code is not None:
                found.add(id(code))
    return frozenset(found)


_TORCH_WRAPPERS = _wrapper_codes()
_SOFTMAX = (torch.softmax, torch.Tensor.softmax, F.softmax, torch.special.softmax)
#: ids of the functions the mode handles itself (module-level objects: their ids are stable)
_WATCHED = frozenset(id(f) for f in (_SDPA, _MHA_FORWARD, *_SOFTMAX))
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _fold(t: Tensor) -> Tensor:
    """(..., H, N, E) with extra leading dims (windows, groups) as (B', H, N, E)."""
    return t if t.dim() <= 4 else t.reshape(-1, *t.shape[-3:])


#: (module, class) of attention modules whose 4-D softmax folds the heads into the batch and puts another axis
#: second: timm's HaloAttn (HaloNet), (B * heads, blocks, block positions, window positions).
_HEADS_FIRST = (("timm.layers.halo_attn", "HaloAttn"),)


def _heads_first(module: nn.Module) -> bool:
    """Whether ``module``'s softmax is laid out (B * heads, other, N_q, N_k), which a record would misread."""
    return (type(module).__module__, type(module).__name__) in _HEADS_FIRST


def _bind_sdpa(args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map SDPA's positional and keyword arguments to names."""
    bound = dict(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    return bound


class AttentionMode(TorchFunctionMode):
    """Routes attention-related torch calls to records; everything else runs as is.

    One mode serves one recorder; it is entered and left with the recorder's scope.

    Args:
        sink: where records go (the recorder).
        flex: the FlexAttention watcher.
        attention_mode: ``"fused"``, ``"materialize"`` or ``"auto"`` (checked by the recorder).
        heads: what materialized records keep (``"all"`` or a head fusion).
    """

    def __init__(self, sink: RecordSink, flex: FlexWatcher, attention_mode: str, heads: str) -> None:
        super().__init__()
        self.sink = sink
        self.flex = flex
        self.attention_mode = attention_mode
        self.heads = heads
        self._materialized_bytes = 0
        #: while not None (set by the recorder's narrowing): the code objects that ran (:meth:`_note`), by id
        #: (the codes are held, so their ids are not reused; generated code can hold unhashable constants)
        self.codes: Optional[dict[int, CodeType]] = None

    @staticmethod
    def _note(caller: FrameType, codes: dict) -> None:
        """Note the code of ``caller`` and of the frames under it, down to the first code noted before.

        A torch call from a new function notes it and its callers not noted yet; most calls cost one
        lookup. Code that made no torch call itself and sits only under noted code (e.g. a container
        whose forward only calls its children) may stay unnoted: narrowing then treats its modules as
        not run, which only intercepts their next call in full.
        """
        frame: Optional[FrameType] = caller
        while frame is not None:
            code = frame.f_code
            if id(code) not in _TORCH_WRAPPERS:  # torch's own wrappers are walked through, not noted
                if codes.get(id(code)) is code:
                    return
                codes[id(code)] = code
            frame = frame.f_back

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        flex = self.flex
        if func is flex.op and func is not None:
            # reached while dynamo traces FlexAttention (eager flex_attention compiles its op, and so
            # does torch.compile): dynamo replays this append with the real arguments on every call
            flex.traced(args)
            return func(*args, **kwargs)
        watched = id(func) in _WATCHED
        if not watched and self.codes is None and flex.code is None:
            return func(*args, **kwargs)  # (narrowed, no FlexAttention imported: nothing to note or watch)
        if not watched and _compiling():
            return func(*args, **kwargs)  # nothing else of the recorder can run while dynamo traces
        try:
            caller: Optional[FrameType] = sys._getframe(1)  # the frame that made the torch call
        except ValueError:  # no Python caller (called from C++)
            caller = None
        codes = self.codes
        if codes is not None and caller is not None:  # discovery (narrowing.py): which code ran
            code = caller.f_code
            if (codes.get(id(code)) is not code or id(code) in _TORCH_WRAPPERS) and not (watched and _compiling()):
                self._note(caller, codes)
        if watched:
            if func is _SDPA:
                return self._on_sdpa(func, args, kwargs, caller)
            if func is _MHA_FORWARD:
                return self._on_mha(func, args, kwargs)
            return self._on_softmax(func, args, kwargs, caller)
        code = flex.code
        if code is not None and caller is not None:
            while caller.f_code.co_name == "__torch_function__" and caller.f_back is not None:
                caller = caller.f_back  # (a mode above this one passed the call down: the frame that made it)
            back = caller.f_back
            # only calls from a flex_attention frame, or while the watcher waits for one, concern it
            if caller.f_code is code or (back is not None and back.f_code is code) or flex._traced \
                    or flex._pending is not None:
                flex.watch(caller, args, kwargs)
        return func(*args, **kwargs)

    # -- SDPA ---------------------------------------------------------------------------
    def _on_sdpa(self, func: Callable, args: tuple, kwargs: dict, caller: Optional[FrameType]) -> Any:
        issuer = self.sink.issuer(caller) if caller is not None else None
        if issuer is None:
            return func(*args, **kwargs)
        # a gradient-checkpointed forward recomputed in a backward pass was recorded when it ran: not again,
        # but a materialized call is computed again as it was (the recomputation must equal the forward)
        again = in_backward()
        if again and self.attention_mode != "materialize":
            return func(*args, **kwargs)
        bound = _bind_sdpa(args, kwargs)
        query, k, v = bound["query"], bound["key"], bound["value"]
        mask = bound.get("attn_mask")
        mask = mask if isinstance(mask, Tensor) else None
        q = query
        out_rows = query.shape[:-1]  # (the output's shape but its last dim)
        gqa = bool(bound.get("enable_gqa", False))
        groups = packed_groups(caller, issuer.frame, q)
        if groups > 1:  # transformers packed the query heads into rows: record them as heads
            q, mask, gqa = unpack_query(q, groups), unpack_mask(mask, groups), True
        if q.dim() < 4 and (q.dim() < 3 or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
            # (N, E) without a batch, or a batch SDPA broadcasts (one query sequence against a batch of keys):
            # q, k and v expanded to one batch (views), so that no record reads a batch dim as heads
            lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
            out_rows = (*lead, q.shape[-2])
            q, k, v = (t.expand(*(lead or (1,)), *t.shape[-2:]) for t in (q, k, v))
        if q.dim() >= 4 and not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
            # leading dims SDPA broadcasts: queries shared by the images, keys shared by the windows (torch's
            # broadcast_shapes costs tens of microseconds a call: only where the dims differ)
            lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
            if q.shape[:-3] != lead:  # (a view: the record's batch is the output's)
                q = q.expand(*lead, *q.shape[-3:])
                out_rows = q.shape[:-1]
            if q.dim() > 4 and (k.shape[:-3] != lead or v.shape[:-3] != lead):  # (folded below: one batch)
                k, v = k.expand(*lead, *k.shape[-3:]), v.expand(*lead, *v.shape[-3:])
        if q.dim() > 4:  # windows or groups as extra leading dims: fold them into the batch
            if mask is not None:
                mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
                mask = _fold(mask.expand(*q.shape[:-3], *mask.shape[-3:]))
            q, k, v = _fold(q), _fold(k), _fold(v)
        dropout_p = float(bound.get("dropout_p", 0.0) or 0.0)
        fields = dict(
            source="sdpa", q_shape=q.shape, k_shape=k.shape, dropout_p=dropout_p, _scale=bound.get("scale"),
            _causal=bool(bound.get("is_causal", False)),
        )
        if q.dim() == 3 and k.dim() == 3 and v.dim() == 3:  # (B, N, E) without heads (SAM folds them into B)
            q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
            mask4 = mask.unsqueeze(-3) if mask is not None and mask.dim() == 3 else mask
        else:
            q4, k4, v4, mask4 = q, k, v, mask
        if not _seen_after(func) and self._materialize(q4, k4, v4, mask4, dropout_p, gqa):
            one_head = q4 is not q
            out, probs = attention_with_probs(
                q4, k4, v4, attn_mask=mask4, scale=fields["_scale"], is_causal=fields["_causal"],
                heads="all" if one_head else self.heads, workspace=workspace_for(getattr(self.sink, "model", None)),
            )
            kept = probs.detach()  # (a call without heads: (B, 1, N_q, N_k), as its recomputed record gives them)
            heads = self.heads if probs.dim() == 3 and not one_head else "all"
            # the probabilities are kept, so the mask (SAM's relative-position bias: as large as
            # the attention itself) is not: the record only notes that the call had one
            fields.update(_mask=None, _masked=mask is not None, materialized=True, heads=heads, _probs=kept)
            if not again and self.sink.grads:
                record = self.sink.add_record(issuer, **fields)
                record._attach_grad_hook(probs, self.sink.hooks_enabled)
            elif not again:  # nothing to hook: the record is made when the records are read
                self.sink.add_draft(issuer, fields)
            return out.reshape(*out_rows, out.shape[-1])
        if again:  # (recomputed by SDPA itself, as the forward was: its record stands)
            return func(*args, **kwargs)
        # the record keeps q, k, v and the mask by reference, with what tells a later in-place write (witness.py)
        fields.update(kept_mask(mask), **query_witness(q), **key_witness(k))
        out = func(*args, **kwargs)
        if self.sink.grads:
            record = self.sink.add_record(issuer, _q=q.detach(), _k=k.detach(), _v=v.detach(), **value_witness(v),
                                          **fields)
            record._attach_grad_hook(out, self.sink.hooks_enabled)
        else:
            self.sink.add_draft(issuer, dict(fields, _q=held(q), _k=held(k)))
        return out

    def _materialize(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, gqa: bool) -> bool:
        """Whether this SDPA call is computed by the capture (see ``attention_mode``)."""
        if self.attention_mode == "fused" or not can_materialize(q, k, v, mask, dropout_p, gqa):
            return False
        if torch.is_grad_enabled() and _saved_tensors_hooks(False) is not None:
            # a non-reentrant torch.utils.checkpoint (saved-tensor hooks): the backward pass recomputes this call
            # outside the capture, as SDPA itself, and torch requires the recomputation to save what the forward did
            return False
        if self.sink.grads and torch.is_grad_enabled() and v.requires_grad and not (q.requires_grad or k.requires_grad):
            return False  # (only v in the graph: P would not be, no dy/dP to hook on it; a fused record takes dO V^T)
        if self.attention_mode == "materialize":
            return True
        if self.sink.grads:  # auto: with a backward pass the fused kernels are faster (materialize.py)
            return False
        size = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * 4
        kept = size // (1 if self.heads == "all" else q.shape[1])
        total = self._materialized_bytes + kept
        if q.device.type != "cpu" or size > materialize.AUTO_CALL_BYTES or total > materialize.AUTO_TOTAL_BYTES:
            return False
        self._materialized_bytes = total
        return True

    # -- softmax ------------------------------------------------------------------------
    def _on_softmax(self, func: Callable, args: tuple, kwargs: dict, caller: Optional[FrameType],
                    heads: Optional[int] = None) -> Any:
        """Record a softmax over the last dim of a (B, H, N_q, N_k) (or more leading dims) tensor, or of a
        (B * H, N_q, N_k) one: ``heads`` H (the call's own ``num_heads`` inside MHA's functional forward), else the
        issuing module's ``num_heads``."""
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor) or out.dim() < 3 or caller is None:
            return out
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if dim not in (-1, out.dim() - 1):
            return out
        issuer = self.sink.issuer(caller)
        if issuer is None or in_backward():  # (in_backward: a checkpointed forward recomputed, recorded before)
            return out
        if _heads_first(issuer.module):  # its 4-D softmax is not (B, heads, N_q, N_k): not recorded as if it were
            self.sink.not_recorded(issuer, f"{type(issuer.module).__name__}'s softmax is laid out (B * heads, blocks, "
                                           "block pixels, halo window pixels) over overlapping key windows, which no "
                                           "record holds")
            return out
        probs = out
        if out.dim() == 3:
            # heads folded into the batch, (B * H, N_q, N_k): nn.MultiheadAttention with need_weights=True, and
            # attention modules written the same way (TrOCR's decoder; SAM's eager vision attention, whose count is
            # num_attention_heads): the MHA call's own num_heads, else an integer num_heads that divides B * H
            if heads is None:
                heads = getattr(issuer.module, "num_heads", None)
            if heads is None:
                heads = getattr(issuer.module, "num_attention_heads", None)
            if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1 or out.shape[0] % heads:
                return out
            probs = out.view(out.shape[0] // heads, heads, *out.shape[1:])
        probs = _fold(probs)  # (B, G, H, N, N) window attention: (B * G, H, N, N)
        b, h, n_q, n_k = probs.shape
        record = self.sink.add_record(
            issuer,
            source="eager",
            q_shape=torch.Size((b, h, n_q, 0)),
            k_shape=torch.Size((b, h, n_k, 0)),
            _probs=probs.detach(),
            **weights_witness(probs),
        )
        if self.sink.grads:
            record._attach_grad_hook(out, self.sink.hooks_enabled)
        return out

    # -- nn.MultiheadAttention ----------------------------------------------------------
    def _on_mha(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Run MHA's functional forward with its inner SDPA/softmax calls visible (see :func:`_mha_taps`)."""
        heads = kwargs.get("num_heads", args[4] if len(args) > 4 else None)
        with _mha_taps(self, heads if isinstance(heads, int) else None):
            return func(*args, **kwargs)


def _seen_after(func: Callable) -> bool:
    """Whether another capture sees this SDPA call after this one (a capture nested in another): then the call
    must run as it is, not be computed by this capture, whose own torch calls (the scores, a softmax per image
    or chunk) the other capture would record in its place. ``func``: what this capture would call next (MHA's
    taps hand an outer capture the next capture's handler, see :func:`_mha_chain`)."""
    if func is not _SDPA:
        return True
    n = torch._C._len_torch_function_stack()  # (this capture's mode is off the stack while it handles the call)
    return any(isinstance(torch._C._get_function_stack_at(i), AttentionMode) for i in range(n))


# nn.MultiheadAttention's functional forward calls ``scaled_dot_product_attention`` / ``softmax`` by their names
# in torch.nn.functional, from inside the mode's own handler (where the mode is off): while at least one capture
# runs such a forward (in any thread), those two names are *taps* that hand the call to the modes running an MHA
# forward in the calling thread and call the original at once for every other thread. Reference counted under a
# lock, so that captures in several threads never save one another's taps as "the original" (which left
# torch.nn.functional patched for good); on the last exit each name that still holds its tap gets its original.
_MHA_NAMES = ("scaled_dot_product_attention", "softmax")
_mha_lock = threading.Lock()
_mha_open = [0]
_mha_installed: dict[str, tuple[Callable, Callable]] = {}  # name -> (original, tap)
_mha_local = threading.local()  # .modes: the AttentionModes running an MHA forward in this thread, innermost first;
#                                 .heads: the num_heads of each one's MHA call (None where not an int)


def _mha_tap(name: str, original: Callable) -> Callable:
    def tap(*args: Any, **kwargs: Any) -> Any:
        modes = getattr(_mha_local, "modes", None)
        if not modes:  # another thread's call, or one outside an MHA forward
            return original(*args, **kwargs)
        return _mha_chain(list(modes), name, original, sys._getframe(1), args, kwargs, _mha_local.heads[-1])

    tap.__wrapped__ = original  # type: ignore[attr-defined]
    return tap


def _mha_chain(modes: list, name: str, original: Callable, caller: FrameType, args: tuple, kwargs: dict,
               heads: Optional[int] = None) -> Any:
    """The call through every mode of ``modes`` (the outermost capture first, the original call innermost);
    ``heads``: the ``num_heads`` of the MHA forward that makes the call (its softmax is (B * heads, N_q, N_k))."""
    mode = modes[-1]
    inner = original if len(modes) == 1 else (
        lambda *a, **kw: _mha_chain(modes[:-1], name, original, caller, a, kw, heads))
    if name == "softmax":
        return mode._on_softmax(inner, args, kwargs, caller, heads)
    return mode._on_sdpa(inner, args, kwargs, caller)


@contextlib.contextmanager
def _mha_taps(mode: "AttentionMode", heads: Optional[int] = None) -> Iterator[None]:
    """Inside, this thread's calls of ``F.scaled_dot_product_attention`` / ``F.softmax`` reach ``mode``, the
    softmax as one of ``heads`` heads (the MHA call's ``num_heads``; the module that made it may not name it so)."""
    with _mha_lock:
        if _mha_open[0] == 0:
            for name in _MHA_NAMES:
                original = getattr(F, name)
                tap = _mha_tap(name, original)
                setattr(F, name, tap)
                _mha_installed[name] = (original, tap)
        _mha_open[0] += 1
    modes = getattr(_mha_local, "modes", None)
    if modes is None:
        modes = _mha_local.modes = []
    stack = getattr(_mha_local, "heads", None)
    if stack is None:
        stack = _mha_local.heads = []
    modes.append(mode)
    stack.append(heads)
    try:
        yield
    finally:
        for i in range(len(modes) - 1, -1, -1):
            if modes[i] is mode:
                del modes[i]
                del stack[i]
                break
        with _mha_lock:
            _mha_open[0] -= 1
            if _mha_open[0] == 0:
                for name, (original, tap) in _mha_installed.items():
                    if getattr(F, name) is tap:
                        setattr(F, name, original)
                _mha_installed.clear()
