"""Dense float64 oracles for hierarchical transformers, built without vitexplain's resampling code.

- Attention probabilities and dy/dA come from an *eager* copy of the model (its attention
  modules' ``fused_attn`` off): forward hooks on each attention module's ``attn_drop`` keep
  the softmax output the model itself computed, and autograd gives its gradient.
- Window slots come from the model's own partition code (timm's ``window_partition``) or
  the model's inline reshape, applied to a grid of token indices.
- Footprints are ``avg_pool2d(count_include_pad=False)`` / ``adaptive_avg_pool2d`` of one-hot
  images of the fine tokens: row m of D is what pooling gives coarse token m.
- Rollout and Chefer's rule are dense products in the forward direction, first layer first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pool_matrix(fine: tuple[int, int], kernel, stride, padding=0, prefix: int = 0) -> Tensor:
    """D (n_coarse, n_fine) of an average pooling over real tokens, prefix tokens kept."""
    h, w = fine
    eye = torch.eye(h * w, dtype=torch.float64).view(h * w, 1, h, w)
    pooled = F.avg_pool2d(eye, kernel, stride, padding, count_include_pad=False)
    d = pooled.flatten(1).T  # (n_coarse, n_fine)
    return _with_prefix(d, prefix)


def adaptive_matrix(fine: tuple[int, int], out: tuple[int, int]) -> Tensor:
    h, w = fine
    eye = torch.eye(h * w, dtype=torch.float64).view(h * w, 1, h, w)
    return F.adaptive_avg_pool2d(eye, out).flatten(1).T


def _with_prefix(d: Tensor, prefix: int) -> Tensor:
    if not prefix:
        return d
    out = torch.zeros(d.shape[0] + prefix, d.shape[1] + prefix, dtype=torch.float64)
    out[:prefix, :prefix] = torch.eye(prefix, dtype=torch.float64)
    out[prefix:, prefix:] = d
    return out


@dataclass
class DenseCall:
    """One attention call as dense matrices on its token sets.

    Attributes:
        probs: (B, H, n_out, n_keys) the call's attention placed densely (windows scattered).
        grads: (B, H, n_out, n_keys) dy/dA placed likewise (or None).
        keys: (n_keys, n_in) the keys' footprint.
        skip: (n_out, n_in) the residual path, or None.
    """

    probs: Tensor
    grads: Optional[Tensor]
    keys: Tensor
    skip: Optional[Tensor]


Item = Union[DenseCall, Tensor]  # a Tensor item is a transition D (n_coarse, n_fine)


def scatter_windows(a: Tensor, q_index: Tensor, k_index: Tensor, n_out: int, n_keys: int) -> Tensor:
    """(B, G, H, n, m) per-window matrices -> (B, H, n_out, n_keys) dense; index -1 = padding."""
    b, g, h = a.shape[:3]
    w, i, j = torch.meshgrid(torch.arange(g), torch.arange(q_index.shape[1]), torch.arange(k_index.shape[1]),
                             indexing="ij")
    qi, kj = q_index[w, i], k_index[w, j]
    real = (qi >= 0) & (kj >= 0)
    values = a.double().permute(1, 3, 4, 0, 2)[w[real], i[real], j[real]]  # (P, B, H)
    out = torch.zeros(n_out, n_keys, b, h, dtype=torch.float64)
    out.index_put_((qi[real], kj[real]), values, accumulate=True)
    return out.permute(2, 3, 0, 1)


def hiera_call(a: Tensor, g: Tensor, n: int, query_stride: int, windows: int) -> DenseCall:
    """One Hiera attention call as a dense call on the unrolled token order.

    Args:
        a: (B, nW, heads, n_q, n_k) probabilities per mask unit (nW = 1 for global calls); g: their gradients.
        n: tokens before the call; query_stride: q (the pooled query keeps n / q tokens);
        windows: nW. Token t of a unit is slot t // nW of window t % nW; the residual's max over
        the q chunks is read evenly (1 / q each).
    """
    n_out = n // query_stride
    t_in = torch.arange(n).view(-1, windows).T  # [w, slot] -> unrolled position slot * nW + w
    t_out = torch.arange(n_out).view(-1, windows).T
    skip = torch.zeros(n_out, n, dtype=torch.float64)
    for c in range(query_stride):
        skip[torch.arange(n_out), torch.arange(n_out) + c * n_out] = 1.0 / query_stride
    return DenseCall(scatter_windows(a, t_out, t_in, n_out, n), scatter_windows(g, t_out, t_in, n_out, n),
                     torch.eye(n, dtype=torch.float64), skip)


def eager_attention(model: nn.Module, x: Tensor, target: int, modules: list[str],
                    unfuse: Callable[[nn.Module], None]) -> list[tuple[Tensor, Tensor]]:
    """(A, dA/dy) as each attention module's ``attn_drop`` saw them, in ``modules`` order, from
    an eager float64 copy of ``model``."""
    eager = copy.deepcopy(model).double().eval()
    unfuse(eager)
    seen: dict[str, Tensor] = {}
    handles = []
    for name in modules:
        def keep(mod, inp, out, name=name):
            out.retain_grad()
            seen[name] = out
        handles.append(eager.get_submodule(name).attn_drop.register_forward_hook(keep))
    try:
        logits = eager(x.double())
        logits[:, target].sum().backward()
    finally:
        for h in handles:
            h.remove()
    return [(seen[n].detach(), seen[n].grad.detach()) for n in modules]


def unfuse_all(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False


def _rownorm(m: Tensor) -> Tensor:
    """Rows divided by their sums; a row with nothing in it stays zero (nothing flows)."""
    s = m.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, m / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(m))


def carry(items: list[Item], u: Tensor, mode: str, start: int = 0) -> Tensor:
    """u R (or u (R - R_identity) for "generic"/"grad_rollout") with R the dense product of
    ``items[start:]`` in forward order: (B, n_last) -> (B, n_first)."""
    batch = u.shape[0]
    first = items[start]
    n0 = first.shape[1] if isinstance(first, Tensor) else first.keys.shape[1]
    r = torch.eye(n0, dtype=torch.float64).expand(batch, n0, n0).clone()
    ident = torch.eye(n0, dtype=torch.float64).expand(batch, n0, n0).clone()
    for item in items[start:]:
        if isinstance(item, Tensor):
            r, ident = item @ r, item @ ident
            continue
        if mode == "rollout":
            m = item.probs.mean(dim=1) @ item.keys
        else:
            m = (item.probs * item.grads)
            m = (m.mean(dim=1).clamp(min=0) if mode == "grad_rollout" else m.clamp(min=0).mean(dim=1)) @ item.keys
        skip = item.skip
        if mode in ("rollout", "grad_rollout"):
            step = _rownorm(0.5 * m + 0.5 * skip) if skip is not None else _rownorm(m)
            r = step @ r
        else:
            r = (skip @ r if skip is not None else 0) + m @ r
        ident = skip @ ident if skip is not None else torch.zeros(batch, skip_rows(item), n0, dtype=torch.float64)
    out = torch.einsum("bn,bnm->bm", u.double(), r)
    if mode in ("generic", "grad_rollout"):
        out = out - torch.einsum("bn,bnm->bm", u.double(), ident)
    return out


def skip_rows(item: DenseCall) -> int:
    return item.probs.shape[2]


class SoftmaxTape(torch.overrides.TorchFunctionMode):
    """Keeps every softmax output over the last dim of a >= 3-D tensor (attention
    probabilities as the model computed them, eagerly), with its gradient retained."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.softmax, Tensor.softmax, F.softmax) and isinstance(out, Tensor) and out.dim() >= 3:
            if out.requires_grad:
                out.retain_grad()
            self.outputs.append(out)
        return out


