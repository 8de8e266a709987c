"""Per-word pointing of the VLM methods on the bundled shapes-vlm (the family's ground truth).

For held-out two-object images (``vx.data.shapes(n, seed, num_objects=2)``, seeds >= 10_000 are
never trained on), the reference caption is explained teacher-forced after the prompt
``"describe the image"`` with every VLM method; each colour / shape word's map (at the image's
resolution) is a hit when ``vx.metrics.pointing_game`` finds its peak on the object the word names
(``batch.word_objects``). Prints the accuracy, its standard error and the word count per method
(side by side, one run) and stores the table in docs/benchmarks.md (``--no-report``: print only).

Usage: python benchmarks/vlm_pointing.py [--n 200] [--seed 20000] [--no-report]
"""

from __future__ import annotations

import argparse
import math

import torch

import vitexplain as vx
from _common import report, table

METHODS = ("cross", "cross_generic", "cross_grad", "attnlrp", "cp_lrp")


def pointing(n: int, seed: int, methods=METHODS, chunk: int = 25) -> dict[str, list[bool]]:
    """Per method, one hit/miss per colour or shape word of ``n`` two-object images."""
    from vitexplain.data import COLORS, SHAPES

    model = vx.zoo.load("shapes-vlm")
    ex = vx.Explainer(model, processor=vx.zoo.processor(model))
    batch = vx.data.shapes(n, seed=seed, num_objects=2)
    content = set(COLORS) | set(SHAPES)
    hits: dict[str, list[bool]] = {m: [] for m in methods}
    for s in range(0, n, chunk):
        sub = batch[s: s + chunk]
        results = ex.explain_caption(list(sub.images), method=list(methods), caption=sub.captions,
                                     prompt="describe the image")
        for r in results:
            for i, caption in enumerate(sub.captions):
                words = caption.split()
                if r.tokens[i][: len(words)] != words:
                    raise RuntimeError(f"teacher-forced tokens {r.tokens[i]} are not the caption {words}")
                for w, (word, obj) in enumerate(zip(words, sub.word_objects[i])):
                    if word in content:
                        hit = vx.metrics.pointing_game(r.maps[i, w][None], sub.masks[i][obj][None])
                        hits[r.method].append(bool(hit[0]))
    return hits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="two-object images (4 content words each)")
    p.add_argument("--seed", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-report", action="store_true")
    a = p.parse_args()
    if a.seed < 10_000:
        p.error("evaluation seeds start at 10000 (lower seeds are training data)")
    torch.set_num_threads(a.threads)
    hits = pointing(a.n, a.seed)
    rows = []
    for name, h in hits.items():
        acc = sum(h) / len(h)
        rows.append([name, f"{acc:.3f}", f"{math.sqrt(acc * (1 - acc) / len(h)):.3f}", len(h)])
    info = vx.zoo.info("shapes-vlm")
    body = (f"shapes-vlm ({info['num_params']:,} params, {info['file_size_mb']:.2f} MB), {a.n} two-object images of "
            f"seed {a.seed}, prompt 'describe the image', reference captions teacher-forced; a word's map hits when "
            "vx.metrics.pointing_game puts its peak on the named object.\n\n"
            + table(["method", "per-word pointing", "SE", "words"], rows))
    report("VLM per-word pointing (shapes-vlm)", body, print_only=a.no_report)


if __name__ == "__main__":
    main()
