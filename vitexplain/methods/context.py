"""The input of every method: one captured forward (and backward) of one batch.

Methods are functions ``fn(ctx, **options) -> maps`` that return (B, gh, gw) float32 maps on the
model's device. Most only read what the capture recorded (attention records, activations,
gradients in ``ctx.recorder``, whose hooks live for the capture's scope). A few re-run part of
the model and put a hook of their own on it for that call; each removes it in a ``finally``
block, so the model is left as found also when the re-run raises:

- ``cdam_smooth`` and ``cdam_integrated`` (ViTs): a forward hook on the last block's first norm,
  to read (smooth) or replace (integrated) its output while the last block and head run on noisy
  or interpolated inputs (``tokens._norm1_output``);
- ``cdam``, ``gradcam``, ``cdam_smooth`` and ``cdam_integrated`` of the Swin family: a forward
  pre-hook on the last block's attention module, which makes its input a leaf tensor (or
  replaces it) while the last block and head are re-run (``swin._attention_input``);
- the CNN ``gradcam``: captum's ``LayerGradCam`` runs its own forward and backward with a forward
  hook on the chosen layer, which captum removes in its own ``finally``.

The captum-backed ``integrated_gradients``, ``occlusion`` and ``smoothgrad`` run the model on
perturbed inputs without hooks. No method changes training flags, ``requires_grad`` or ``.grad``
of the model's parameters (``tests/test_registry.py`` checks every registered method, also after
an exception inside the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor

from ..checks import differentiable, training_layers
from ..recording import AttentionRecord, Recorder
from ..errors import OptionError, UnsupportedMethodError, UnsupportedModelError
from ..layout import TokenLayout
from ..targets import Target

__all__ = [
    "Context", "CaptionContext", "query_blocks", "live_blocks", "nonzero_rows", "readout_vector", "DEFAULT_BLOCK_BYTES", "PARTIAL_RTOL",
]

#: Budget for one block of recomputed probabilities (B x H x rows x N float32).
DEFAULT_BLOCK_BYTES = 32 * 2**20

#: How closely a re-run part of the model must reproduce its outputs: max abs error relative
#: to the largest output magnitude.
PARTIAL_RTOL = 1e-4


@dataclass
class Context:
    """One explained batch.

    Attributes:
        adapter: the model adapter (see ``vitexplain.adapters``).
        x: (B, 3, H, W) preprocessed input, the tensor the model saw.
        outputs: the model outputs of the explained forward.
        target: the resolved target (classes and score function).
        recorder: the capture of that forward (records, activations, grads if asked).
        layout: token layout for ViTs, None for CNNs.
        method: the method being computed (for error messages).
        shared: ``(rules, scores)`` when the explained forward and its (B,) target scores ran
            under the method's ``forward_rules`` (the method alone in a call; ``x`` requires grad):
            the method differentiates those scores instead of running the model again.
    """

    adapter: Any
    x: Tensor
    outputs: Any
    target: Target
    recorder: Recorder
    layout: Optional[TokenLayout] = None
    method: str = ""
    shared: Optional[tuple[Any, Tensor]] = None
    _checked: dict = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.x.shape[0])

    def model_module(self, name: str) -> torch.nn.Module:
        """A submodule of the explained model by name."""
        return self.adapter.model.get_submodule(name)

    def score(self, outputs: Any) -> Tensor:
        """The (B,) target scores of some model outputs (same targets as the explanation).

        With gradients enabled (a method about to differentiate them) a score detached from the
        outputs is refused; without (occlusion) any score is taken.

        Raises:
            TargetError: gradients are enabled and the score does not depend on the outputs.
        """
        return differentiable(self.target.score(outputs))

    def tail(self) -> Callable[[Tensor], Tensor]:
        """The adapter's ``tail``: the model's outputs from the stream entering its last block.

        Returns ``fn(u) -> outputs`` for (B', N, D) inputs of ``adapter.norm1`` (B' any
        multiple of B), after checking once per method call that it reproduces the model's
        own outputs (see :meth:`partial`).
        """
        adapter = self.adapter
        call = self.recorder.activation(adapter.blocks[-1])
        stream = self.recorder.activation(adapter.norm1).input
        return self.partial("tail", lambda tokens: adapter.tail(tokens, call), stream)

    def head(self) -> Callable[[Tensor], Tensor]:
        """The adapter's ``head`` on a block's output tokens, checked like :meth:`tail`."""
        tokens = self.recorder.activation(self.adapter.blocks[-1]).output
        return self.partial("head", self.adapter.head, tokens)

    def partial(self, what: str, fn: Callable[[Tensor], Tensor], tokens: Tensor) -> Callable[[Tensor], Tensor]:
        """``fn``, once it is shown to reproduce the model's outputs from ``tokens``.

        The one place where every partial forward is checked: ``fn`` runs on the captured
        ``tokens`` repeated twice along the batch (so arguments that it passes again must not
        depend on the batch size) and must give the explained forward's outputs to
        :data:`PARTIAL_RTOL` relative to their largest magnitude. Checked once per method call.

        Raises:
            UnsupportedModelError: it does not (the method's maps would be wrong).
        """
        if what in self._checked:
            return fn
        reason = _mismatch(self.outputs, fn, tokens)
        if reason is not None:
            model = type(self.adapter.model).__name__
            training = training_layers(self.adapter.model, random_only=True)
            if training:  # (dropout / drop path draw again in the re-run: the cause, and what to do)
                raise UnsupportedModelError(
                    f"method {self.method!r} re-runs part of {model} ({what}), but that partial forward does not "
                    f"reproduce the model's own outputs ({reason}): the model is in training mode, and its "
                    f"{', '.join(training[:3])}{', ...' if len(training) > 3 else ''} draw again in each forward; "
                    "call model.eval() first")
            raise UnsupportedModelError(
                f"method {self.method!r} re-runs part of {model} ({what}: {self.adapter.describe()}), "
                f"but that partial forward does not reproduce the model's own outputs: {reason}. "
                "Its maps would be wrong, so none are returned; use a method that reads the "
                "explained forward only (e.g. 'generic', 'rollout', 'integrated_gradients'; for "
                "ViTs also 'cdam', 'gradcam'), or give "
                "vx.Explainer(model, adapter=...) an adapter whose tail/head match the model "
                "(is the model in eval mode?)"
            )
        self._checked[what] = True
        return fn

    def require_grid(self, *, rollout: bool = False) -> TokenLayout:
        """The layout, or a clear error when the method needs a single patch grid."""
        layout = self.layout
        if layout is None:
            raise UnsupportedMethodError(f"method {self.method!r} needs a ViT token layout")
        if layout.windowed and (rollout or layout.grid is None):
            alternatives = "'cdam', 'gradcam', 'integrated_gradients', 'occlusion'"
            what = "rollout across layers" if rollout else "a single patch grid"
            raise UnsupportedMethodError(
                f"method {self.method!r} needs {what}, but this model uses windowed "
                f"attention (Swin-style); use gradient-on-token methods instead: {alternatives}"
            )
        return layout

    def readout(self, layout: TokenLayout, *, fusion: str = "mean", weighting: Optional[str] = None) -> Tensor:
        """The readout row v (B, N) that the attention methods carry through the layers.

        ``"class"``, ``"prefix"`` and ``"mean"`` readouts: :func:`readout_vector`. ``"pool"`` (an attention-pooling head,
        ``adapter.pool_attention``, e.g. SigLIP's MAP): the head's learned query attends over the final tokens
        and its output is that attention's weighted sum of them, so its attention row, as recorded in the
        explained forward, is the readout: heads fused with ``fusion`` and normalised to sum to 1 (raw, rollout,
        attention Grad-CAM); ``weighting="generic"``: Chefer's ``mean_h(clamp(dy/dA * A, 0))`` of that row, as
        his rule gives the query's relevance row (not normalised); ``weighting="rollout"``: gradient rollout's ``clamp(mean_h(A * dy/dA), 0)`` of that row normalised to
        sum to 1 (its ``rownorm`` of a layer without a residual). Several latent queries (timm ``pool='avg'``) are averaged; with ``pool='token'``
        (``adapter.pool_query`` = 0) the first is read.

        Raises:
            UnsupportedMethodError: the pooling head issued no attention call in the forward.
        """
        if layout.readout != "pool":
            return readout_vector(layout, self.batch_size, self.x.device)
        name = self.adapter.pool_attention
        found = _issued_by(self.recorder.records, name)
        if not found:
            raise UnsupportedMethodError(
                f"method {self.method!r} reads the attention of the model's pooling head {name!r}, which issued "
                "no attention call during the forward")
        record = found[-1]
        query = getattr(self.adapter, "pool_query", None)
        rows = slice(0, 1) if query == 0 else slice(0, record.num_queries)
        if weighting is None:
            row = record.fused_probs(fusion, rows).float().mean(dim=1)  # type: ignore[arg-type]
        else:
            weighted = record.probs(rows) * record.grad_probs(rows)  # (B, H, Q, N)
            fused = weighted.clamp(min=0).mean(dim=1) if weighting == "generic" else weighted.mean(dim=1).clamp(min=0)
            row = fused.float().mean(dim=1)
        row = self._pool_keys(row, layout, name)
        if weighting == "generic":
            return row
        total = row.sum(dim=-1, keepdim=True)
        return torch.where(total > 0, row / total.clamp(min=torch.finfo(row.dtype).tiny), torch.zeros_like(row))

    def _pool_keys(self, row: Tensor, layout: TokenLayout, name: str) -> Tensor:
        """The pooling head's (B, N_k) attention row over the sequence's (B, N) tokens: a head that attends over the
        patch tokens only (timm's ``pool_include_prefix=False``, its default: the prefix tokens are dropped before
        the head) gives the prefix tokens zero weight.

        Raises:
            UnsupportedMethodError: the head's keys are neither every token nor the patch tokens.
        """
        keys, tokens = int(row.shape[-1]), layout.num_tokens
        if keys == tokens:
            return row
        if keys == layout.num_patches:
            return torch.nn.functional.pad(row, (layout.num_prefix_tokens, 0))
        raise UnsupportedMethodError(
            f"method {self.method!r} reads the attention of the model's pooling head {name!r}, whose {keys} keys are "
            f"neither the sequence's {tokens} tokens nor its {layout.num_patches} patch tokens; use a method that reads "
            "no attention (e.g. 'cdam', 'gradcam', 'integrated_gradients')")

    def layers(self, start: int = 0) -> list[AttentionRecord]:
        """The self-attention records of the model's blocks, input side first, from block ``start``.

        One record per block from the last forward; a clear error when a block did not
        issue exactly one self-attention call in it, the sequence does not fit the layout, or
        ``start`` (the ``start_layer`` option) is not a block of this model.
        """
        blocks = getattr(self.adapter, "blocks", None) or []
        records = [r for r in self.recorder.records if r.kind == "self"]
        if blocks:
            by_block: list[AttentionRecord] = []
            for block in blocks:
                inside = _issued_by(records, block)
                if not inside:
                    raise UnsupportedMethodError(
                        f"block {block!r} issued no attention call during the forward; "
                        f"method {self.method!r} needs one per block"
                    )
                last = max(r.forward_index for r in inside)
                inside = [r for r in inside if r.forward_index == last]
                if len(inside) > 1:  # (a parallel-branch or differential block: which call is "the" layer?)
                    raise UnsupportedMethodError(
                        f"block {block!r} issued {len(inside)} self-attention calls in one forward "
                        f"({', '.join(sorted({r.name for r in inside}))}); method {self.method!r} reads one "
                        f"attention matrix per block and cannot tell how this block combines them. Use a "
                        f"gradient method (e.g. 'gradcam'), or capture the calls with vx.capture(model) and "
                        f"combine them yourself"
                    )
                by_block.append(inside[0])
            records = by_block
        layout = self.require_grid(rollout=True)
        for record in records:
            layout.check(record.num_keys)
            if record.batch_size != self.x.shape[0]:
                raise UnsupportedModelError(
                    f"the attention recorded for {record.name!r} holds {record.batch_size} sequences for "
                    f"{self.x.shape[0]} images (heads folded into the batch?); method {self.method!r} needs one per "
                    "image: an attention extractor must return (B, N_q, N_k) or (B, H, N_q, N_k) weights"
                )
        if start and not 0 <= start < len(records):  # (the option is declared non-negative: no index from the end)
            raise OptionError(
                f"{self.method} option 'start_layer' must be in [0, {len(records) - 1}] for this model "
                f"({len(records)} layers); got {start}"
            )
        return records[start:]


def _issued_by(records: list[AttentionRecord], module: str) -> list[AttentionRecord]:
    """The records issued by module ``module`` or one of its submodules, in call order."""
    return [r for r in records if r.name == module or r.name.startswith(module + ".")]


def _mismatch(outputs: Any, fn: Callable[[Tensor], Tensor], tokens: Tensor) -> Optional[str]:
    """Why ``fn`` on ``tokens`` (repeated twice along the batch) does not give ``outputs``
    (repeated likewise) to :data:`PARTIAL_RTOL`, or None when it does. An exception raised by
    the model's own code propagates as it is."""
    if not isinstance(outputs, Tensor):
        return f"the model's outputs are a {type(outputs).__name__}, not a tensor"
    want = torch.cat([outputs.detach().float()] * 2)
    with torch.no_grad():
        got = fn(torch.cat([tokens.detach()] * 2))
    if not isinstance(got, Tensor) or got.shape != want.shape:
        return f"it returned shape {tuple(getattr(got, 'shape', ()))}, the model {tuple(want.shape)}"
    error = float((got.float() - want).abs().max())
    scale = max(float(want.abs().max()), 1e-12)
    if not error <= PARTIAL_RTOL * scale:
        return f"its outputs differ from the model's by {error:.3g} (largest output {scale:.3g})"
    return None


def query_blocks(record: AttentionRecord, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[slice]:
    """Slices of query rows such that one block of probabilities fits ``block_bytes``."""
    per_row = max(1, record.batch_size * record.num_heads * record.num_keys * 4)
    rows = max(1, min(record.num_queries, block_bytes // per_row))
    for start in range(0, record.num_queries, rows):
        yield slice(start, min(start + rows, record.num_queries))


def nonzero_rows(r: Tensor, block: slice) -> Optional[Union[slice, Tensor]]:
    """The rows of ``block`` where some image's ``r`` (B, N) is non-zero: the block itself when
    all are, the indices of those rows when some are (e.g. only the class row), or None."""
    live = torch.nonzero(r[:, block].ne(0).any(dim=0)).squeeze(1)
    n = block.stop - block.start
    if live.numel() == 0:
        return None
    if live.numel() == n:
        return block
    return live + block.start


def live_blocks(record: AttentionRecord, weights: Tensor) -> Iterator[Union[slice, Tensor]]:
    """:func:`query_blocks` of ``record`` restricted to the rows where some image's ``weights``
    (B, N_q) are non-zero, so a class-token readout computes one row per layer, not N."""
    for block in query_blocks(record):
        rows = nonzero_rows(weights, block)
        if rows is not None:
            yield rows


def readout_vector(layout: TokenLayout, batch: int, device: torch.device) -> Tensor:
    """The query row(s) the classifier reads, as a (B, N) weight vector.

    ``"class"``: one-hot at the class token. ``"prefix"`` (a distilled DeiT, whose output is the mean of
    its class head's and distillation head's): ``1/P`` on each of the P prefix tokens. ``"mean"`` (average
    pooling): uniform over the patch tokens, so a map is the mean over those queries of what they attend to;
    ``"all"`` (average pooling that includes the prefix tokens): uniform over every token.
    """
    vector = torch.zeros(batch, layout.num_tokens, device=device)
    if layout.readout == "class" and layout.class_index is not None:
        vector[:, layout.class_index] = 1.0
    elif layout.readout == "prefix" and layout.num_prefix_tokens:
        vector[:, :layout.num_prefix_tokens] = 1.0 / layout.num_prefix_tokens
    elif layout.readout == "all":
        vector[:] = 1.0 / layout.num_tokens
    else:
        vector[:, layout.patch_slice] = 1.0 / layout.num_patches
    return vector


@dataclass
class CaptionContext:
    """One explained batch of captions.

    Attributes:
        adapter: the caption adapter.
        x: (B, 3, H, W) model input.
        ids: (B, T) explained token ids (row t is word t; padded after each caption's end).
        recorder: capture of the forward that produced ``ids`` (generation) or of a
            teacher-forced forward on ``ids``.
        layout: token layout of the image encoder.
        teacher_forced: whether ``recorder`` holds a teacher-forced forward.
        logits: (B, T, V) teacher-forced logits (grads enabled), for gradient methods.
        method: the method name.
    """

    adapter: Any
    x: Tensor
    ids: Tensor
    recorder: Recorder
    layout: TokenLayout
    teacher_forced: bool
    logits: Optional[Tensor] = None
    method: str = ""


RowFn = Callable[[AttentionRecord, slice], Tensor]
"""Computes (B, rows, N) fused rows of one layer's matrix for a slice of query rows."""