def taped_attention(model: nn.Module, x: Tensor, target: Union[int, Callable[[nn.Module, Tensor], Tensor]]
                    ) -> list[tuple[Tensor, Tensor]]:
    """(A, dy/dA) of every softmax of an eager float64 copy of ``model``, in call order.

    ``target`` is a class index of ``model(x)``'s logits, or ``score(model, x) -> (B,)``.
    Hugging Face copies are switched to their eager attention (``set_attn_implementation``).
    """
    eager = copy.deepcopy(model).double().eval()
    unfuse_all(eager)
    if hasattr(eager, "set_attn_implementation"):
        eager.set_attn_implementation("eager")
    tape = SoftmaxTape()
    with tape:
        score = target(eager, x.double()) if callable(target) else eager(x.double())[:, target]
    score.sum().backward()
    return [(a.detach(), a.grad.detach()) for a in tape.outputs]


def token_derivative(module: nn.Module, index: Union[tuple, Callable[[Tensor], tuple]], score: Callable[[], Tensor],
                     eps: float = 1e-5) -> float:
    """d score / de when the output of ``module`` at ``index`` (after the batch dim: a token ``(t,)`` of
    (B, N, C) tokens, or a cell ``(i, j)`` of (B, H, W, C) ones) is scaled by (1 + e): a central difference.

    Args:
        module: where the token is scaled (a forward hook on its output).
        index: the token's index after the batch dimension, or a function of the output giving it.
        score: runs the model, returns a one-element tensor (no gradient taken).
        eps: the step.
    """
    def at(step: float) -> float:
        def scale(mod: nn.Module, inputs: tuple, out: Tensor) -> Tensor:
            out = out.clone()
            out[(slice(None), *(index(out) if callable(index) else index))] *= 1 + step
            return out

        handle = module.register_forward_hook(scale)
        try:
            with torch.no_grad():
                return float(score())
        finally:
            handle.remove()

    return (at(eps) - at(-eps)) / (2 * eps)


