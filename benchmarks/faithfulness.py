"""Faithfulness of every method on every metric, on every zoo model, scored against the shapes ground truth.

Rewrites the "Faithfulness on the shapes benchmark" section of docs/benchmarks.md (and, with
``--captioners-only``, "Faithfulness of the captioners (per word)").

On fresh shapes images (seeds the training never saw) with two objects of different classes, each
object's class targeted in turn:

- localisation (all images, both targets): pointing game (the map's maximum at image resolution on
  the object, 4 px tolerance at 64 px, i.e. 15 px at 224 px) and at zero tolerance (``point@0``: on
  the mask itself, which credits maps at pixel resolution); relevance mass and relevance rank
  accuracy (Arras et al. 2022); top-k intersection (Theiner et al. 2021, k = 2 % of the pixels);
- perturbation (all images, target = the left object's class, sigmoid score): deletion / insertion
  AUC (Petsiuk et al. 2018) in 64 steps (a patch, or 1/64 of the pixels, per step); ROAD MoRF and LeRF (Rong et al. 2022: mean target probability over 10-90 %
  of the pixels imputed, on the first ``--robust-images``);
- concentration: sparseness (Gini) and complexity (entropy) of |map| (Chalasani et al. 2020, Bhatt et
  al. 2020);
- class sens.: correlation of the maps for the two classes of an image (near 1 = ignores the class);
- robustness (first ``--robust-images``, here and below those whose map is not all zero: the relative change
  and eMPRT's relative rise of a zero map are undefined): max- and avg-sensitivity (Yeh et al. 2019; relative change
  under ``--samples`` uniform perturbations of radius 0.05 in the normalised input);
- randomisation (first ``--robust-images``): cascading randomisation (Adebayo et al. 2018, rank
  correlation after every block is randomised, near 0 = depends on the weights); efficient MPRT
  (relative rise of the histogram entropy, higher = depends on the weights) and smooth MPRT (rank
  correlation of noise-averaged maps after bottom-up randomisation, ``--samples`` noisy copies).

Captioner rows (the transformer ``shapes-captioner`` and the Show, Attend and Tell ``shapes-sat``) score
each colour/shape word's map against the object it names (the caption explained teacher-forced) on
the localisation and concentration metrics; the perturbation, robustness and randomisation metrics
need a classifier's score and are left blank for them.

Usage: python benchmarks/faithfulness.py [--images 500] [--robust-images 16] [--samples 8]
       [--methods attnlrp,cp_lrp,...] [--captioners-only]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch

import vitexplain as vx
from _common import report, table

VIT_METHODS = [
    "raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "gradcam", "cdam", "cdam_smooth",
    "cdam_integrated", "legrad", "integrated_gradients", "occlusion", "smoothgrad", "attnlrp", "cp_lrp",
]
CNN_METHODS = ["gradcam", "gradcam++", "layercam", "spatial", "channel"]
OPTIONS = {"cdam_smooth": {"samples": 16}, "cdam_integrated": {"steps": 16}, "integrated_gradients": {"steps": 16}, "smoothgrad": {"samples": 8}}
TOPK_FRACTION = 0.02
STEPS = 64  # deletion / insertion steps: one per patch of a patch-grid map, 64 pixels each for a pixel map
RADIUS = 0.05
HEADER = ["model", "method", "pointing", "point@0", "mass", "rank acc", "top-k", "deletion", "insertion", "ROAD MoRF",
          "ROAD LeRF", "sparse", "complex", "class sens.", "max sens", "avg sens", "random", "eMPRT", "sMPRT", "s"]


def explain_batched(ex: vx.Explainer, x: torch.Tensor, method: str, target: torch.Tensor, batch: int = 128) -> torch.Tensor:
    return torch.cat([ex.explain(x[i : i + batch], method=method, target=target[i : i + batch], **OPTIONS.get(method, {})).maps
                      for i in range(0, len(x), batch)])


def localisation(a: torch.Tensor, b: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> list[float]:
    """Pointing (default tolerance and 0), mass, rank accuracy, top-k intersection over both targets."""
    k = max(1, round(TOPK_FRACTION * m1.shape[-2] * m1.shape[-1]))

    def both(fn: Callable[..., torch.Tensor], **kw: Any) -> float:
        return torch.cat([fn(a, m1, **kw), fn(b, m2, **kw)]).float().mean().item()

    return [both(vx.metrics.pointing_game), both(vx.metrics.pointing_game, tolerance=0), both(vx.metrics.relevance_mass),
            both(vx.metrics.relevance_rank_accuracy), both(vx.metrics.top_k_intersection, k=k)]


def concentration(a: torch.Tensor) -> list[float]:
    return [vx.metrics.sparseness(a).mean().item(), vx.metrics.complexity(a).mean().item()]


def classifier_rows(name: str, methods: list[str], batch, robust: int, samples: int) -> list[list[object]]:
    model = vx.zoo.load(name)
    ex = vx.Explainer(model)
    x = batch.tensor
    first = torch.stack([c[0] for c in batch.classes])
    second = torch.stack([c[1] for c in batch.classes])
    m1 = torch.stack([m[0] for m in batch.masks])
    m2 = torch.stack([m[1] for m in batch.masks])
    layers = vx.metrics.randomization_layers(model)
    xr, tr = x[:robust], first[:robust]
    rows = []
    for method in methods:
        start = time.perf_counter()
        opts = OPTIONS.get(method, {})
        a = explain_batched(ex, x, method, first)
        b = explain_batched(ex, x, method, second)
        scores = localisation(a, b, m1, m2)
        deletion = vx.metrics.deletion_auc(model, x, a, first, score="sigmoid", steps=STEPS).mean().item()
        insertion = vx.metrics.insertion_auc(model, x, a, first, score="sigmoid", steps=STEPS).mean().item()
        road = [vx.metrics.road(model, xr, a[:robust], tr, order=order, score="sigmoid").curves.mean().item()
                for order in ("morf", "lerf")]
        sensitivity = vx.metrics.class_sensitivity(a, b).mean().item()

        # relative sensitivity and eMPRT are undefined for an all-zero map (attn_gradcam's clamp leaves some): the
        # robustness and randomisation columns are over the other robust images
        kept = (a[:robust].flatten(1).abs().amax(1) > 0).nonzero().flatten()
        xk, tk = xr[kept], tr[kept]

        def on_inputs(inp: torch.Tensor) -> torch.Tensor:
            return ex.explain(inp, method=method, target=tk, **opts).maps

        def on_model(m: torch.nn.Module, inp: torch.Tensor = xk) -> torch.Tensor:
            return vx.Explainer(m).explain(inp, method=method, target=tk, **opts).maps

        if len(kept):
            stable = [fn(on_inputs, xk, radius=RADIUS, samples=samples, maps=a[:robust][kept]).mean().item()
                      for fn in (vx.metrics.max_sensitivity, vx.metrics.avg_sensitivity)]
            randomized = vx.metrics.randomization_check(model, on_model, layers=layers).correlations[-1].mean().item()
            emprt = vx.metrics.efficient_mprt(model, on_model, layers=layers).scores.mean().item()
            smprt = vx.metrics.smooth_mprt(model, on_model, xk, samples=samples,
                                           layers=layers).correlations[-1].mean().item()
        else:
            stable, randomized, emprt, smprt = [math.nan, math.nan], math.nan, math.nan, math.nan
        rows.append([name, method, *scores, deletion, insertion, *road, *concentration(a), sensitivity, *stable,
                     randomized, emprt, smprt, time.perf_counter() - start])
        print(rows[-1], flush=True)
    return rows


def captioner_rows(name: str, batch) -> list[list[object]]:
    """Per-word localisation and concentration of a zoo captioner (each colour/shape word vs the object it names)."""
    model = vx.zoo.load(name)
    ex = vx.Explainer(model)
    rows = []
    methods = ex.methods()
    results = ex.explain_caption(batch.tensor, method=methods, caption=batch.captions)
    for e in results:
        start = time.perf_counter()
        maps, masks = [], []
        for i, words in enumerate(batch.word_objects):
            for t, obj in enumerate(words):
                if obj >= 0:
                    maps.append(e.maps[i, t])
                    masks.append(batch.masks[i][obj])
        maps_t, masks_t = torch.stack(maps), torch.stack(masks)
        k = max(1, round(TOPK_FRACTION * masks_t.shape[-2] * masks_t.shape[-1]))
        scores = [vx.metrics.pointing_game(maps_t, masks_t).float().mean().item(),
                  vx.metrics.pointing_game(maps_t, masks_t, tolerance=0).float().mean().item(),
                  vx.metrics.relevance_mass(maps_t, masks_t).mean().item(),
                  vx.metrics.relevance_rank_accuracy(maps_t, masks_t).mean().item(),
                  vx.metrics.top_k_intersection(maps_t, masks_t, k).mean().item()]
        rows.append([name, e.method, *scores, "", "", "", "", *concentration(maps_t), "", "", "", "", "", "",
                     time.perf_counter() - start])
        print(f"{name} {e.method}: per-word pointing {scores[0]:.4f} over {len(maps)} words", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--robust-images", type=int, default=16, help="images for ROAD, sensitivity and randomisation")
    parser.add_argument("--samples", type=int, default=8, help="perturbations (sensitivity) and noisy copies (sMPRT)")
    parser.add_argument("--methods", default="", help="comma-separated ViT methods (default: all)")
    parser.add_argument("--captioners-only", action="store_true", help="only the captioner rows (fast)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = vx.data.shapes(args.images, seed=50_000, num_objects=2, distinct_classes=True)
    robust = min(args.robust_images, args.images)
    rows = []
    vit_methods = [m for m in args.methods.split(",") if m] or VIT_METHODS
    if not args.captioners_only:
        rows += classifier_rows("shapes-vit", vit_methods, batch, robust, args.samples)
        if not args.methods:
            rows += classifier_rows("shapes-cnn", CNN_METHODS, batch, robust, args.samples)
    rows += captioner_rows("shapes-captioner", batch)
    rows += captioner_rows("shapes-sat", batch)
    header = HEADER
    if args.captioners_only:
        body = (
            f"{args.images} fresh shapes images (seed 50,000) with two objects of different classes; each colour / "
            "shape word of the true caption (explained teacher-forced) against the object it names.\n\n"
            + table(header[:7] + ["sparse", "complex", "s"], [row[:7] + row[11:13] + row[-1:] for row in rows])
        )
        report("Faithfulness of the captioners (per word)", body)
        return
    body = (
        f"{args.images} fresh shapes images (seed 50,000) with two objects of different classes, each class targeted; "
        f"ROAD, sensitivity and randomisation on the first {robust} ({args.samples} perturbations / noisy copies). "
        "Higher is better for pointing, point@0 (zero tolerance), mass, rank accuracy, top-k, insertion, ROAD LeRF, "
        "eMPRT; lower for deletion, ROAD MoRF, max/avg sensitivity, class sensitivity (for class-discriminative "
        "methods), random and sMPRT (correlations with the trained model's maps after randomisation). Sparseness "
        "and complexity describe the maps (more concentrated: higher sparseness, lower complexity). See the "
        "script's docstring for each definition.\n\n" + table(header, rows)
    )
    # a run on some methods only writes its own section, leaving the full table in place
    report("Faithfulness on the shapes benchmark" + (f" ({', '.join(vit_methods)})" if args.methods else ""), body)


if __name__ == "__main__":
    main()
