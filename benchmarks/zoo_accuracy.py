"""Accuracy of the bundled zoo models on 1,000 fresh shapes images (seeds >= 10_000).

Usage::

    python benchmarks/zoo_accuracy.py [--n 1000] [--seed 10000] [--device cpu]

Prints a table: per-label accuracy and exact label-set accuracy (classifiers; a label is
predicted when its logit > 0), exact caption accuracy (captioner, greedy decoding), file size,
parameter count, the CPU time the training took, and the evaluation wall time. Training never
sees seeds >= 9_000, so these images are fresh.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import vitexplain as vx
from vitexplain.zoo.evaluate import EVAL_SEED, evaluate

try:  # shared report helper of the benchmarks folder (writes docs/benchmarks.md)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import report, table  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - fall back to printing
    report = None

    def table(header: list[str], rows: list[list[object]]) -> str:
        def fmt(v: object) -> str:
            return f"{v:.3f}" if isinstance(v, float) else str(v)

        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows])


def _train_cpu_s(training: dict) -> float:
    """CPU seconds of all training stages (a resumed stage records the total of the chain)."""
    return float(training.get("cpu_time_s_total", training.get("cpu_time_s", float("nan"))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=EVAL_SEED)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.seed < EVAL_SEED:
        p.error(f"evaluation seeds start at {EVAL_SEED} (lower seeds are training/validation)")

    header = ["model", "per-label acc", "exact-set acc", "caption acc", "size MB", "params",
              "train CPU min (all stages)", "eval s"]
    rows = []
    for name in vx.zoo.names():
        model = vx.zoo.load(name, device=a.device)
        info = vx.zoo.info(name)
        t0 = time.perf_counter()
        m = evaluate(model, n=a.n, seed=a.seed, device=a.device)
        dt = time.perf_counter() - t0
        cpu_min = _train_cpu_s(info.get("training", {})) / 60
        rows.append([
            name,
            m.get("label_acc", "-"),
            m.get("exact_acc", "-"),
            m.get("caption_acc", "-"),
            f"{info['file_size_mb']:.2f}",
            f"{sum(p.numel() for p in model.parameters()):,}",
            f"{cpu_min:.1f}",
            f"{dt:.1f}",
        ])
    body = (f"{a.n} fresh images, seed {a.seed}, {torch.get_num_threads()} threads.\n\n"
            + table(header, rows)
            + "\n\nTraining CPU time on this 2-core machine, 1 thread per run; shapes-vit's stages also "
            "run shapes-cnn as a frozen teacher, and the captioner's figure excludes the shapes-vit "
            "training its encoder starts from.")
    if report is not None:
        report("Zoo accuracy", body)
    else:
        print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
