"""Cost of attention methods on hierarchical vision transformers, side by side with the plain forward.

Rows: the bundled ``shapes-hier``, timm ``pvt_v2_b0``, ``swin_tiny_patch4_window7_224``,
``hiera_tiny_224`` (SAM 2's backbone family), ``mvitv2_tiny`` and SAM's image encoder
``samvit_base_patch16`` (at ``--sam-size`` px, random weights, a 5-class head on
its pooled neck so that ``generic`` has a class to explain), each where vitexplain supports it.
``shapes-hier`` (a 2 ms forward at batch 2, where an explanation's fixed Python costs, about 1 ms for
the scope, the plan and the Explanation, weigh most) also runs at ``vitexplain export``'s default
batch (32). Per model (median CPU time of the process over interleaved rounds, one torch thread unless
``--threads``):

* ``forward``: the plain model, fused attention, no grad;
* ``capture``: the same forward inside ``vx.capture(model)`` recording attention and nothing
  else (fused kernel, no method): what the capture alone costs;
* ``capture keeping attention``: the same with ``attention_mode="auto"``, as rollout's capture runs:
  each call's attention computed once by the capture and its probabilities kept (the records are
  cleared after each run, as an explanation does): rollout's cost beyond it is the method's
  (propagation through the footprints, reading the kept probabilities) and the explanation's
  fixed work (plan, checks, the Explanation);
* ``rollout``: ``vx.Explainer(model).explain(x, method="rollout")`` (plan, capture with
  attention computed once, propagation through the footprints, the Explanation), and its
  ratio to the forward (target: at most 1.15x);
* ``exact probabilities alone``: the forward plus, summed over its SDPA calls, what computing each call's
  probabilities exactly (vitexplain.recording.materialize, as rollout's capture does) costs beyond the fused
  kernel, each call timed alone on the model's own q, k, v: the least an exact rollout that keeps the
  probabilities adds to the forward before any capture machinery, reading or propagation (the fused kernel's
  softmax uses a faster approximate exp on CPU and never writes the probabilities);
* ``first rollout``: the same on a copy of the model whose learned entry
  (vitexplain/recording/discovery.py) is forgotten before each run, so that its capture discovers
  the model as the first explanation of a model does (``rollout`` is every later one);
* ``forward+backward``: the plain model's forward and the gradient of the target logits to
  the input (``torch.autograd.grad``, no parameter gradients: what benchmarks/methods.py
  compares ViT methods with; an explanation's backward takes no parameter gradients either);
* ``generic``: ``explain(x, method="generic")`` and its ratio to forward+backward.

Timing: each round runs every function once, in a new (seeded) random order, so that none always
follows the same other one (what a run frees, the C allocator keeps or gives back to the system, and
the next run pays for the fresh pages it touches); the two runs with a backward pass
(forward+backward, generic) have rounds of their own, whose freed graphs would otherwise be paid for
by the no-gradient runs after them. Rounds repeat while they fit in ``--seconds`` of CPU time per
model and group, at least ``--reps`` of them. Times are the process's CPU time
(``time.process_time``: with one torch thread, the work done, which other processes and a virtual
machine's stolen time do not inflate). Beside the medians, the ratios of the fastest run of each.

Memory (CPU allocator events of ``torch.profiler``, ``profile_memory=True``): the peak bytes
allocated during the plain forward and during rollout, and next to them the bytes of the dense
per-layer ``N_q x N_k`` attention of every layer of the batch, ``4 B sum_l heads_l N_q,l N_k,l``
(what a method that kept every layer's attention would hold at once) and the dense
``N_0 x N_0`` on the finest grid of every layer, ``4 B L N_0^2``. On CPU, rollout's capture
computes each call's attention once and keeps its probabilities (``attention_mode="auto"``, within
the budget of ``vitexplain.recording.materialize``), so its extra peak is about the attention of
all layers as computed (windows, pooled keys), not a recomputation; SAM's relative-position bias is
then not kept. This stays far below the dense ``N_0 x N_0`` of all layers. The buffers the model's
workspace (vitexplain/recording/workspace.py) keeps between captures are forgotten before the rollout
peak is taken, so the peak counts them.

Usage::

    python benchmarks/hier.py [--batch 2] [--reps 7] [--threads 1] [--sam-size 256] [--no-report]

Writes its table to docs/benchmarks.md (section "Hierarchical ViTs: rollout and generic vs forward
(cpu)") unless ``--no-report``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import statistics
import time
from typing import Callable, Optional

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

import vitexplain as vx
from vitexplain.batch.options import BatchOptions
from vitexplain.recording import discovery, workspace
from vitexplain.recording.materialize import attention_with_probs, can_materialize
from _common import interleaved_times, median_times, report, table

#: ``vitexplain export``'s default batch (its ``--batch-size``)
_CLI_BATCH = next(f.default for f in dataclasses.fields(BatchOptions) if f.name == "batch_size")

SECTION = "Hierarchical ViTs: rollout and generic vs forward (cpu)"


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors allocated (and not yet freed) while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += int(e.nbytes())
        peak = max(peak, current)
    return peak


def attention_sizes(model: nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """(bytes of every layer's attention as computed (windows, pooled keys), of the dense N_0 x N_0
    of every layer on the finest token grid, number of attention calls)."""
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    records = rec.records
    own = sum(4 * r.batch_size * r.num_heads * r.num_queries * r.num_keys for r in records)
    # the finest grid: windows folded into a record's batch (Swin, SAM) or, in Hiera's mask units, into its heads
    layout = vx.token_layout(model, tuple(x.shape[-2:]))
    finest = max(max(r.batch_size * r.num_queries // x.shape[0] for r in records),
                 layout.grid[0] * layout.grid[1] + layout.num_prefix_tokens)
    fine = 4 * x.shape[0] * len(records) * finest * finest
    return own, fine, len(records)


class SdpaCalls(TorchFunctionMode):
    """Notes the arguments of every ``F.scaled_dot_product_attention`` call made under it (this script's own
    spy: no vitexplain machinery)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((args, kwargs))
        return func(*args, **kwargs)


