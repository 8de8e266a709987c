"""Faithfulness of every method on every zoo model, scored against the shapes ground truth.

On fresh shapes images (seeds the training never saw) with two objects of different classes:

- pointing: class-discriminative pointing game (each object's class targeted in turn, a hit if the
  map's maximum lies on that object's mask, 15 px at 224 px tolerance scaled to 64 px);
- mass: relevance mass accuracy on the same pairs;
- deletion / insertion: AUC of the target probability as patches are removed (blurred) /
  inserted in order of relevance, target = the left object's class (sigmoid score);
- class sens.: correlation of the maps for the two classes of an image (near 1 = ignores the class);
- random: rank correlation with the trained model's maps after randomising every block
  (cascading from the head; near 0 = the method depends on the weights), on a subset.

Captioner rows (the transformer ``shapes-captioner`` and the Show, Attend and Tell ``shapes-sat``) score
each colour/shape word's map against the object it names, the caption explained teacher-forced.

Usage: python benchmarks/faithfulness.py [--images 500] [--random-images 64] [--captioners-only]
"""

from __future__ import annotations

import argparse
import time

import torch

import vitexplain as vx
from _common import report, table

VIT_METHODS = [
    "raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "gradcam", "cdam", "cdam_smooth",
    "cdam_integrated", "legrad", "integrated_gradients", "occlusion", "smoothgrad",
]
CNN_METHODS = ["gradcam", "gradcam++", "layercam", "spatial", "channel"]
OPTIONS = {"cdam_smooth": {"samples": 16}, "cdam_integrated": {"steps": 16}, "integrated_gradients": {"steps": 16}, "smoothgrad": {"samples": 8}}


def explain_batched(ex, x, method, target, batch=128):
    return torch.cat([ex.explain(x[i : i + batch], method=method, target=target[i : i + batch], **OPTIONS.get(method, {})).maps for i in range(0, len(x), batch)])


def classifier_rows(name: str, methods: list[str], batch, random_images: int) -> list[list[object]]:
    model = vx.zoo.load(name)
    ex = vx.Explainer(model)
    x = batch.tensor
    first = torch.stack([c[0] for c in batch.classes])
    second = torch.stack([c[1] for c in batch.classes])
    m1 = torch.stack([m[0] for m in batch.masks])
    m2 = torch.stack([m[1] for m in batch.masks])
    layers = vx.metrics.randomization_layers(model)
    rows = []
    for method in methods:
        start = time.perf_counter()
        a = explain_batched(ex, x, method, first)
        b = explain_batched(ex, x, method, second)
        pointing = torch.cat([vx.metrics.pointing_game(a, m1), vx.metrics.pointing_game(b, m2)]).float().mean().item()
        mass = torch.cat([vx.metrics.relevance_mass(a, m1), vx.metrics.relevance_mass(b, m2)]).mean().item()
        deletion = vx.metrics.deletion_auc(model, x, a, first, score="sigmoid").mean().item()
        insertion = vx.metrics.insertion_auc(model, x, a, first, score="sigmoid").mean().item()
        sensitivity = vx.metrics.class_sensitivity(a, b).mean().item()
        k = random_images
        randomized = vx.metrics.randomization_check(
            model, lambda m: vx.Explainer(m).explain(x[:k], method=method, target=first[:k], **OPTIONS.get(method, {})).maps, layers=layers
        ).correlations[-1].mean().item()
        rows.append([name, method, pointing, mass, deletion, insertion, sensitivity, randomized, time.perf_counter() - start])
        print(rows[-1], flush=True)
    return rows


def captioner_rows(name: str, batch) -> list[list[object]]:
    """Per-word pointing and mass of a zoo captioner (each colour/shape word vs the object it names)."""
    model = vx.zoo.load(name)
    ex = vx.Explainer(model)
    rows = []
    results = ex.explain_caption(batch.tensor, method=["cross", "cross_generic"], caption=batch.captions)
    for e in results:
        hits, masses = [], []
        for i, words in enumerate(batch.word_objects):
            for t, obj in enumerate(words):
                if obj < 0:
                    continue
                mask = batch.masks[i][obj][None]
                hits.append(vx.metrics.pointing_game(e.maps[i, t][None], mask))
                masses.append(vx.metrics.relevance_mass(e.maps[i, t][None], mask))
        pointing = torch.cat(hits).float()
        rows.append([name, e.method, pointing.mean().item(), torch.cat(masses).mean().item(), "", "", "", "", ""])
        print(f"{name} {e.method}: per-word pointing {pointing.mean().item():.4f} over {len(pointing)} words", flush=True)
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--random-images", type=int, default=64)
    parser.add_argument("--captioners-only", action="store_true", help="only the captioner rows (fast)")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = vx.data.shapes(args.images, seed=50_000, num_objects=2, distinct_classes=True)
    rows = []
    if not args.captioners_only:
        rows += classifier_rows("shapes-vit", VIT_METHODS, batch, args.random_images)
        rows += classifier_rows("shapes-cnn", CNN_METHODS, batch, args.random_images)
    rows += captioner_rows("shapes-captioner", batch)
    rows += captioner_rows("shapes-sat", batch)
    if args.captioners_only:
        body = (
            f"{args.images} fresh shapes images (seed 50,000) with two objects of different classes; each colour / "
            "shape word of the true caption (explained teacher-forced) against the object it names.\n\n"
            + table(["model", "method", "pointing", "mass"], [row[:4] for row in rows])
        )
        report("Faithfulness of the captioners (per word)", body)
        return
    body = (
        f"{args.images} fresh shapes images (seed 50,000) with two objects of different classes; "
        f"randomisation on the first {args.random_images}. Higher is better for pointing, mass and insertion; "
        "lower for deletion, class sensitivity (for class-discriminative methods) and randomisation.\n\n"
        + table(["model", "method", "pointing", "mass", "deletion", "insertion", "class sens.", "random", "s"], rows)
    )
    report("Faithfulness on the shapes benchmark", body)

if __name__ == "__main__":
    main()
