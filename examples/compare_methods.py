"""Compare methods on several shapes images: a figure grid and a metrics table.

For images with two objects of different classes, every method explains each object's class;
the table reports the class-discriminative pointing game, relevance mass accuracy and
deletion / insertion AUC (16 steps of 4 of the 64 patches each) against the ground-truth masks
(``vx.metrics``)::

    python examples/compare_methods.py --out out/compare
    python examples/compare_methods.py --out /tmp/cmp --quick     # CI smoke mode
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

import vitexplain as vx

METHODS = ["raw", "rollout", "attn_gradcam", "gradcam", "generic", "cdam", "legrad", "integrated_gradients"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/compare")
    parser.add_argument("--images", type=int, default=64, help="images scored (the figure shows 4)")
    parser.add_argument("--chunk", type=int, default=16, help="images explained and scored per step")
    parser.add_argument("--quick", action="store_true", help="CI smoke mode")
    args = parser.parse_args()
    n = 8 if args.quick else args.images
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)

    model = vx.zoo.load("shapes-vit")
    ex = vx.Explainer(model)
    batch = vx.data.shapes(n, seed=30_000, num_objects=2, distinct_classes=True)
    target = torch.stack([c[0] for c in batch.classes])  # the left object's class
    masks = torch.stack([m[0] for m in batch.masks])
    opts = {"integrated_gradients": {"steps": 8 if args.quick else 32}}

    # explained and scored a chunk of images at a time (a progress line each); scores summed per method
    sums = {name: torch.zeros(4, dtype=torch.float64) for name in METHODS}
    first = None
    steps = range(0, n, args.chunk)
    for start in tqdm(steps, desc=f"{len(METHODS)} methods + 4 metrics", unit="chunk", disable=len(steps) < 2):
        part = slice(start, min(n, start + args.chunk))
        x, t, m = batch.tensor[part], target[part], masks[part]
        results = ex.explain(x, method=METHODS, target=t, **opts)
        first = first or results  # the figure shows the first images
        for e in results:
            sums[e.method] += torch.tensor([
                vx.metrics.pointing_game(e.maps, m).float().sum().item(),
                vx.metrics.relevance_mass(e.maps, m).sum().item(),
                vx.metrics.deletion_auc(model, x, e.maps, e.targets, score="sigmoid", steps=16).sum().item(),
                vx.metrics.insertion_auc(model, x, e.maps, e.targets, score="sigmoid", steps=16).sum().item(),
            ], dtype=torch.float64)
    print(f"{n} images, target = the left object's class (shapes-vit)")
    print(f"{'method':22s} {'pointing':>9s} {'rel.mass':>9s} {'deletion':>9s} {'insertion':>9s}")
    for name in METHODS:
        print(f"{name:22s} " + " ".join(f"{v / n:9.3f}" for v in sums[name].tolist()))

    shown = range(min(4, n, args.chunk))
    tiles = [[vx.viz.readable(batch.images[i])] + [e.overlay(i, image=vx.viz.readable(batch.images[i])) for e in first]
             for i in shown]
    labels = [vx.data.SHAPES[int(target[i])] for i in shown]
    tile = 80 if args.quick else 160
    figure = vx.viz.grid(tiles, row_labels=labels, col_labels=["image", *METHODS], tile_size=(tile, tile))
    print(f"wrote {vx.viz.save_png(Path(args.out) / 'compare_methods.png', figure)}")


if __name__ == "__main__":
    main()
