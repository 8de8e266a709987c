"""Quick start: explain one image with three methods and save a labelled overlay grid.

Uses the bundled ``shapes-vit`` (offline) and a bundled sample image::

    python examples/quickstart.py --out out/quickstart
    python examples/quickstart.py --out /tmp/qs --quick      # CI smoke mode (same, smaller figure)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import vitexplain as vx

SAMPLE = Path(__file__).resolve().parent.parent / "assets" / "samples" / "04_blue_star_and_green_circle.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default=str(SAMPLE), help="image to explain")
    parser.add_argument("--out", default="out/quickstart", help="output folder")
    parser.add_argument("--quick", action="store_true", help="CI smoke mode")
    args = parser.parse_args()
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)

    model = vx.zoo.load("shapes-vit")
    ex = vx.Explainer(model)
    methods = ["rollout", "generic", "cdam"]
    # explain the top prediction, then every label the model sees in the image
    logits = ex.explain([args.image], method="raw").logits[0]
    labels = [i for i in logits.sigmoid().gt(0.5).nonzero().flatten().tolist()] or [int(logits.argmax())]
    rows, names = [], []
    for label in labels:
        results = ex.explain([args.image], method=methods, target=label)
        image = results[0].images[0]
        rows.append([vx.viz.readable(image)] + [e.overlay(0, image=vx.viz.readable(image)) for e in results])  # drawn at >= 256 px
        names.append(results[0].target_names()[0])
        scores = ", ".join(f"{e.method}: max at {divmod(int(e.maps[0].argmax()), e.maps.shape[-1])}" for e in results)
        print(f"target {names[-1]!r} (p={logits[label].sigmoid():.3f}) -> {scores}")
    tile = 96 if args.quick else 192
    figure = vx.viz.grid(rows, row_labels=names, col_labels=["image", *methods], tile_size=(tile, tile))
    out = Path(args.out)
    path = vx.viz.save_png(out / "quickstart.png", figure)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
