"""Write the sample shapes images shipped in ``assets/samples/`` (for the README quick start).

Usage::

    python -m vitexplain.data.samples assets/samples

Writes eight 64 x 64 PNG images (the zoo models' native size) with one, two and three objects,
named after their captions (``01_red_circle.png``, ...), and ``samples.json`` with each file's
caption, shape classes, colors and seed/index in the generator (seed 20_000, held out from
training). Deterministic: rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .drawing import COLORS, SHAPES
from .synthetic import shapes

__all__ = ["SAMPLE_SEED", "write_samples", "main"]

#: Generator seed of the sample images (held out: training uses seeds < 9_000).
SAMPLE_SEED = 20_000
# (number of objects, distinct classes) per sample file
_SPECS: tuple[tuple[int, bool], ...] = (
    (1, False), (1, False), (2, True), (2, True), (2, True), (3, True), (3, True), (3, False),
)


def write_samples(out_dir: str | Path, size: int = 64) -> list[Path]:
    """Write the sample PNGs and ``samples.json`` into ``out_dir``.

    Picks, for each slot of a fixed plan (1, 1, 2, 2, 2, 3, 3, 3 objects), the first image of
    the seed-``SAMPLE_SEED`` stream that adds a shape or color not shown yet, so the set is varied.

    Args:
        out_dir: destination folder (created if needed).
        size: image side in pixels.

    Returns:
        Paths of the PNG files, in order.
    """
    from PIL import Image

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen_shapes: set[int] = set()
    seen_colors: set[int] = set()
    paths: list[Path] = []
    manifest: list[dict[str, object]] = []
    for slot, (k, distinct) in enumerate(_SPECS):
        pool = shapes(32, seed=SAMPLE_SEED + slot, size=size, num_objects=k, distinct_classes=distinct)
        pick = 0
        for i in range(len(pool)):
            cls, col = set(pool.classes[i].tolist()), set(pool.colors[i].tolist())
            if not cls <= seen_shapes or not col <= seen_colors:
                pick = i
                break
        seen_shapes |= set(pool.classes[pick].tolist())
        seen_colors |= set(pool.colors[pick].tolist())
        caption = pool.captions[pick]
        path = out / f"{slot + 1:02d}_{caption.replace(' ', '_')}.png"
        Image.fromarray(np.ascontiguousarray(pool.images[pick])).save(path, optimize=True)
        paths.append(path)
        manifest.append({
            "file": path.name,
            "caption": caption,
            "shapes": [SHAPES[c] for c in pool.classes[pick].tolist()],
            "colors": [COLORS[c] for c in pool.colors[pick].tolist()],
            "seed": SAMPLE_SEED + slot,
            "index": int(pool.indices[pick]),
            "size": size,
            "num_objects": k,
            "distinct_classes": distinct,
        })
    with open(out / "samples.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point: ``python -m vitexplain.data.samples OUT_DIR``."""
    p = argparse.ArgumentParser(prog="python -m vitexplain.data.samples", description=__doc__.split("\n")[0])
    p.add_argument("out_dir", nargs="?", default="assets/samples")
    p.add_argument("--size", type=int, default=64)
    a = p.parse_args(argv)
    for path in write_samples(a.out_dir, a.size):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
