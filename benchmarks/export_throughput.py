"""Throughput of ``vitexplain export`` vs a plain batched inference loop over the same files.

Both read the same PNG files from disk with the same model, batch size and DataLoader workers:

* **plain**: decode + preprocess (``load_image`` + ``preprocess``, in DataLoader workers) +
  forward under ``torch.inference_mode()``; nothing is written.
* **export**: the whole ``vitexplain export`` call in-process (``--overwrite --quiet``): input
  discovery, model load, decode + preprocess, explain (one shared forward/backward for all
  methods), overlays, PNG (and nothing else) writes, manifest and summary. "loop" columns use the
  processing loop's own time (``summary.json`` ``process_s``), without start-up.

Runs are interleaved (``median_times``) so machine drift hits all alike. Two workloads: the
64 px shapes model (tiny: the tool's own overhead shows) and ``vit_small_patch16_224`` at 224 px
(random weights; a model of realistic cost, as in real use).

Usage::

    python benchmarks/export_throughput.py [--images 256] [--big-images 64] [--reps 3]
        [--batch-size 32] [--workers N] [--device cpu|cuda]

Issue floor: export >= 0.5x plain-inference throughput with rollout alone.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_times, report, table  # noqa: E402

FLOOR = 0.5


def _write_images(folder: Path, n: int, size: int) -> list[str]:
    import numpy as np
    from PIL import Image

    import vitexplain as vx

    folder.mkdir(parents=True, exist_ok=True)
    batch = vx.data.shapes(n, seed=123, size=size)
    paths = []
    for i in range(n):
        path = folder / f"sub{i % 4}" / f"img_{i:04d}.png"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(np.ascontiguousarray(batch.images[i])).save(path)
        paths.append(str(path))
    return sorted(paths)


def _shapes_model_spec(tmp: Path) -> str:
    """``shapes-vit`` when its weights are installed, else the same architecture (random init)
    saved as a zoo-format checkpoint, so the export CLI and the plain loop load the same thing."""
    import vitexplain as vx

    try:
        vx.zoo.load("shapes-vit")
        return "shapes-vit"
    except (FileNotFoundError, OSError):
        from vitexplain.zoo.models import DEFAULT_CONFIGS, build

        cfg = copy.deepcopy(DEFAULT_CONFIGS["shapes-vit"])
        cfg["name"] = "shapes-vit-random"
        torch.manual_seed(0)
        return str(vx.zoo.save_checkpoint(build(cfg), cfg, tmp / "ckpt"))


class _PlainDataset(torch.utils.data.Dataset):
    def __init__(self, paths: list[str], kwargs: dict[str, Any]) -> None:
        self.paths, self.kwargs = paths, kwargs

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        from vitexplain.data.images import load_image, preprocess

        return preprocess([load_image(self.paths[i])], **self.kwargs)[0][0]


def _plain(model: torch.nn.Module, paths: list[str], batch_size: int, workers: int, device: str) -> Callable[[], None]:
    from vitexplain.data.images import preprocess_kwargs

    loader = torch.utils.data.DataLoader(
        _PlainDataset(paths, preprocess_kwargs(model)), batch_size=batch_size, num_workers=workers,
        pin_memory=device.startswith("cuda"),
    )

    def run() -> None:
        with torch.inference_mode():
            for x in loader:
                model(x.to(device, non_blocking=True))

    return run


def _export(paths_dir: Path, out: Path, model: str, methods: list[str], batch_size: int, workers: int,
            device: str, extra: dict[str, Any], loop_times: list[float],
            timings: list[dict[str, float]]) -> Callable[[], None]:
    from vitexplain.export import ExportOptions, export

    def run() -> None:
        opts = ExportOptions(
            inputs=[str(paths_dir)], out=str(out), model=model, methods=methods, batch_size=batch_size,
            workers=workers, device=device, overwrite=True, quiet=True, **extra,
        )
        result = export(opts)
        assert result.exit_code == 0, result.summary.get("failures")
        loop_times.append(result.summary["timings"]["process_s"])
        timings.append(result.summary["timings"])

    return run


def _workload(name: str, paths_dir: Path, paths: list[str], model_spec: str, model: torch.nn.Module,
              extra: dict[str, Any], args: argparse.Namespace, tmp: Path,
              breakdown: list[list[object]]) -> list[list[object]]:
    n = len(paths)
    model = model.to(args.device).eval()
    loops: dict[str, list[float]] = {"rollout": [], "rollout+cdam": []}
    parts: dict[str, list[dict[str, float]]] = {"rollout": [], "rollout+cdam": []}
    fns = {
        "plain": _plain(model, paths, args.batch_size, args.workers, args.device),
        "rollout": _export(paths_dir, tmp / f"out_{name}_r", model_spec, ["rollout"], args.batch_size,
                           args.workers, args.device, extra, loops["rollout"], parts["rollout"]),
        "rollout+cdam": _export(paths_dir, tmp / f"out_{name}_rc", model_spec, ["rollout", "cdam"],
                                args.batch_size, args.workers, args.device, extra, loops["rollout+cdam"],
                                parts["rollout+cdam"]),
    }
    times = median_times(fns, reps=args.reps, warmup=1, device=args.device)
    for label, runs in parts.items():
        runs = runs[1:]  # drop the warm-up
        med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in ("process_s", "explain_s", "load_wait_s", "write_s")}
        breakdown.append([name, f"export {label}", f"{med['process_s']:.2f}", f"{med['explain_s']:.2f}",
                          f"{med['load_wait_s']:.2f}", f"{med['write_s']:.2f}",
                          f"{times['plain']:.2f}"])
    plain_ips = n / times["plain"]
    rows: list[list[object]] = [[name, "plain inference", n, f"{plain_ips:.1f}", "1.00", "-", "-"]]
    for label in ("rollout", "rollout+cdam"):
        ips = n / times[label]
        loop = sorted(loops[label][1:])[len(loops[label][1:]) // 2]  # median, warm-up dropped
        loop_ips = n / loop
        rows.append([name, f"export {label}", n, f"{ips:.1f}", f"{ips / plain_ips:.2f}",
                     f"{loop_ips:.1f}", f"{loop_ips / plain_ips:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=256, help="64 px shapes images (default 256)")
    parser.add_argument("--big-images", type=int, default=64, help="256 px images for vit_small at 224 (default 64; 0 skips)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=max(0, min(4, (os.cpu_count() or 1) - 1)))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    import timm

    import vitexplain as vx

    rows: list[list[object]] = []
    breakdown: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="vx_export_bench_") as d:
        tmp = Path(d)
        small_dir = tmp / "shapes64"
        paths = _write_images(small_dir, args.images, 64)
        spec = _shapes_model_spec(tmp)
        model = vx.zoo.load(spec) if spec == "shapes-vit" else vx.zoo.load_checkpoint(spec)
        t = time.perf_counter()
        rows += _workload("shapes-vit 64px", small_dir, paths, spec, model, {}, args, tmp, breakdown)
        print(f"small workload done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        if args.big_images > 0:
            big_dir = tmp / "shapes224"
            big_paths = _write_images(big_dir, args.big_images, 256)
            big = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=5)
            torch.save(big.state_dict(), tmp / "vit_small.pt")
            extra = {"checkpoint": str(tmp / "vit_small.pt")}
            rows += _workload("vit_small 224px", big_dir, big_paths, "vit_small_patch16_224", big, extra, args, tmp,
                              breakdown)

    ratios = [float(r[4]) for r in rows if r[1] == "export rollout"]
    verdict = "meets" if min(ratios) >= FLOOR else "MISSES"
    body = table(
        ["workload", "pipeline", "images", "images/s (end to end)", "x plain", "images/s (loop)", "x plain (loop)"],
        rows,
    )
    body += (
        f"\n\nbatch {args.batch_size}, {args.workers} DataLoader workers, device {args.device}, "
        f"{args.reps} interleaved reps (median). 'end to end' times the whole in-process export call "
        "(discovery, model load, manifest, summary); 'loop' the processing loop alone. "
        f"Export with rollout alone {verdict} the issue floor of {FLOOR}x plain inference "
        f"(lowest ratio {min(ratios):.2f}); the rollout+cdam rows add a backward pass for CDAM."
    )
    body += "\n\nWhere the export loop's time goes (median run, seconds; plain = the whole plain-inference run):\n\n"
    body += table(
        ["workload", "pipeline", "loop", "explain (main thread)", "waiting for decode", "overlay + PNG (writer threads, overlapped)", "plain"],
        breakdown,
    )
    report("Export throughput (vitexplain export vs plain inference)", body)


if __name__ == "__main__":
    main()
