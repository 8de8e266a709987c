"""The model-aware entry points: ``vx.capture`` and ``vx.token_layout``.

:mod:`vitexplain.recording` records attention without knowing any model family, and
:mod:`vitexplain.layout` holds the token layout's geometry; the adapters
(:mod:`vitexplain.adapters`) are the one place a model is recognised. This module joins them:
:func:`capture` is the recorder whose ``rec.layout`` asks the model's adapter
(:func:`token_layout`, defined with :func:`find_layout_module` in :mod:`vitexplain.adapters.base`).
"""

from __future__ import annotations

from typing import Mapping, Sequence, Union

from torch import nn

from .adapters.base import find_layout_module, token_layout
from .recording.custom import Extractor
from .recording.recorder import Recorder

__all__ = ["capture", "token_layout", "find_layout_module"]


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
    Twins, ...) is recorded with them folded into the batch, (B * G, H, N_q, N_k); Hugging
    Face's packed grouped-query decoding steps (query heads passed as rows) are recorded with
    their heads as heads, (B, H, 1, N_k) (see :mod:`vitexplain.recording.packed`). A record's
    ``kind`` is ``"cross"`` when the issuing
    module has ``is_cross_attention=True``, is an ``nn.MultiheadAttention`` called with a
    key that is not its query, received a tensor argument named one of
    ``encoder_hidden_states``, ``key_value_states``, ``memory``, ``context``,
    ``cross_attn_states``, ``cross_attention_states``, ``encoder_out``, or declares a
    ``cross_attention_states`` parameter (Mllama's cross-attention, whose keys come from the
    cache at decoding steps); otherwise ``"self"``. ``record.forward_index`` numbers the
    top-level calls (each forward, each ``generate`` step, an image encoder ``generate`` runs
    first), see :mod:`vitexplain.recording.attribution`.

    Args:
        model: the model whose attention is recorded (only calls issued by its own
            submodules are recorded).
        grads: also capture gradients: after ``backward()`` each record gives
            ``grad_probs()`` (dy/dA) and each activation record its ``grad``.
        activations: module names (as in ``model.named_modules()``) whose inputs and
            outputs are recorded, e.g. ``["blocks.11.norm1"]``. The record keeps the output as the
            module returned it; the model goes on with a copy, so an in-place op after the module
            (``F.relu(x, inplace=True)``) does not change the record.
        attention: set False to record activations only (no attention interception); or a
            dict ``{module name: extractor}`` declaring modules that compute attention their
            own way (additive, multiplicative, local, recurrent decoders), recorded in
            addition to the attention calls above; ``extractor(module, inputs, output)``
            returns an ``AttentionWeights(weights, kind)`` or the weights tensor alone,
            shaped (B, N_k), (B, N_q, N_k) or (B, H, N_q, N_k) (see
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
        A :class:`~vitexplain.recording.Recorder`, to be used as a context manager. Records
        stay readable after the block ends; ``rec.layout`` is :func:`token_layout` of the
        model for the image size it received.
    """
    return Recorder(
        model, grads=grads, activations=activations, attention=attention, gates=gates,
        attention_mode=attention_mode, heads=heads, layout_fn=token_layout,
    )