def assert_matches_oracle(maps: Tensor, want: Tensor, label: object = None) -> None:
    """vitexplain's float32 ``maps`` equal the float64 oracle ``want`` (same shape) to 1e-4 of its
    largest magnitude, which must not be 0 (a map of zeros would match anything)."""
    scale = float(want.abs().max())
    error = float((maps.double() - want).abs().max())
    assert scale > 0 and error <= 1e-4 * scale, (label, error, scale)


#: methods and options whose maps a batch must give as its images one by one (a hierarchical model's stages 1 and 2
#: have attention: token methods there; ``raw`` at layer 1)
BATCH_CASES = (("rollout", {}), ("generic", {}), ("generic", {"stage": 2}), ("grad_rollout", {}), ("cdam", {}),
               ("raw", {"layer": 1}))


def assert_batch_equals_images_alone(ex, x: Tensor, cases, target: int = 1) -> None:
    """Each ``(method, options)`` of ``cases`` explains the batch ``x`` as its images one by one (to float rounding of
    the maps' scale), and gives maps that are not all zero (token Grad-CAM's ReLU may zero a random model's map)."""
    for method, options in cases:
        together = ex.explain(x, method=method, target=target, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=target, **options).maps
                           for i in range(x.shape[0])])
        assert together.shape[0] == x.shape[0] and (method == "gradcam" or bool(alone.abs().max() > 0)), method
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)


def assert_stages_match_oracle(ex, x: Tensor, items: list, u: Tensor, starts: list[int], grids: list, target: int = 1
                               ) -> None:
    """rollout, generic and grad_rollout at every stage s: maps on ``grids[s]`` equal to the dense float64 carry of
    ``items`` from the readout ``u`` down to the stage's first set (``starts[s]``)."""
    for method in ("rollout", "generic", "grad_rollout"):
        for stage, grid in enumerate(grids):
            e = ex.explain(x, method=method, target=target, stage=stage)
            assert e.maps.shape == (x.shape[0], *grid)
            assert_matches_oracle(e.maps, carry(items, u, method, start=starts[stage]).reshape(e.maps.shape),
                                  (method, stage))
