"""Which part of the image made the captioner say each word? Per-word figures.

The bundled ``shapes-captioner`` (a timm ViT encoder + a small transformer decoder with a KV
cache) captions shapes images; ``cross`` shows each word's cross-attention, ``cross_generic``
Chefer's encoder-decoder relevance for that word::

    python examples/captioning.py --out out/captioning
    python examples/captioning.py --out /tmp/cap --quick      # CI smoke mode
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import vitexplain as vx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/captioning")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="CI smoke mode")
    args = parser.parse_args()
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)
    n = 2 if args.quick else args.images

    model = vx.zoo.load("shapes-captioner")
    ex = vx.Explainer(model)
    batch = vx.data.shapes(n, seed=40_000, num_objects=(2, 3), distinct_classes=True)
    cross, generic = ex.explain_caption(batch.tensor, method=["cross", "cross_generic"])
    out = Path(args.out)
    tile = 96 if args.quick else 128
    for i in range(n):
        print(f"image {i}: generated {cross.captions[i]!r} (truth {batch.captions[i]!r})")
        figures = [e.figure(i, image=vx.viz.readable(batch.images[i]), tile_size=tile) for e in (cross, generic)]
        width = max(f.shape[1] for f in figures)
        padded = [np.pad(f, ((0, 0), (0, width - f.shape[1]), (0, 0)), constant_values=255) for f in figures]
        path = vx.viz.save_png(out / f"caption_{i}.png", np.concatenate(padded, axis=0))
        print(f"  wrote {path} (top: cross, bottom: cross_generic)")


if __name__ == "__main__":
    main()
