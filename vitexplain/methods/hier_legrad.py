"""LeGrad for hierarchical and pooling transformers (family ``"hier"``), on the last stage's blocks.

LeGrad (Bousselham et al. 2024) applies the model's head (final norm, pooling, classifier) to each
layer's output tokens: ``s_l = head(T_l)``, and reads ``ReLU(d s_l[c] / d A_l)``. In a hierarchical
model only the blocks of the last stage output tokens of the width and on the grid the head reads;
those are the blocks used here (the adapter names them: ``adapter.legrad_calls()``). Each block's
relevance over its keys is carried to the stage grid through the call's key footprint (pooled keys
of spatial-reduction attention, MViTv2's pooled keys; windows are the call's slots), as the other
methods of the family do (:mod:`.resample`). Definition: docs/methods.md, "Hierarchical transformers".
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from ..errors import UnsupportedMethodError
from .context import Context
from .families import HIER
from .hier import chain_of
from .options import Option, check_index, check_indices
from .registry import register
from .resample import Call, calls

__all__ = ["legrad", "key_relevance"]


def _modules(adapter) -> list[str]:
    return list(adapter.legrad_modules())


def key_relevance(call: Call, d_out: Tensor) -> Tensor:
    """``E[j] = sum over heads and real queries of ReLU(dy/dA)[i, j]``, the keys of every window placed on the
    call's key set and pulled through the keys' footprint onto its input set, divided by heads x queries.

    Args:
        call: a bound attention call.
        d_out: the score's gradient w.r.t. the call's recorded attention output (``record.output``).

    Returns:
        (B, n_I) float32 over the call's input set.
    """
    grad = torch.relu(call.grad_probs(d_out))  # (B, G, H, n_q, n_k); padding pairs are 0
    every_query = grad.new_ones(grad.shape[0], call.spec.out.n)  # r @ M with r = 1: the sum over the queries
    queries = int((call.q_slots >= 0).sum())
    return call.vec_mat(every_query, grad.sum(dim=2)) / (grad.shape[2] * queries)


def _normalise(r: Tensor, parts: Sequence[slice]) -> Tensor:
    """Min-max normalise each part (a branch's grid tokens) of ``r`` (B, n) per image; the rest set to 0."""
    out = torch.zeros_like(r)
    for part in parts:
        values = r[:, part]
        low, high = values.amin(1, keepdim=True), values.amax(1, keepdim=True)
        out[:, part] = (values - low) / (high - low).clamp(min=1e-12)
    return out


@register(
    "legrad", HIER, grads=True, activations=_modules, retain_graph=True, requires=("grid", "attention", "head"),
    options={
        "layers": Option(int, optional=True, sequence=True,
                         help="attention call indices over all stages (None = the last stage's calls)"),
        "stage": Option(int, help="stage whose grid the map is on: only the last (CrossViT: the branch)"),
    },
    summary="LeGrad on the last stage's attention calls (the head reads only last-stage tokens), keys through "
            "their footprint",
    reference="Bousselham et al. 2024 on the last stage; docs/methods.md, Hierarchical transformers",
)
def legrad(ctx: Context, *, layers: Union[None, int, Sequence[int]] = None, stage: int = -1) -> object:
    """LeGrad over the calls whose block output the head reads: ``s_l`` = the model's head on block l's output
    tokens, ``E_l = key_relevance(l)`` (mean over heads and queries of ``ReLU(d s_l / d A_l)`` over the keys,
    through the keys' footprint), map = ``mean_l E_l`` on the last stage's grid, min-max normalised per image
    (CrossViT: per branch, each branch's blocks read by the head with the other branch's final tokens held).

    Args:
        ctx: the captured forward (gradients enabled).
        layers: attention call indices over all stages (negative from the last); default: every call of the
            last stage on its own grid. Earlier stages' tokens have another width and grid than the head reads.
        stage: the stage of the map: the last one (negative counts from it); CrossViT: the branch.

    Returns:
        (B, H_L, W_L) float32 in [0, 1] (CrossViT: with the family's ``extras``).

    Raises:
        UnsupportedMethodError: a layer outside the last stage, another stage, or a model whose last stage has
            no attention call on its own grid.
        UnsupportedModelError: the head re-run on the last block's tokens does not give the model's outputs.
    """
    adapter = ctx.adapter
    size = tuple(ctx.x.shape[-2:])
    sets = adapter.stage_sets(size)
    stage = check_index(ctx.method, "stage", stage, len(sets), "stages")
    branches = adapter.legrad_branches()
    if not branches and stage != len(sets) - 1:
        raise UnsupportedMethodError(
            f"legrad applies the head to a block's output tokens, which only the last stage's blocks have in the "
            f"head's width and grid; stage {stage} is not the last ({len(sets) - 1}). Use 'generic' or "
            "'grad_rollout' (stage=...) for relevance on an earlier stage's grid")
    items = chain_of(ctx)
    every = calls(items)
    by_name = {c.spec.name: c for c in every}
    allowed = [by_name[n].index for n in adapter.legrad_calls() if n in by_name]
    if not allowed:
        raise UnsupportedMethodError(
            f"the last stage of {type(adapter.model).__name__} has no attention call on its own grid (its only "
            "block pools the grid before), so no block outputs tokens the head reads with an attention over them; "
            "use 'generic' or 'grad_rollout', or 'cdam' (its default stage is the last one with such a call)")
    chosen = allowed if layers is None else check_indices(ctx.method, "layers", layers, len(every),
                                                          "attention calls over all stages")
    outside = [i for i in chosen if i not in allowed]
    if outside:
        raise UnsupportedMethodError(
            f"legrad applies the head to a block's output tokens, which only the last stage's attention calls "
            f"{allowed} give in the head's width and grid; calls {outside} are not among them. Use 'generic' or "
            "'grad_rollout' for relevance through all stages")
    recorder = ctx.recorder
    total = torch.zeros(ctx.batch_size, every[chosen[0]].spec.inp.n, device=ctx.x.device)
    with torch.enable_grad():
        for i in chosen:
            call = every[i]
            if call.spec.inp != call.spec.out:
                raise UnsupportedMethodError(
                    f"{call.spec.name!r} maps {call.spec.inp} onto {call.spec.out}: legrad reads calls on one grid")
            name = call.spec.name
            branch = branches.get(name, 0)
            final = adapter.legrad_final(recorder, name)
            head = ctx.partial(f"head {branch}", adapter.legrad_head(recorder, name), final)
            tokens = adapter.legrad_tokens(recorder, name)
            if tokens.shape[1:] != final.shape[1:]:
                raise UnsupportedMethodError(
                    f"the block of {name!r} outputs tokens of shape {tuple(tokens.shape[1:])}, but the head reads "
                    f"{tuple(final.shape[1:])}: legrad applies the head to blocks whose tokens it reads; use "
                    "'generic' or 'grad_rollout'")
            outputs = head(tokens)
            (d_out,) = torch.autograd.grad(ctx.score(outputs).sum(), call.record.output, retain_graph=True)
            total += key_relevance(call, d_out) * _weight(chosen, every, branches, i)
    return adapter.finish(_normalise(total, adapter.legrad_parts(size)), stage, size)


def _weight(chosen: list[int], every: list[Call], branches: dict, i: int) -> float:
    """1 / the number of chosen calls of call i's branch (the mean over layers, per branch)."""
    branch = branches.get(every[i].spec.name, 0)
    return 1.0 / sum(1 for j in chosen if branches.get(every[j].spec.name, 0) == branch)