def exact_probabilities_cost(model: nn.Module, x: torch.Tensor, rounds: int = 7) -> float:
    """Seconds (CPU time) that computing each SDPA call's probabilities exactly costs beyond the fused kernel, on
    the model's own q, k, v, each call timed alone (the fastest of ``rounds`` interleaved rounds of each), summed
    over the calls: scores, softmax (torch's exp, to float32 rounding) and ``P V`` by
    vitexplain.recording.materialize, which rollout's capture runs, against the fused kernel (whose softmax
    uses a faster, approximate exp on CPU and never writes P). Nothing of the capture (mode, records, plan,
    propagation) is in it: it is the least an exact rollout that keeps the probabilities adds to a forward.
    Calls it cannot compute eagerly (e.g. with dropout) count 0; models with eager attention (Swin) have none."""
    spy = SdpaCalls()
    with torch.no_grad(), spy:
        model(x)
    extra = 0.0
    for args, kwargs in spy.calls:
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        scale, causal = kwargs.get("scale"), bool(kwargs.get("is_causal", False))
        if not can_materialize(q, k, v, mask, float(kwargs.get("dropout_p", 0.0)), bool(kwargs.get("enable_gqa"))):
            continue
        runs = {
            "fused": lambda: F.scaled_dot_product_attention(*args, **kwargs),
            "exact": lambda: attention_with_probs(q, k, v, attn_mask=mask, scale=scale, is_causal=causal),
        }
        best = best_times(runs, rounds)
        extra += best["exact"] - best["fused"]
    return extra


