"""The head of a hierarchical model applied to a block's tokens: what LeGrad needs from an adapter.

LeGrad (:mod:`vitexplain.methods.hier_legrad`) applies the model's head to the output tokens of every
last-stage block whose tokens the head reads. An adapter names those calls, where their tokens are
recorded and how its head reads them; the method checks that head against the model's outputs.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import Tensor

__all__ = ["HeadOnTokens"]


class HeadOnTokens:
    """Mixin of :class:`~vitexplain.adapters.hier.HierAdapter`: the LeGrad interface (none by default: an adapter
    declares the ``"head"`` capability with :meth:`offer_legrad` once it implements :meth:`legrad_calls` and
    :meth:`head_on`). It reads the adapter's ``model``, ``notes``, ``capabilities``, ``stage_sets`` and
    ``not_implemented``."""

    model: Any
    notes: dict
    capabilities: frozenset

    def legrad_calls(self) -> list[str]:
        """Names of the attention calls whose block output the model's head reads as its last tokens (the last
        stage's calls on its own grid), input side first; none: LeGrad is refused."""
        return []

    def legrad_site(self, call: str) -> tuple[str, str]:
        """(module, part) where the output tokens of ``call``'s block are recorded: ``"output"`` (the module's
        output, or the first tensor of a tuple), ``"input"`` (its first input) or ``"arg1"`` (its second
        positional argument)."""
        return call.rsplit(".", 1)[0], "output"

    def legrad_modules(self) -> list[str]:
        """The modules LeGrad records (activations)."""
        return sorted({self.legrad_site(c)[0] for c in self.legrad_calls()})

    def legrad_tokens(self, recorder: Any, call: str) -> Tensor:
        """The output tokens of ``call``'s block, in the explained forward's graph (the layout :meth:`head_on` reads)."""
        module, part = self.legrad_site(call)
        act = recorder.activation(module)
        return self.head_layout(module, act.output if part == "output" else act.input if part == "input" else act.args[1])

    def head_layout(self, module: str, tokens: Tensor) -> Tensor:
        """A block module's output tokens in the layout :meth:`head_on` reads (as they are, by default)."""
        return tokens

    def tail_block(self) -> Any:
        """The module re-run by the re-running CDAM variants: the block of the last LeGrad call when its output is
        what the head reads and it holds the last stage's token site (T); else None (those methods are refused, with
        :meth:`tail_refusal`'s reason). An adapter may name another module whose recorded input the re-run starts
        from, with :meth:`tail_run` saying how (TNT)."""
        calls = self.legrad_calls()
        sites = getattr(self, "token_sites", None) or [None]
        if not calls or sites[-1] is None or self.legrad_branches():
            return None
        module, part = self.legrad_site(calls[-1])
        return module if part == "output" and sites[-1].startswith(module + ".") else None

    def tail_run(self, block: Any, x: Tensor, recorded: Any) -> Tensor:
        """Re-run :meth:`tail_block` from (b, ...) input rows ``x`` (its other arguments as ``recorded``, the
        block's recorded activation): the output tokens the head reads (a tuple's first item)."""
        out = block(x, *recorded.args[1:], **recorded.kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def tail_input_is_t(self) -> bool:
        """Whether T is :meth:`tail_block`'s input itself (LeViT: no norm before its attention), so the re-run
        varies that input as T (the residual with it); else T is the output of a site inside the block."""
        return False

    def tail_refusal(self) -> str:
        """Why the re-running CDAM variants are refused for this model (when :meth:`tail_block` is None)."""
        return (f"in {type(self.model).__name__} the tokens entering the last attention (T) are not inside the block "
                "whose output the head reads (or a layer runs between that block and the head), so vitexplain cannot "
                "re-run the model from T to its outputs (smooth and integrated CDAM); use 'cdam'")

    def head_on(self, tokens: Tensor) -> Tensor:
        """The model's head (final norm, pooling, classifier) on a last-stage block's output tokens."""
        raise self.not_implemented("head_on()")

    def legrad_head(self, recorder: Any, call: str) -> Any:
        """``fn(tokens) -> outputs``: the head LeGrad applies to ``call``'s block tokens."""
        return self.head_on

    def legrad_final(self, recorder: Any, call: str) -> Tensor:
        """The tokens the model's head read in the explained forward (the last block's output), on which
        :meth:`legrad_head` must give the model's outputs (checked)."""
        return self.legrad_tokens(recorder, self.legrad_calls()[-1])

    def legrad_branches(self) -> dict[str, int]:
        """Per call name its branch (CrossViT); empty: one branch."""
        return {}

    def legrad_parts(self, input_size: Sequence[int]) -> list[slice]:
        """The slices of the last token set normalised separately: its grid tokens (CrossViT: each branch's)."""
        last = self.stage_sets(input_size)[-1]
        return [slice(last.prefix, last.n)]

    def offer_legrad(self) -> None:
        """Declare the ``"head"`` capability when :meth:`head_on` is known and the last stage has calls on its
        own grid; otherwise say why not (called at the end of a subclass's ``__init__``)."""
        if not self.legrad_calls():
            self.notes["head"] = (
                f"the last stage of {type(self.model).__name__} has no attention call on its own grid (its only block "
                "pools the grid before), so no block outputs tokens the head reads with an attention over them "
                "(LeGrad); use 'generic' or 'grad_rollout', or 'cdam'")
            return
        self.capabilities = self.capabilities | {"head"}
        self.notes.pop("head", None)
        if self.tail_block() is not None:
            self.capabilities = self.capabilities | {"tail"}
        else:
            self.notes["tail"] = self.tail_refusal()
