"""Pointing on two-object images for a hierarchical shapes model (Hiera or PVTv2), with a dense oracle.

Usage::

    python benchmarks/hier_pointing.py [--model shapes-hier | CHECKPOINT.json] [--n 400] [--seed 20000]

Independent of vitexplain's hierarchical methods: the maps here are computed in this script by a
dense float64 oracle on the finest (stage 0) token grid.

timm Hiera (the bundled ``shapes-hier``): from an eager float64 copy of the model (its attention's
``fused_attn`` off; the model itself is not changed), whose softmax outputs and their gradients are
kept by a torch function mode, in the model's unrolled token order (token t of a call is slot
t // nW of window t % nW; a pooled query or residual t' stands for positions t' + c N / q_stride,
Hiera's max over chunks, read evenly); the stage-0 vector is put on the grid by the model's own
``unroll`` run on token indices. Chefer's rule (``generic``): ``R <- S R + mean_h(clamp(A * dy/dA,
0)) R`` (S: the residual, identity or the pooling), read out by the mean over the last tokens
(the model's average pooling), minus the readout of the residual path alone; rollout:
``R <- rownorm(0.5 mean_h(A) + 0.5 S) R``.

timm PVTv2 (the earlier ``shapes-hier``, ``--arch pvt``): from the captured attention (``vx.capture(model,
grads=True)``: probabilities and dy/dA of every spatial-reduction attention call, fused
attention left on):

* every token of stage s stands for its block of stage-0 tokens: a stage transition (PVTv2's
  overlapping stride-2 patch embedding) gives each new token the mean of the relevance rows of
  its 2 x 2 children; a pooled key/value token (spatial reduction, kernel = stride = r) the mean
  of its r x r children;
* Chefer's rule (``generic``): ``R_s <- R_s + mean_h(clamp(A * dy/dA, 0)) @ (Q R_s)`` per block,
  read out by the mean over the last stage's tokens (the model's mean pooling), minus the readout
  of the identity path (the pure resampling);
* rollout: ``R_s <- (0.5 mean_h(A) Q + 0.5 I) R_s``, same readout.

Images: ``vx.data.shapes(n, seed, num_objects=2, distinct_classes=True)``; each image's two
classes are targeted in turn and the map's peak must fall on that object (class-discriminative
pointing, n = 2 x images); rollout is class-agnostic and scored against both objects. When
vitexplain supports the model, its ``gradcam`` (last stage), ``generic`` and ``rollout`` are
scored on the same images, and its ``attnlrp`` and ``cp_lrp`` (pixel maps: the peak pixel must lie on the
object's mask).
Prints one line per method: pointing accuracy and its binomial standard error
``sqrt(p (1 - p) / n)`` over the n (image, target) pairs. Run on the bundled ``shapes-hier``, it
also rewrites its section of docs/benchmarks.md ("Hierarchical pointing (shapes-hier)").
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

import vitexplain as vx

try:  # shared report helper of the benchmarks folder (writes docs/benchmarks.md)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import report, table  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - fall back to printing
    report = table = None


def _stage_layout(model: torch.nn.Module, x: Tensor) -> list[tuple[int, tuple[int, int], int]]:
    """(stage, (h, w) query grid, sr ratio) of every attention call, in call order."""
    sizes: dict[int, tuple[int, int]] = {}
    hooks = [st.register_forward_hook(lambda m, a, o, s=s: sizes.__setitem__(s, tuple(o.shape[-2:])))
             for s, st in enumerate(model.stages)]
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for h in hooks:
            h.remove()
    calls = []
    for s, st in enumerate(model.stages):
        for blk in st.blocks:
            sr = blk.attn.sr.stride[0] if blk.attn.sr is not None else 1
            calls.append((s, sizes[s], sr))
    return calls


def _pool_matrix(grid: tuple[int, int], r: int) -> Tensor:
    """(K, N) float64: each pooled token of an r x r pooling is the mean of its children."""
    h, w = grid
    kh, kw = h // r, w // r
    m = torch.zeros(kh * kw, h * w, dtype=torch.float64)
    for i in range(kh * r):
        for j in range(kw * r):
            m[(i // r) * kw + j // r, i * w + j] = 1.0 / (r * r)
    return m


def oracle_maps(model: torch.nn.Module, x: Tensor, target: Tensor) -> dict[str, Tensor]:
    """Dense float64 generic and rollout maps on the stage-0 grid.

    Args:
        model: a timm ``PyramidVisionTransformerV2`` (eval mode), e.g. a checkpoint of the earlier
            ``shapes-hier`` (``python -m vitexplain.zoo.train shapes-hier --arch pvt``).
        x: (B, 3, H, W) images.
        target: (B,) class indices.

    Returns:
        ``{"generic": (B, h0, w0), "rollout": (B, h0, w0)}`` float64.
    """
    calls = _stage_layout(model, x)
    with vx.capture(model, grads=True) as rec:
        logits = model(x)
        logits.gather(1, target[:, None]).sum().backward()
    records = [r for r in rec.records if r.kind == "self"]
    if len(records) != len(calls):
        raise RuntimeError(f"{len(records)} attention records for {len(calls)} blocks")
    b = x.shape[0]
    h0, w0 = calls[0][1]
    n0 = h0 * w0
    eye = torch.eye(n0, dtype=torch.float64).expand(b, n0, n0)
    gen, roll, ident = eye.clone(), eye.clone(), eye.clone()
    stage = 0
    grid = (h0, w0)
    for (s, g, sr), r in zip(calls, records):
        while stage < s:  # stage transition: each new token is the mean of its 2 x 2 children
            p = _pool_matrix(grid, 2)
            gen, roll, ident = (p @ t for t in (gen, roll, ident))
            stage, grid = stage + 1, (grid[0] // 2, grid[1] // 2)
        if grid != g:
            raise RuntimeError(f"stage {s}: grid {grid}, expected {g}")
        q = _pool_matrix(grid, sr)
        a = r.probs().double()  # (B, heads, N, K)
        ga = r.grad_probs().double()
        if a.shape[-1] != q.shape[0] or a.shape[-2] != q.shape[1]:
            raise RuntimeError(f"attention {tuple(a.shape)} does not match grid {grid}, sr {sr}")
        cam = (a * ga).clamp(min=0).mean(1)  # (B, N, K)
        gen = gen + cam @ (q @ gen)
        n = grid[0] * grid[1]
        roll = (0.5 * a.mean(1) @ q + 0.5 * torch.eye(n, dtype=torch.float64)) @ roll
    maps = {"generic": (gen - ident).mean(1), "rollout": roll.mean(1)}
    return {k: v.view(b, h0, w0) for k, v in maps.items()}


class _SoftmaxTape(torch.overrides.TorchFunctionMode):
    """Keeps every softmax output over the last dim of a >= 4-D tensor, with its gradient retained."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.softmax, Tensor.softmax, torch.nn.functional.softmax) and isinstance(out, Tensor) \
                and out.dim() >= 4:
            out.retain_grad()
            self.outputs.append(out)
        return out


