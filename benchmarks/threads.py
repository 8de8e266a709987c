"""How many torch threads should a small-model job use on a shared machine?

Times representative small-model workloads at 1 and 2 (up to the CPU count) torch intra-op
threads, alone and with a competing CPU job, interleaved rep by rep so that drift (other
users of a shared machine) hits every cell alike:

* ``explain``: ``shapes-vit`` (the zoo ViT, 64 px), ``Explainer.explain`` of a batch of 16
  with ``cdam`` and ``generic`` (forward + backward; what ``examples/compare_methods.py`` and
  ``vitexplain export`` do per batch);
* ``train``: 20 AdamW steps of the tiny ``nn.Transformer`` of ``examples/alignment.py`` on
  batches of 128 (many small kernels: the case where threads contend worst);
* ``forward``: a plain ``vit_small_patch16_224`` forward of 8 images at 224 px (a larger
  model, for comparison).

Competitors (each a separate process started before and stopped after its cell):

* ``busy``: one process spinning in a pure Python loop (takes one core, no torch);
* ``torch``: another torch job at the default thread count running matmuls (another example
  or test run on the same machine).

The table prints each cell's median seconds and, side by side, its ratio to 1 thread in the
same condition (below 1.00: more threads help) and to the same thread count alone (how much
the competitor slows it down). The load average before and after is printed; the machine is
shared, so "alone" means "no competitor of ours". Rewrites its section of docs/benchmarks.md.

Usage::

    python benchmarks/threads.py [--reps 5] [--workloads explain,train,forward]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import report, table  # noqa: E402

COMPETITORS = {
    "busy": "import time\nwhile True:\n    pass\n",
    "torch": ("import torch\na = torch.randn(512, 512)\nprint('ready', flush=True)\n"
              "while True:\n    a = (a @ a).tanh_()\n"),
}


def _explain() -> Callable[[], None]:
    import vitexplain as vx

    model = vx.zoo.load("shapes-vit")
    ex = vx.Explainer(model)
    x = vx.data.shapes(16, seed=0).tensor
    return lambda: ex.explain(x, method=["cdam", "generic"])


def _train() -> Callable[[], None]:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "alignment.py"
    spec = importlib.util.spec_from_file_location("alignment_example", path)
    alignment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alignment)  # type: ignore[union-attr]
    torch.manual_seed(0)
    model = alignment.Reverser()
    return lambda: alignment.train(model, 20)


def _forward() -> Callable[[], None]:
    import timm

    model = timm.create_model("vit_small_patch16_224", pretrained=False).eval()
    x = torch.randn(8, 3, 224, 224)

    def run() -> None:
        with torch.inference_mode():
            model(x)

    return run


WORKLOADS = {"explain": _explain, "train": _train, "forward": _forward}


def _start(kind: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", COMPETITORS[kind]], stdout=subprocess.PIPE, text=True)
    if kind == "torch":
        proc.stdout.readline()  # type: ignore[union-attr]  # imported and running
    time.sleep(0.3)  # let the scheduler see it
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workloads", default="explain,train,forward")
    parser.add_argument("--competitors", default="busy,torch")
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    counts = sorted({1, 2, cpus} & set(range(1, cpus + 1))) or [1]
    conditions = ["alone", *[c for c in args.competitors.split(",") if c]]
    workloads = {name: WORKLOADS[name]() for name in args.workloads.split(",")}
    load_before = os.getloadavg()
    for fn in workloads.values():  # warm-up
        for n in counts:
            torch.set_num_threads(n)
            fn()
    times: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(args.reps):
        for cond in conditions:
            proc = _start(cond) if cond != "alone" else None
            try:
                for name, fn in workloads.items():
                    for n in (counts if rep % 2 == 0 else counts[::-1]):
                        torch.set_num_threads(n)
                        t = time.perf_counter()
                        fn()
                        times.setdefault((name, cond, n), []).append(time.perf_counter() - t)
            finally:
                if proc is not None:
                    _stop(proc)
        print(f"rep {rep + 1}/{args.reps} done (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    rows: list[list[object]] = []
    for name in workloads:
        for cond in conditions:
            for n in counts:
                s = med[(name, cond, n)]
                rows.append([name, cond, n, f"{s:.3f}", f"{s / med[(name, cond, 1)]:.2f}",
                             f"{s / med[(name, 'alone', n)]:.2f}"])
    body = table(["workload", "competitor", "torch threads", "s (median)", "x 1 thread (same competitor)",
                  "x alone (same threads)"], rows)
    body += (f"\n\n{cpus} CPUs, {args.reps} interleaved reps (median). Load average (1 min) {load_before[0]:.2f} "
             f"before, {load_after[0]:.2f} after: the machine is shared, 'alone' = no competitor of ours. "
             "busy = one pure-Python spinning process; torch = another torch job at its default thread count.")
    report("Torch threads on a shared CPU", body)


if __name__ == "__main__":
    main()
