"""Conservation of the LRP variants: input relevance / explained logit, for every rule setting.

Rewrites the "LRP conservation" section of docs/benchmarks.md.

For ``attnlrp`` and ``cp_lrp`` with linears and convolutions as they are (epsilon) and with zennit
Gamma rules (the gammas lxt's ViT example sweeps), on the trained ``shapes-vit`` (held-out
two-object shapes images, each object's class explained in turn) and on a random-init timm
``vit_small_patch16_224``: the ratio ``sum of the pixel relevance / target logit`` per image
(1 = relevance conserved; biases, position embeddings and AttnLRP's softmax rule absorb or add
some), its median and spread, and, on shapes-vit, the pointing game at zero tolerance.

Usage: python benchmarks/lrp_conservation.py [--images 100] [--random-images 4]
"""

from __future__ import annotations

import argparse

import timm
import torch

import vitexplain as vx
from _common import report, table

VARIANTS = [
    ("attnlrp", {}), ("cp_lrp", {}),
    ("attnlrp", {"conv_gamma": 0.25}), ("attnlrp", {"linear_gamma": 0.05}),
    ("attnlrp", {"conv_gamma": 0.25, "linear_gamma": 0.05}), ("attnlrp", {"conv_gamma": 100.0, "linear_gamma": 1.0}),
    ("cp_lrp", {"conv_gamma": 0.25, "linear_gamma": 0.05}),
]


def describe(options: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in options.items()) or "epsilon (gamma 0)"


def ratios(ex: vx.Explainer, x: torch.Tensor, method: str, options: dict, target) -> tuple[torch.Tensor, torch.Tensor]:
    e = ex.explain(x, method=method, target=target, **options)
    return e.extras["conservation"], e.maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--random-images", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = vx.data.shapes(args.images, seed=50_000, num_objects=2, distinct_classes=True)
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    targets = [torch.stack([c[k] for c in batch.classes]) for k in (0, 1)]
    masks = [torch.stack([m[k] for m in batch.masks]) for k in (0, 1)]
    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=10).eval()
    vex = vx.Explainer(vit)
    xr = torch.randn(args.random_images, 3, 224, 224)
    rows = []
    for method, options in VARIANTS:
        cons, hits = [], []
        for target, mask in zip(targets, masks):
            ratio, maps = ratios(ex, batch.tensor, method, options, target)
            cons.append(ratio)
            hits.append(vx.metrics.pointing_game(maps, mask, tolerance=0))
        c = torch.cat(cons)
        r, _ = ratios(vex, xr, method, options, None)
        q = torch.quantile(c, torch.tensor([0.1, 0.5, 0.9]))
        rows.append([method, describe(options), float(q[1]), f"{q[0]:.3f} .. {q[2]:.3f}",
                     torch.cat(hits).float().mean().item(), float(r.median()), f"{r.min():.3f} .. {r.max():.3f}"])
        print(rows[-1], flush=True)
    body = (
        f"Input relevance / target logit per image. shapes-vit: {args.images} held-out two-object images (seed 50,000), "
        f"each object's class explained ({2 * args.images} targets), with the pointing game at zero tolerance; "
        f"vit_small_patch16_224 (random init, 10 classes): {args.random_images} Gaussian images, predicted class. "
        "1 = conserved. Gamma rules are zennit's (linears: every F.linear, including attention projections; "
        "convolutions: the patch embedding).\n\n"
        + table(["method", "rules", "shapes-vit median", "10-90 %", "point@0", "vit_small median", "min .. max"], rows)
    )
    report("LRP conservation", body)


if __name__ == "__main__":
    main()