def hiera_oracle_maps(model: torch.nn.Module, x: Tensor, target: Tensor) -> dict[str, Tensor]:
    """Dense float64 generic and rollout maps of a timm ``Hiera`` on its stage-0 grid.

    Args:
        model: a timm ``Hiera`` (eval mode); an eager float64 copy is explained.
        x: (B, 3, H, W) images.
        target: (B,) class indices.

    Returns:
        ``{"generic": (B, h0, w0), "rollout": (B, h0, w0)}`` float64.
    """
    eager = copy.deepcopy(model).double().eval()
    for m in eager.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    tape = _SoftmaxTape()
    with tape:
        logits = eager(x.double())
    logits.gather(1, target[:, None]).sum().backward()
    b = x.shape[0]
    h0, w0 = (int(g) for g in model.unroll.size)
    n = h0 * w0
    eye = torch.eye(n, dtype=torch.float64).expand(b, n, n)
    gen, roll, ident = eye.clone(), eye.clone(), eye.clone()
    if len(tape.outputs) != len(model.blocks):
        raise RuntimeError(f"{len(tape.outputs)} softmax calls for {len(model.blocks)} blocks")
    for blk, probs in zip(model.blocks, tape.outputs):
        attn = blk.attn
        q = attn.q_stride
        n_out = n // q
        windows = n // (q * attn.window_size) if attn.use_mask_unit_attn else 1
        a, g = probs.detach(), probs.grad.detach()
        if a.dim() == 4:  # global attention: (B, heads, n_q, n_k)
            a, g = a[:, :, None], g[:, :, None]
        rows = torch.arange(n_out).view(-1, windows).T  # [window, slot] -> unrolled position slot * nW + window
        cols = torch.arange(n).view(-1, windows).T
        ri = rows[:, :, None].expand(-1, -1, cols.shape[1])
        ci = cols[:, None, :].expand(-1, rows.shape[1], -1)
        dense_a = torch.zeros(b, a.shape[1], n_out, n, dtype=torch.float64)
        dense_g = torch.zeros_like(dense_a)
        dense_a[:, :, ri, ci] = a
        dense_g[:, :, ri, ci] = g
        skip = torch.zeros(n_out, n, dtype=torch.float64)  # the residual: a max over q chunks, read evenly
        for c in range(q):
            skip[torch.arange(n_out), torch.arange(n_out) + c * n_out] = 1.0 / q
        cam = (dense_a * dense_g).clamp(min=0).mean(1)  # (B, n_out, n)
        gen = skip @ gen + cam @ gen
        ident = skip @ ident
        step = 0.5 * dense_a.mean(1) + 0.5 * skip
        roll = (step / step.sum(-1, keepdim=True)) @ roll
        n = n_out
    order = model.unroll(torch.arange(h0 * w0, dtype=torch.float64).view(1, -1, 1))[0, :, 0].round().long()
    out = {}
    for name, unrolled in (("generic", (gen - ident).mean(1)), ("rollout", roll.mean(1))):
        grid = torch.zeros_like(unrolled)
        grid[:, order] = unrolled  # unrolled position t holds grid token order[t]
        out[name] = grid.view(b, h0, w0)
    return out


