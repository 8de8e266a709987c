"""Cost of vitexplain's ViT methods, side by side with the lean eager approach they replace.

Prints, in one run (median wall times, interleaved):
1. ``raw``, ``rollout`` and Chefer's ``generic`` through ``vx.Explainer`` vs a lean eager
   reference: the model copied with timm's ``fused_attn=False``, a forward hook on
   ``attn_drop`` keeping the attention matrices, and the method on the returned matrices
   (the class row pushed through the layers as a vector, no N x N products), run one image
   at a time (what vit-explain / Chefer's code do) and batched; the speed-ups must be >= 1;
2. each method's time as a ratio to one plain fused forward (``raw`` <= 1.02x, ``rollout``
   <= 1.05x) or one plain forward+backward (``generic`` <= 1.10x, ``attnlrp`` and ``cp_lrp``
   <= 1.5x, and the other gradient methods), with timm's own eager forward and vitexplain's capture modes for context;
3. checks: the model's outputs under each capture mode equal the plain fused forward's
   within 1e-5, and the maps equal the eager reference's within 1e-5 (relative to the
   largest map value);
4. peak extra memory (RSS, measured in fresh subprocesses) of class-row rollout at
   1024 x 1024 input (4,096 tokens) over a plain forward, against the bytes needed to store
   every layer's probabilities (the automatic attention mode must keep the fused kernel).

Usage: python benchmarks/methods.py [--model vit_small_patch16_224] [--batch 16] [--reps 5] [--skip-memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from typing import Callable

import timm
import torch

import vitexplain as vx
from _common import median_times, report, table

FLOORS = {"raw": ("x plain forward", 1.02), "rollout": ("x plain forward", 1.05), "generic": ("x plain fwd+bwd", 1.10),
          "attnlrp": ("x plain fwd+bwd", 1.5), "cp_lrp": ("x plain fwd+bwd", 1.5)}


class EagerReference:
    """timm's eager attention with hooks, the lean way: what vitexplain must not be slower than.

    A deep copy of the model with ``fused_attn=False`` and a forward hook on every
    ``attn_drop`` (its output is the attention matrix A, (B, H, N, N)); methods push the
    class row through the kept matrices as a vector.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = copy.deepcopy(model)
        self.kept: list[torch.Tensor] = []
        for module in self.model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = False
                module.attn_drop.register_forward_hook(lambda m, i, o: self.kept.append(o))

    def _each(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, per_image: bool) -> torch.Tensor:
        try:
            if not per_image:
                return fn(x)
            return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
        finally:  # the matrices (and, for generic, the autograd graph) are not kept past the call
            self.kept.clear()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept.clear()
        return self.model(x)

    def raw(self, x: torch.Tensor, per_image: bool) -> torch.Tensor:
        def one(xb: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self._forward(xb)
            return self.kept[-1][:, :, 0, 1:].mean(1)

        return self._each(one, x, per_image)

    def rollout(self, x: torch.Tensor, per_image: bool) -> torch.Tensor:
        def one(xb: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self._forward(xb)
                r = torch.zeros(xb.shape[0], self.kept[0].shape[-1])
                r[:, 0] = 1.0
                for attn in reversed(self.kept):  # r <- r @ rownorm(0.5 mean_h(A) + 0.5 I)
                    a = 0.5 * attn.mean(1) + 0.5 * torch.eye(attn.shape[-1])
                    r = torch.bmm(r.unsqueeze(1), a / a.sum(-1, keepdim=True)).squeeze(1)
            return r[:, 1:]

        return self._each(one, x, per_image)

    def generic(self, x: torch.Tensor, per_image: bool) -> torch.Tensor:
        def one(xb: torch.Tensor) -> torch.Tensor:
            xb = xb.clone().requires_grad_(True)
            out = self._forward(xb)
            score = out.gather(1, out.argmax(1, keepdim=True)).sum()
            grads = torch.autograd.grad(score, self.kept)
            with torch.no_grad():
                r = torch.zeros(xb.shape[0], self.kept[0].shape[-1])
                r[:, 0] = 1.0
                dev = torch.zeros_like(r)
                for attn, grad in zip(reversed(self.kept), reversed(grads)):  # R += Abar @ R, as a row
                    abar = (grad * attn).clamp(min=0).mean(1)
                    dev = dev + torch.bmm((r + dev).unsqueeze(1), abar).squeeze(1)
            return dev[:, 1:]

        return self._each(one, x, per_image)


PEAK_CODE = """
import json, os, threading, time, torch, timm, vitexplain as vx
torch.manual_seed(0)
m = timm.create_model({model!r}, pretrained=False, img_size={size}).eval()
x = torch.randn(1, 3, {size}, {size})
ex = vx.Explainer(m)
with torch.no_grad():
    m(x)  # warm-up: allocator caches, thread pools
page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

def measure(fn):
    peak, done = [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0002)
    before = rss()
    thread = threading.Thread(target=sample)
    thread.start()
    fn()
    done.set()
    thread.join()
    return (max(peak[0], rss()) - before) / 2**20

def plain():
    with torch.no_grad():
        m(x)

print(json.dumps({{"plain": measure(plain), "{mode}": measure(lambda: ex.explain(x, method="{mode}"))}}))
"""


def peak_extra_mb(mode: str, model_name: str, size: int) -> dict[str, float]:
    """Peak RSS growth (MB) during a plain forward and during ``mode``, in a fresh process.

    A sampling thread reads /proc/self/statm every 0.2 ms while the operation runs.
    """
    code = PEAK_CODE.format(model=model_name, size=size, mode=mode)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def checks(model: torch.nn.Module, x: torch.Tensor, ex: vx.Explainer, ref: EagerReference) -> list[list[object]]:
    """Largest output and map differences (the floors: 1e-5)."""
    rows: list[list[object]] = []
    with torch.no_grad():
        plain = model(x)
        for mode, heads in (("fused", "all"), ("materialize", "all"), ("materialize", "mean")):
            with vx.capture(model, attention_mode=mode, heads=heads):
                out = model(x)
            diff = float((out - plain).abs().max())
            rows.append([f"model outputs, vx.capture(attention_mode={mode!r}, heads={heads!r}) vs plain fused", f"{diff:.1e}"])
    for name in ("raw", "rollout", "generic"):
        want = getattr(ref, name)(x, per_image=False)
        got = ex.explain(x, method=name).maps.flatten(1)
        diff = float((got - want).abs().max() / want.abs().max())
        rows.append([f"{name} maps vs eager reference (max abs / max abs map)", f"{diff:.1e}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--memory-size", type=int, default=1024)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).eval()
    size = model.pretrained_cfg["input_size"][1:]
    x = torch.randn(args.batch, 3, *size)
    ex = vx.Explainer(model)
    ref = EagerReference(model)

    def plain_forward() -> None:
        with torch.no_grad():
            model(x)

    def plain_backward() -> None:
        xg = x.clone().requires_grad_()
        out = model(xg)
        torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), xg)

    def eager_forward() -> None:
        with torch.no_grad():
            ref._forward(x)

    def captured(mode: str, heads: str = "all") -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), vx.capture(model, attention_mode=mode, heads=heads):
                model(x)

        return run

    fns: dict[str, Callable[[], object]] = {
        "plain forward": plain_forward,
        "plain forward+backward": plain_backward,
        "timm eager forward (fused_attn=False)": eager_forward,
        "vx.capture forward, fused (records only)": captured("fused"),
        "vx.capture forward, materialize": captured("materialize"),
        "vx.capture forward, materialize, head mean kept": captured("materialize", "mean"),
    }
    compared = ["raw", "rollout", "generic"]
    for name in compared:
        fns[f"eager {name}, 1 image at a time"] = lambda name=name: getattr(ref, name)(x, per_image=True)
        fns[f"eager {name}, batched"] = lambda name=name: getattr(ref, name)(x, per_image=False)
    methods = ["raw", "rollout", "attn_gradcam", "gradcam", "cdam", "generic", "grad_rollout", "legrad", "attnlrp", "cp_lrp"]
    for name in methods:
        fns[name] = lambda name=name: ex.explain(x, method=name)
    fns["rollout+cdam+generic (one call)"] = lambda: ex.explain(x, method=["rollout", "cdam", "generic"])
    fused = vx.Explainer(model, attention_mode="fused")  # the fused kernel + recompute, for comparison
    for name in ("rollout", "generic"):
        fns[f"{name}, attention_mode='fused'"] = lambda name=name: fused.explain(x, method=name)
    times = median_times(fns, reps=args.reps, warmup=1)

    f, fb = times["plain forward"], times["plain forward+backward"]
    speed = []
    for name in compared:
        one, batched = times[f"eager {name}, 1 image at a time"], times[f"eager {name}, batched"]
        speed.append([name, one, batched, times[name], one / times[name], batched / times[name]])
    cost = [["plain forward", f, 1.0, "", ""], ["plain forward+backward", fb, "", 1.0, ""]]
    for name in list(fns)[2:6]:
        cost.append([name, times[name], times[name] / f, "", ""])
    extra = ["rollout+cdam+generic (one call)", "rollout, attention_mode='fused'", "generic, attention_mode='fused'"]
    for name in methods + extra:
        grads = name.split(",")[0] not in ("raw", "rollout")
        floor = FLOORS.get(name)
        ratio = times[name] / (fb if grads else f)
        verdict = f"<= {floor[1]:.2f}: {'met' if ratio <= floor[1] else 'NOT met'}" if floor else ""
        cost.append([name, times[name], "" if grads else ratio, ratio if grads else "", verdict])
    body = (
        f"{args.model}, batch {args.batch}, CPU, {torch.get_num_threads()} threads, median of {args.reps} interleaved runs.\n\n"
        "vitexplain vs the lean eager reference (timm fused_attn=False, hooks on attn_drop, class row pushed "
        "through the kept matrices), one image at a time and batched (floor: both speed-ups >= 1.0):\n\n"
        + table(["method", "eager, 1 image at a time s", "eager, batched s", "vitexplain s", "speed-up vs 1 image", "speed-up vs batched"], speed)
        + "\n\nCost of each method relative to the plain fused model:\n\n"
        + table(["what", "s", "x plain forward", "x plain fwd+bwd", "floor"], cost)
        + "\n\nChecks (floor: 1e-5):\n\n"
        + table(["what", "max difference"], checks(model, x, ex, ref))
    )
    if not args.skip_memory:
        s = args.memory_size
        m = timm.create_model(args.model, pretrained=False, img_size=s)
        n = (s // m.patch_embed.patch_size[0]) ** 2 + m.num_prefix_tokens
        heads, depth = m.blocks[0].attn.num_heads, len(m.blocks)
        stored = depth * heads * n * n * 4 / 2**20
        peak = peak_extra_mb("rollout", args.model, s)
        extra = max(0.0, peak["rollout"] - peak["plain"])
        body += (
            f"\n\nPeak extra memory of class-row rollout at {s}x{s} ({n} tokens, batch 1), RSS sampled in a fresh process:\n\n"
            + table(
                ["what", "MB"],
                [
                    ["all layers' probabilities stored (L x H x N^2 x 4 B)", stored],
                    ["plain forward: peak RSS growth", peak["plain"]],
                    ["rollout (vx.Explainer, attention_mode='auto'): peak RSS growth", peak["rollout"]],
                    ["rollout extra over plain forward", extra],
                    ["rollout extra / stored probabilities", f"{100 * extra / stored:.1f} %"],
                ],
            )
        )
    report("ViT methods (cpu)", body)


if __name__ == "__main__":
    main()
