"""Explain your own timm model.

Tries ``pretrained=True`` (real weights give real maps); when the weights cannot be reached
(offline, no cache) it says so and continues with ``pretrained=False`` so the whole pipeline
still runs::

    python examples/own_timm_model.py --model vit_small_patch16_224 --image photo.jpg --out out/own
    python examples/own_timm_model.py --out /tmp/own --quick --offline     # CI smoke mode

With real weights, pass ``--target "golden retriever"`` (an ImageNet label) or a class index.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import timm

import vitexplain as vx

SAMPLE = Path(__file__).resolve().parent.parent / "assets" / "samples" / "03_green_cross_and_red_circle.png"


def build(name: str, offline: bool, **kwargs):
    if not offline:
        try:
            return timm.create_model(name, pretrained=True, **kwargs), True
        except Exception as err:  # no network, no cache, no weights for this name
            print(f"could not load pretrained weights for {name!r} ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
    print(f"continuing with {name}(pretrained=False): random weights, so the maps only show the plumbing")
    return timm.create_model(name, pretrained=False, **kwargs), False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--image", default=str(SAMPLE))
    parser.add_argument("--target", default=None, help="class index or label name (default: top prediction)")
    parser.add_argument("--out", default="out/own_timm_model")
    parser.add_argument("--offline", action="store_true", help="do not try to download weights")
    parser.add_argument("--quick", action="store_true", help="CI smoke mode: a tiny model at 64 px")
    args = parser.parse_args()
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)

    kwargs = dict(img_size=64, depth=2) if args.quick else {}
    model, pretrained = build(args.model, args.offline or args.quick, **kwargs)
    model.eval()
    ex = vx.Explainer(model)
    target = int(args.target) if args.target and args.target.isdigit() else args.target
    methods = ["rollout", "generic", "cdam", "gradcam"]
    results = ex.explain([args.image], method=methods, target=target)
    top = results[0].logits[0].softmax(-1).topk(3)
    names = results[0].label_names
    print("top-3:", [(names[i] if names else i, round(p, 3)) for p, i in zip(top.values.tolist(), top.indices.tolist())])
    image = results[0].images[0]
    figure = vx.viz.grid([[image] + [e.overlay(0) for e in results]], col_labels=["image", *methods], tile_size=(160, 160))
    print(f"wrote {vx.viz.save_png(Path(args.out) / 'own_model.png', figure)} (pretrained={pretrained})")


if __name__ == "__main__":
    main()