def pointing(maps_fn: Callable[[Tensor], dict[str, Tensor]], batch) -> dict[str, tuple[float, int]]:
    """Pointing accuracy of each map kind; class-discriminative for all but rollout."""
    first = torch.stack([c[0] for c in batch.classes])
    second = torch.stack([c[1] for c in batch.classes])
    masks = [torch.stack([m[k] for m in batch.masks]) for k in (0, 1)]
    hits: dict[str, list[Tensor]] = {}
    for k, target in enumerate((first, second)):
        for name, m in maps_fn(target).items():
            if name == "rollout":
                if k == 0:
                    hits.setdefault(name, []).append(vx.metrics.pointing_game(m.float(), masks[0] | masks[1]))
            else:
                hits.setdefault(name, []).append(vx.metrics.pointing_game(m.float(), masks[k]))
    out = {}
    for name, h in hits.items():
        h = torch.cat(h).float()
        out[name] = (float(h.mean()), len(h))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="shapes-hier", help="zoo name or checkpoint .json")
    p.add_argument("--n", type=int, default=400, help="two-object images (2 targets each)")
    p.add_argument("--seed", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = vx.zoo.load(a.model) if a.model in vx.zoo.names() else vx.zoo.load_checkpoint(a.model)
    batch = vx.data.shapes(a.n, seed=a.seed, num_objects=2, distinct_classes=True)
    x = batch.tensor
    oracle = hiera_oracle_maps if hasattr(model, "unroll") else oracle_maps

    def dense(t: Tensor, chunk: int = 100) -> dict[str, Tensor]:  # chunks: the dense N x N per image add up
        parts = [oracle(model, x[i:i + chunk], t[i:i + chunk]) for i in range(0, len(x), chunk)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    results = {f"oracle {k}": v for k, v in pointing(dense, batch).items()}
    ex = vx.Explainer(model)
    for methods in (["gradcam"], ["generic", "rollout"], ["attnlrp"], ["cp_lrp"]):  # LRP alone: one forward under its rules
        try:
            def ours(t: Tensor, methods: list[str] = methods) -> dict[str, Tensor]:
                return {e.method: e.maps for e in ex.explain(x, method=methods, target=t)}

            results.update({f"vitexplain {k}": v for k, v in pointing(ours, batch).items()})
        except vx.VitexplainError as err:
            print(f"vitexplain's {'/'.join(methods)} not run: {type(err).__name__}: {str(err).splitlines()[0]}")
    print(f"model {a.model}, {a.n} two-object images, seed {a.seed}")
    rows = []
    for name, (acc, n) in results.items():
        se = math.sqrt(max(acc * (1 - acc), (1 - 1 / n) / n) / n)
        print(f"{name:22s} pointing {acc:.3f} (n {n}, SE {se:.3f}, floor acc - 3 SE {acc - 3 * se:.3f})")
        rows.append([name, f"{acc:.3f}", n, f"{se:.3f}"])
    if a.model == "shapes-hier" and report is not None:
        body = (f"{a.n} two-object images (seed {a.seed}); class-discriminative pointing (each image's two classes "
                "targeted in turn; rollout, class-agnostic, against either object). Oracle rows: this script's "
                "dense float64 maps; vitexplain rows: `vx.Explainer(model).explain`."
                + ("" if hasattr(model, "unroll") else
                   " PVTv2's oracle reads each stage transition as the mean of 2 x 2 children, not the 3 x 3 "
                   "footprints of the strided convs that vitexplain uses: the two generic rows differ by that choice.")
                + "\n\n"
                + table(["maps", "pointing", "n", "SE"], rows))
        report("Hierarchical pointing (shapes-hier)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