def best_times(runs: dict[str, Callable[[], object]], rounds: int = 7) -> dict[str, float]:
    """The fastest CPU time (s) of each of ``runs`` (short calls: each timing repeats a call enough times to last
    about 5 ms, a single one being below the clock's grain), over ``rounds`` interleaved rounds, without grad."""
    with torch.no_grad():
        start = time.process_time()
        next(iter(runs.values()))()
        reps = max(1, math.ceil(5e-3 / max(time.process_time() - start, 1e-6)))
        best = {name: math.inf for name in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                start = time.process_time()
                for _ in range(reps):
                    fn()
                best[name] = min(best[name], (time.process_time() - start) / reps)
    return best


def models(sam_size: int, batch: int) -> list[tuple[str, Callable[[], nn.Module], tuple[int, int], int]]:
    """(label, builder, input size, batch) of every model in the table."""
    out: list[tuple[str, Callable[[], nn.Module], tuple[int, int], int]] = []
    if "shapes-hier" in vx.zoo.names():
        out.append(("shapes-hier (zoo, 64 px)", lambda: vx.zoo.load("shapes-hier"), (64, 64), batch))
        # the batch `vitexplain export` runs by default: a 64 px model's explanations come in batches
        out.append(("shapes-hier (zoo, 64 px), the CLI's batch", lambda: vx.zoo.load("shapes-hier"), (64, 64),
                    _CLI_BATCH))
    out.append(("pvt_v2_b0", lambda: timm.create_model("pvt_v2_b0", pretrained=False), (224, 224), batch))
    out.append(("swin_tiny_patch4_window7_224",
                lambda: timm.create_model("swin_tiny_patch4_window7_224", pretrained=False), (224, 224), batch))
    out.append(("hiera_tiny_224", lambda: timm.create_model("hiera_tiny_224", pretrained=False), (224, 224), batch))
    out.append(("mvitv2_tiny", lambda: timm.create_model("mvitv2_tiny", pretrained=False), (224, 224), batch))
    out.append((f"samvit_base_patch16 ({sam_size} px)",
                lambda: timm.create_model("samvit_base_patch16", pretrained=False, img_size=sam_size, num_classes=5),
                (sam_size, sam_size), batch))
    return out


def measure(label: str, build: Callable[[], nn.Module], size: tuple[int, int], batch: int,
            reps: int, seconds: float) -> Optional[list[object]]:
    """One table row, or None (printed why) when vitexplain does not support the model."""
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(batch, 3, *size)
    ex = vx.Explainer(model)
    supported = ex.methods()
    missing = [m for m in ("rollout", "generic") if m not in supported]
    if "rollout" in missing:
        print(f"{label}: rollout not supported here ({supported}); left out")
        return None
    with torch.no_grad():
        target = model(x).argmax(-1)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    def captured() -> None:
        with torch.no_grad(), vx.capture(model):
            model(x)

    def kept() -> None:  # what rollout's capture does: each call's attention computed once and kept
        with torch.no_grad(), vx.capture(model, attention_mode="auto") as rec:
            model(x)
        rec.clear()  # (as an explanation does once its maps are made: the workspace lends the buffers again)

    def forward_backward() -> None:
        xg = x.clone().requires_grad_()
        torch.autograd.grad(model(xg).gather(1, target[:, None]).sum(), xg)

    fresh = copy.deepcopy(model)  # forgotten before each run: a first explanation, which discovers the model
    ex_fresh = vx.Explainer(fresh)

    def first_rollout() -> None:
        discovery.forget(fresh)
        ex_fresh.explain(x, method="rollout")

    no_grad: dict[str, Callable[[], object]] = {
        "forward": forward,
        "capture": captured,
        "kept": kept,
        "rollout": lambda: ex.explain(x, method="rollout"),
        "first rollout": first_rollout,
    }
    # the runs with a backward pass are timed in their own rounds: the memory their graphs free (and the C
    # allocator gives back) would otherwise be paid for by whichever no-gradient run came next
    groups = [no_grad]
    if "generic" not in missing:
        groups.append({"forward+backward": forward_backward,
                       "generic": lambda: ex.explain(x, method="generic", target=target)})
    runs: dict[str, list[float]] = {}
    for fns in groups:
        # a round runs every function once: as many rounds as fit in ``seconds`` (at least ``reps``), since a
        # median of a few runs of a short forward says little on a shared machine
        one_round = sum(median_times(fns, reps=1, warmup=1, clock=time.process_time).values())
        rounds = max(reps, math.ceil(seconds / max(one_round, 1e-9)))
        runs.update(interleaved_times(fns, reps=rounds, warmup=1, clock=time.process_time, shuffle_seed=0))
    times = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: min(v) for k, v in runs.items()}  # the fastest run: what a quiet machine gives
    peak_forward = peak_bytes(forward)
    workspace.forget(model)  # (the buffers a capture reuses are allocated again inside the measured call)
    peak_rollout = peak_bytes(lambda: ex.explain(x, method="rollout"))
    own, fine, layers = attention_sizes(model, x)
    exact = exact_probabilities_cost(model, x)
    ms = {k: 1000 * v for k, v in times.items()}
    generic = (f"{ms['generic']:.1f} ms ({ms['generic'] / ms['forward+backward']:.2f}x of {ms['forward+backward']:.1f})"
               if "generic" in ms else "not supported")
    mb = 1e6
    digits = 2 if ms["forward"] < 10 else 1
    return [label, f"{batch} x {size[0]} px", layers, f"{ms['forward']:.{digits}f}",
            f"{ms['capture']:.{digits}f} ({ms['capture'] / ms['forward']:.2f}x)",
            f"{ms['kept']:.{digits}f} ({ms['kept'] / ms['forward']:.2f}x)",
            f"{ms['rollout']:.{digits}f}", f"{ms['rollout'] / ms['forward']:.2f}x",
            f"{(times['forward'] + exact) / times['forward']:.2f}x", f"{ms['first rollout'] / ms['forward']:.2f}x",
            f"{best['capture'] / best['forward']:.2f}x / {best['rollout'] / best['forward']:.2f}x", generic,
            f"{peak_forward / mb:.1f}", f"{peak_rollout / mb:.1f}", f"{(peak_rollout - peak_forward) / mb:.1f}",
            f"{own / mb:.1f}", f"{fine / mb:.1f}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=7, help="at least this many rounds per model")
    p.add_argument("--seconds", type=float, default=20.0,
                   help="more rounds while they fit in this many seconds of CPU time per model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sam-size", type=int, default=256)
    p.add_argument("--only", default=None, help="run only the models whose label contains this text")
    p.add_argument("--no-report", action="store_true", help="print only; do not rewrite docs/benchmarks.md")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    load = " / ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    rows = []
    for label, build, size, batch in models(a.sam_size, a.batch):
        if a.only and a.only not in label:
            continue
        try:
            row = measure(label, build, size, batch, a.reps, a.seconds)
        except vx.VitexplainError as err:  # say why the row is missing, keep the others
            print(f"{label}: left out: {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        if row is not None:
            rows.append(row)
            print(" | ".join(str(v) for v in row), flush=True)
    header = ["model", "input", "attention calls", "forward ms", "capture ms (/ forward)",
              "capture keeping attention ms (/ forward)", "rollout ms",
              "rollout / forward", "exact probabilities alone / forward", "first rollout / forward", "fastest runs: capture / forward, rollout / forward",
              "generic ms (/ forward+backward to the input)", "forward peak MB", "rollout peak MB", "rollout extra MB",
              "dense attention of all layers MB", "dense N0 x N0 of all layers MB"]
    body = table(header, rows) + (
        "\n\nMedian CPU time of the process over interleaved rounds (each in a new random order; the runs with a "
        "backward pass in rounds of their own). 'capture' is "
        "the forward inside vx.capture(model) recording "
        "attention and nothing else: the capture's own cost, paid by every attention method; rollout's "
        "cost beyond it is the method's (plan, attention computed once, propagation, the Explanation). "
        "Both are as every capture after the first of a model runs (narrowed from its first call by what "
        "an earlier capture learned, vitexplain/recording/discovery.py); 'first rollout' is rollout on a copy "
        "of the model whose learned entry is forgotten before each run: an explanation that discovers the model. "
        "'exact probabilities alone' is the forward plus what computing each attention call's probabilities exactly "
        "costs beyond its fused kernel, each call timed alone on the model's own q, k, v (exact_probabilities_cost): "
        "the least an exact rollout that keeps the probabilities adds, before any capture machinery, reading or "
        "propagation. "
        "forward+backward takes the gradient of the target logits to the input (no parameter gradients). "
        "'fastest runs' divides the fastest run of each (other processes on a shared machine only ever "
        "slow a run down). Peaks: bytes of CPU tensors alive at once (torch.profiler memory "
        "events). The last two columns are what a method holding every layer's attention at once would "
        "need: on each layer's own grids, and as dense N0 x N0 on the finest grid. On CPU rollout's capture "
        "computes each call's attention once and keeps the probabilities (attention_mode='auto', within "
        "the budget of vitexplain.recording.materialize; eager models such as timm's Swin keep their own), "
        "so rollout's extra peak is about the attention of all layers on their own grids (SAM's "
        "relative-position bias is not kept); it stays far below the dense N0 x N0 of all layers. "
        "Machine load (1-minute load average) at the start of the run: see the line below the table.")
    body += (f"\n\nLoad average at the start: {load}; at least {a.reps} rounds and {a.seconds:g} s of CPU time per "
             f"model, {a.threads} thread(s).")
    report(SECTION, body, print_only=a.no_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
