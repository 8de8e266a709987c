"""Spatial and channel attention of CNNs (CBAM / SE / ECA gates) next to the Grad-CAM family.

Two models:

1. ``shapes-cnn`` from the bundled zoo: a tiny timm ResNet with ECA, SE and CBAM attention,
   trained on the synthetic shapes benchmark, so its maps mean something (the spatial gate
   and Grad-CAM land on the objects).
2. a timm ResNet-18 with CBAM in every block, built with ``pretrained=False``: random weights,
   so the maps only show that the plumbing works on a standard timm CNN. Real weights give real
   maps: with network access (or a filled Hugging Face cache) build a pretrained attention CNN
   instead, e.g. ``timm.create_model("seresnet50.a1_in1k", pretrained=True)`` (SE gates) or
   ``timm.create_model("ecaresnet50t.ra2_in1k", pretrained=True)`` (ECA gates); torchvision's
   ``efficientnet_b0(weights="DEFAULT")`` / ``regnet_y_400mf(weights="DEFAULT")`` work the same
   way. This script never downloads anything.

Writes PNG figures to ``--out``::

    python examples/cnn_attention.py --out cnn_attention_out            # ~10-30 s on a CPU
    python examples/cnn_attention.py --out /tmp/cnn_smoke --quick       # CI smoke mode
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

import vitexplain as vx

METHODS = ["spatial", "channel", "gradcam", "gradcam++", "layercam"]


def _where(module: Any) -> str:
    """Short label of the module(s) a map was read from: its stage, or "mean of N" gates."""
    if isinstance(module, str):
        return module.split(".")[0]
    return f"mean of {len(module)}"


def figure(images: Sequence[np.ndarray], explanations: Sequence[Any], row_labels: Sequence[str]) -> np.ndarray:
    """Rows = images, columns = the image and one overlay per method (gates: with their module)."""
    rows = []
    for i, image in enumerate(images):
        rows.append([vx.viz.readable(image)] + [e.overlay(i, image=vx.viz.readable(image)) for e in explanations])
    columns = [f"{e.method} {_where(e.extras['module'])}" if "module" in e.extras else e.method for e in explanations]
    return vx.viz.grid(rows, row_labels=list(row_labels), col_labels=["image", *columns], tile_size=(160, 160))


def explain_shapes_cnn(out: Path, n: int, device: str) -> None:
    """shapes-cnn on shapes images with two objects; each row explains the left object's class."""
    try:
        model = vx.zoo.load("shapes-cnn").to(device)
    except FileNotFoundError as err:
        print(f"[shapes-cnn] skipped: {err}")
        return
    batch = vx.data.shapes(n=n, seed=10_000, num_objects=2, distinct_classes=True)
    x = batch.tensor.to(device)
    targets = torch.stack([c[0] for c in batch.classes])  # the left object's class
    ex = vx.Explainer(model)
    explanations = ex.explain(x, method=METHODS, target=targets)
    # the spatial gate of another stage: method options select a stage or module by name
    explanations.insert(1, ex.explain(x, method="spatial", module="layer3"))
    images = list(batch.images)
    labels = [f"target {name}" for name in explanations[0].target_names()]
    vx.viz.save_png(out / "shapes_cnn_methods.png", figure(images, explanations, labels))
    channel = next(e for e in explanations if e.method == "channel")
    vx.viz.save_png(out / "shapes_cnn_channels.png", vx.viz.channel_tiles(images[0], channel, k=8))
    union = torch.stack([m.any(0) for m in batch.masks])
    for spatial in (e for e in explanations if e.method == "spatial"):
        hits = vx.metrics.pointing_game(spatial.maps.cpu(), union).float().mean()
        print(f"[shapes-cnn] spatial gate of {spatial.extras['module']}: max on an object in {float(hits):.0%} of {n} images")


def explain_timm_cnn(out: Path, n: int, size: int, device: str) -> None:
    """A random-init timm CBAM ResNet-18 on the same kind of images (plumbing only, see the docstring)."""
    import timm

    # zero_init_last=False: timm zero-initialises each block's last norm, which would make the
    # attention modules' inputs (and so their maps) all zero in an untrained model.
    model = timm.create_model(
        "resnet18", pretrained=False, num_classes=5, block_args=dict(attn_layer="cbam"), zero_init_last=False
    ).to(device).eval()
    images = vx.data.shapes(n=n, seed=10_000, size=size).images  # (n, size, size, 3) uint8 RGB
    # normalised with the model's own mean/std at the images' size (CNNs take any input size);
    # ex.explain(list_of_images) would instead resize and crop them to the model's 224 px
    cfg = model.pretrained_cfg
    mean, std = (torch.tensor(cfg[k]).view(1, 3, 1, 1) for k in ("mean", "std"))
    x = ((torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255 - mean) / std).to(device)
    ex = vx.Explainer(model)
    explanations = ex.explain(x, method=METHODS)
    seen = list(images)
    labels = [f"class {t}" for t in explanations[0].targets.tolist()]
    vx.viz.save_png(out / "timm_cbam_resnet18_random_methods.png", figure(seen, explanations, labels))
    channel = explanations[METHODS.index("channel")]
    vx.viz.save_png(out / "timm_cbam_resnet18_random_channels.png", vx.viz.channel_tiles(seen[0], channel, k=8))
    print(f"[timm resnet18+cbam, random weights] stages {ex.adapter.stages}, gradcam layer {ex.adapter.target_layer!r}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("cnn_attention_out"), help="folder for the PNGs")
    parser.add_argument("--n", type=int, default=4, help="images per figure")
    parser.add_argument("--size", type=int, default=224, help="image size for the timm CNN")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 2 images, 64 px")
    args = parser.parse_args(argv)
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)
    n, size = (2, 64) if args.quick else (args.n, args.size)
    start = time.perf_counter()
    explain_shapes_cnn(args.out, n, args.device)
    explain_timm_cnn(args.out, n, size, args.device)
    written = sorted(p.name for p in args.out.glob("*.png"))
    print(f"wrote {written} to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
