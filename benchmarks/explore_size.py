"""Size of explorer pages (``vx.explore``): one image per page, per model.

Usage::

    python benchmarks/explore_size.py [--out DIR]

Writes one page per model into ``--out`` (default: a temporary folder) and reports its size
against the budgets of the issue (one 224 px ViT-S/16 image <= 6 MB, one shapes image <= 1 MB),
what the page embeds (tokens, layers x heads), and the time to build it. The ViT-B/16 at 384 px
(577 tokens) row shows the budget rule: past ``attention_budget`` fewer layers are embedded.
Sizes do not depend on the weights (the arrays are uint8 + base64), so random-init timm
models stand in for pretrained ones; the image PNG is the only part that varies.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import vitexplain as vx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, table  # type: ignore[import-not-found]  # noqa: E402


def _photo(size: int) -> np.ndarray:
    """A smooth synthetic photo-like image (gradients and discs: a PNG of realistic size)."""
    y, x = np.mgrid[0:size, 0:size] / size
    rgb = np.stack([0.5 + 0.5 * np.sin(6 * x + 2 * y), 0.5 + 0.5 * np.cos(5 * y), x * y], -1)
    for cx, cy, r in ((0.3, 0.4, 0.15), (0.7, 0.6, 0.2)):
        rgb[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = (0.9, 0.2, 0.1)
    noise = np.random.default_rng(0).normal(0, 0.03, rgb.shape)
    return (np.clip(rgb + noise, 0, 1) * 255).astype(np.uint8)


def _timm(name: str, **kwargs) -> object:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **kwargs).eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="vx-explore-"))
    shapes = vx.data.shapes(1, seed=10_000, num_objects=2).images[0]
    cases = [
        ("shapes-vit", "64 px", lambda: vx.zoo.load("shapes-vit"), shapes, 1_000_000),
        ("shapes-cnn", "64 px", lambda: vx.zoo.load("shapes-cnn"), shapes, 1_000_000),
        ("shapes-captioner", "64 px", lambda: vx.zoo.load("shapes-captioner"), shapes, 1_000_000),
        ("vit_small_patch16_224 (random init)", "224 px", lambda: _timm("vit_small_patch16_224"), _photo(224), 6_000_000),
        ("vit_base_patch16_384 (random init)", "384 px", lambda: _timm("vit_base_patch16_384"), _photo(384), None),
    ]
    rows = []
    for name, size, load, image, budget in cases:
        model = load()
        start = time.perf_counter()
        path = vx.explore(model, [image], out / f"{name.split()[0]}.html")
        seconds = time.perf_counter() - start
        text = path.read_text()
        data = json.loads(re.search(r'id="vx-data">(.*?)</script>', text, re.S).group(1))["images"][0]
        att = data["attention"]
        if att and att["probs"]:
            n = att["prefix"] + att["grid"][0] * att["grid"][1]
            embedded = f"{n} tokens, {len(att['layerIndex'])} layers x {len(att['heads'])} heads"
            if att["note"]:
                embedded += f" ({att['note']})"
        else:
            embedded = "no attention views"
        mb = path.stat().st_size / 1e6
        verdict = "-" if budget is None else ("within" if mb * 1e6 <= budget else "OVER") + f" {budget / 1e6:g} MB"
        rows.append([name, size, embedded, round(mb, 3), verdict, round(seconds, 1)])
    body = table(["model", "input", "attention embedded", "page MB", "budget", "build s"], rows)
    body += (
        "\n\nOne image per page, default methods (ViT: generic, grad_rollout, cdam, gradcam for each of "
        "the top 3 classes, rollout; CNN: gradcam, layercam, gradcam++, spatial, channel; captioner: "
        "cross, cross_generic). Attention: every layer's and head's N x N probabilities plus the rollout "
        "after each layer, uint8 per row part (prefix keys, patch keys) with a float32 scale, base64; "
        "default `attention_budget` 5 MB per image."
    )
    report("Explorer page sizes", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
