"""The attention views of a hierarchical transformer: every layer on its own stage grid.

A hierarchical model (family ``"hier"``: PVTv2, Twins, SAM's ViT, PiT, MViTv2, ...) attends on
token sets that change between stages, and a layer's keys may sit on a coarser grid than its
queries (pooled keys and values). Its adapter describes the forward as a chain of attention
calls and transitions (:mod:`vitexplain.methods.resample`); for each call the page gets

* the attention ``A[l]`` (H, n_Q, n_K) from the call's query set Q onto its key set K, each on
  its own grid (windowed calls placed densely: a query's row is zero outside its window), drawn
  on the key grid;
* the cumulative rollout ``R_l`` (n_Q, n_0) from layer l's queries onto the first token set
  (stage 0), with ``R_l = rownorm(0.5 mean_h(A[l]) D_k + 0.5 D_q) T ... R_{l-1}``: D_k the keys'
  footprint onto the block's input set, D_q the residual path's (``rownorm(A D_k)`` without a
  residual), T the footprints of the transitions in between. This is the ``rollout`` method's
  rule (docs/methods.md, "Hierarchical transformers"); the mean of ``R_L``'s rows over the
  last set is its map.

Size: ``sum_l H_l n_Q n_K + n_Q n_0`` bytes (heads may differ per stage); over ``budget`` the
heads are fused (mean),
then fewer layers are embedded (the last always, the others evenly spaced); the page says which.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..adapters.hier import PageView
from ..recording import AttentionRecord
from .attention import _split, _split_bytes, budget_text

__all__ = ["stage_payload", "dense_attention", "stage_rollouts"]


def _sizes(tokens: Any) -> list[int]:
    return [int(tokens.prefix), int(tokens.grid[0]), int(tokens.grid[1])]


def dense_attention(call: Any, index: int = 0) -> Tensor:
    """One image's attention of a bound call on its full query and key sets.

    Args:
        call: a :class:`vitexplain.methods.resample.Call`.
        index: the image of the batch.

    Returns:
        (H, n_Q, n_K) float32; windowed calls are placed by their slots, a query's row being zero
        outside its window (padding slots dropped).
    """
    spec = call.spec
    probs = call.probs()[index]  # (G, H, n_q, n_k), padding rows and columns zeroed
    heads = probs.shape[1]
    n_q, n_k = spec.out.n, spec.keys.coarse.n
    q_slots, k_slots = call.q_slots, call.k_slots
    rows = q_slots[:, :, None].expand(-1, -1, k_slots.shape[1])
    cols = k_slots[:, None, :].expand(-1, q_slots.shape[1], -1)
    real = (rows >= 0) & (cols >= 0)
    out = probs.new_zeros(n_q, n_k, heads)
    values = probs.permute(0, 2, 3, 1)[real]  # (M, H)
    out.index_put_((rows[real], cols[real]), values.float(), accumulate=True)
    return out.permute(2, 0, 1)


def _apply(footprint: Any, r: Tensor) -> Tensor:
    """``D @ r`` for a footprint D (coarse x fine) and rows r (n_fine, m)."""
    if footprint.is_identity:
        return r
    return footprint.dense().to(device=r.device, dtype=r.dtype) @ r


def stage_rollouts(items: Sequence[Any], attention: Sequence[Tensor]) -> list[Tensor]:
    """Cumulative rollout after each call of a bound chain, onto the first token set.

    Args:
        items: the bound chain (calls and transitions), input side first.
        attention: per call, its head-mean dense attention (n_Q, n_K) (:func:`dense_attention`).

    Returns:
        Per call l, ``R_l`` (n_Q, n_0) float32.
    """
    from ..methods.resample import Transition

    out: list[Tensor] = []
    r: Optional[Tensor] = None
    for item in items:
        if len(out) == len(attention):
            break
        if r is None:
            first = item.footprint.fine if isinstance(item, Transition) else item.spec.inp
            device = next(iter(attention)).device if attention else torch.device("cpu")
            r = torch.eye(first.n, device=device)
        if isinstance(item, Transition):
            r = _apply(item.footprint, r)
            continue
        a = attention[len(out)].float()
        spec = item.spec
        keys_r = _apply(spec.keys, r)  # D_k R: (n_K, n_0)
        if spec.skip is None:
            sums = a.sum(-1, keepdim=True)
            r = (a @ keys_r) / sums.clamp(min=1e-12)
        else:
            sums = 0.5 * a.sum(-1, keepdim=True) + 0.5
            r = (0.5 * (a @ keys_r) + 0.5 * _apply(spec.skip, r)) / sums
        out.append(r)
    return out


def _view(adapter: Any, spec: Any, input_size: Sequence[int]) -> PageView:
    """The call as the page draws it: the adapter's :meth:`~vitexplain.adapters.hier.HierAdapter.page_view`,
    else on its own query and key sets."""
    view = adapter.page_view(spec, input_size) if callable(getattr(adapter, "page_view", None)) else None
    if view is not None:
        return view
    q, k = spec.out, spec.keys.coarse
    return PageView(torch.arange(q.n), q, torch.arange(k.n), k, max(spec.in_stage, spec.out_stage))


def _prefix_names(names: Sequence[str], first: int, views: Sequence[PageView]) -> list[str]:
    """Labels of the prefix tokens of every set the page draws: the first set's ``names``, then, for prefix
    tokens that only later sets have (PVT v1's class token joins at the last stage: the page labelled its
    query and keys "undefined" and offered no button for it), ``[CLS]`` for the first and ``[PREFIXi]`` after."""
    most = max([first] + [max(v.q_set.prefix, v.k_set.prefix) for v in views])
    known = list(names[:first])
    return known + ["[CLS]" if i == 0 else f"[PREFIX{i}]" for i in range(len(known), most)]


def _fit(sizes: list[int], budget: int) -> list[int]:
    """The layers to embed: all if they fit, else the last plus evenly spaced others that fit."""
    if sum(sizes) <= budget:
        return list(range(len(sizes)))
    chosen: list[int] = []
    used = 0
    order = [len(sizes) - 1] + [int(round(i)) for i in np.linspace(0, len(sizes) - 2, max(len(sizes) - 1, 0))]
    for i in order:
        if i not in chosen and used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen)


def stage_payload(adapter: Any, records: Sequence[AttentionRecord], input_size: Sequence[int],
                  prefix_names: list[str], *, budget: int, batch: int = 1, index: int = 0) -> dict[str, Any]:
    """The attention part of the page data of one image of a hierarchical model.

    Args:
        adapter: a hierarchical adapter (``chain(input_size)``).
        records: the attention records of a forward of one batch.
        input_size: (H, W) of the image.
        prefix_names: labels of the prefix tokens of the first set.
        budget: most base64 bytes to embed.
        batch: images in the recorded forward.
        index: which image of the records' batch.

    Returns:
        ``{"layers", "layerIndex", "heads": [per layer labels], "prefix", "tokens", "grid", "note", "sets":
        [{"q": [P, H, W], "k": [P, H, W], "stage": s}], "probs": [per layer rows (H' n_Q, n_K)],
        "rollout": [per layer rows (n_Q, n_0)]}``; ``grid``/``prefix`` are the first set's (the
        rollout rows' columns); ``tokens`` label the prefix tokens of every set (a later stage may have more
        than the first: PVT v1's class token); ``probs``/``rollout`` are None when nothing fits.
    """
    from ..methods.resample import bind, calls

    items = bind(adapter.chain(input_size), records, batch=batch, method="explore")
    bound = calls(items)
    first = adapter.stage_sets(input_size)[0]
    n0, p0 = first.n, first.prefix
    heads = [c.num_heads for c in bound]  # (folded into the record's batch for SAM and Hiera: Call.num_heads)
    # each call on the sets the page draws it on (CrossViT's joint 1 x N set was drawn as a strip over the image)
    views = [_view(adapter, c.spec, input_size) for c in bound]
    columns = adapter.page_input(input_size) if callable(getattr(adapter, "page_input", None)) else None
    geometry = [(v.q_set, v.k_set, v.stage) for v in views]
    rows = [_split_bytes(q.n, n0, p0) for q, _, _ in geometry]
    full = [h * _split_bytes(q.n, k.n, k.prefix) + r for h, (q, k, _), r in zip(heads, geometry, rows)]
    fused = [_split_bytes(q.n, k.n, k.prefix) + r for (q, k, _), r in zip(geometry, rows)]
    chosen, note, mean = list(range(len(bound))), "", False
    if sum(full) > budget:
        mean = True
        chosen = _fit(fused, budget)
        note = (f"heads fused (mean) and {len(chosen)} of {len(bound)} layers embedded (page budget "
                f"{budget_text(budget)})" if chosen
                else f"the attention of this model does not fit the page budget ({budget_text(budget)})")
    payload: dict[str, Any] = {
        "layers": [bound[i].record.name for i in chosen],
        "layerIndex": chosen,
        "heads": [["mean"] if mean else [str(h) for h in range(heads[i])] for i in chosen],
        "prefix": p0,
        "tokens": _prefix_names(prefix_names, p0, [views[i] for i in chosen]),
        "grid": list(first.grid),
        "note": note,
        "sets": [{"q": _sizes(geometry[i][0]), "k": _sizes(geometry[i][1]), "stage": geometry[i][2]}
                 for i in chosen],
        "probs": None,
        "rollout": None,
    }
    if not chosen:
        return payload
    attention = [dense_attention(c, index) for c in bound[: chosen[-1] + 1]]
    rolled = stage_rollouts(items, [a.mean(0) for a in attention])
    probs, rollout = [], []
    for i in chosen:
        a = attention[i].mean(0, keepdim=True) if mean else attention[i]
        v = views[i]
        q, k = v.queries.to(a.device), v.keys.to(a.device)
        a, r = a[:, q][..., k], rolled[i][q]
        probs.append(_split(a, geometry[i][1].prefix))
        rollout.append(_split(r if columns is None else r[:, columns.to(r.device)], p0))
    payload["probs"], payload["rollout"] = probs, rollout
    return payload

