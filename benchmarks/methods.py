"""Cost of vitexplain's ViT methods, side by side with the eager approach of peer tools.

Prints, in one run (median wall times, interleaved):
1. rollout and Chefer's ``generic`` at batch B: vitexplain (fused SDPA kept, row-vector
   propagation) vs an eager reference that does what vit-explain / Chefer's code do (model
   switched to eager attention, hooks on attention dropout, one image at a time, N x N
   products);
2. each method's time as a ratio to one plain forward (rollout, raw) or one plain
   forward+backward (generic, cdam, ...);
3. peak extra memory (RSS, measured in fresh subprocesses) of class-row rollout at
   1024 x 1024 input (4,096 tokens) over a plain forward, against the bytes needed to store
   every layer's probabilities.

Usage: python benchmarks/methods.py [--model vit_small_patch16_224] [--batch 16] [--reps 3] [--skip-memory]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

import timm
import torch

import vitexplain as vx
from _common import median_times, report, table


def eager_reference(model: torch.nn.Module):
    """An eager copy with hooks on attention dropout, as vit-explain and Chefer's code do."""
    eager = copy.deepcopy(model)
    kept: list[torch.Tensor] = []
    for module in eager.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
            module.attn_drop.register_forward_hook(lambda m, i, o: kept.append(o))
    return eager, kept


def eager_rollout(eager, kept, x: torch.Tensor) -> torch.Tensor:
    maps = []
    for i in range(x.shape[0]):  # one image at a time
        kept.clear()
        with torch.no_grad():
            eager(x[i : i + 1])
        n = kept[0].shape[-1]
        eye = torch.eye(n)
        result = eye.clone()
        for attn in kept:
            a = 0.5 * attn[0].mean(0) + 0.5 * eye
            a = a / a.sum(-1, keepdim=True)
            result = a @ result
        maps.append(result[0, 1:])
    return torch.stack(maps)


def eager_generic(eager, kept, x: torch.Tensor) -> torch.Tensor:
    maps = []
    for i in range(x.shape[0]):
        kept.clear()
        out = eager(x[i : i + 1])
        for a in kept:
            a.retain_grad()
        out[0, out[0].argmax()].backward()
        n = kept[0].shape[-1]
        r = torch.eye(n)
        for attn in kept:
            abar = (attn.grad[0] * attn[0]).clamp(min=0).mean(0)
            r = r + abar @ r
        maps.append(r[0, 1:])
        eager.zero_grad(set_to_none=True)
    return torch.stack(maps)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory-size", type=int, default=1024)
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).eval()
    size = model.pretrained_cfg["input_size"][1:]
    x = torch.randn(args.batch, 3, *size)
    ex = vx.Explainer(model)
    eager, kept = eager_reference(model)

    def plain_forward():
        with torch.no_grad():
            model(x)

    def plain_backward():
        xg = x.clone().requires_grad_()
        out = model(xg)
        torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), xg)

    fns = {
        "plain forward": plain_forward,
        "plain forward+backward": plain_backward,
        "eager rollout (1 image at a time)": lambda: eager_rollout(eager, kept, x),
        "eager generic (1 image at a time)": lambda: eager_generic(eager, kept, x),
    }
    methods = ["raw", "rollout", "attn_gradcam", "gradcam", "cdam", "generic", "grad_rollout"]
    for name in methods:
        fns[name] = lambda name=name: ex.explain(x, method=name)
    fns["rollout+cdam+generic (one call)"] = lambda: ex.explain(x, method=["rollout", "cdam", "generic"])
    times = median_times(fns, reps=args.reps, warmup=1)

    f, fb = times["plain forward"], times["plain forward+backward"]
    speed = [
        ["rollout", times["eager rollout (1 image at a time)"], times["rollout"], times["eager rollout (1 image at a time)"] / times["rollout"]],
        ["generic", times["eager generic (1 image at a time)"], times["generic"], times["eager generic (1 image at a time)"] / times["generic"]],
    ]
    cost = [["plain forward", f, 1.0, ""], ["plain forward+backward", fb, "", 1.0]]
    for name in methods + ["rollout+cdam+generic (one call)"]:
        grads = name not in ("raw", "rollout")
        cost.append([name, times[name], "" if grads else times[name] / f, times[name] / fb if grads else ""])
    body = (
        f"{args.model}, batch {args.batch}, CPU, median of {args.reps} interleaved runs.\n\n"
        "vitexplain vs the eager approach of vit-explain / Chefer's code (eager attention, hooks, one image at a time):\n\n"
        + table(["method", "eager reference s", "vitexplain s", "speed-up"], speed)
        + "\n\nCost of each method relative to the plain model:\n\n"
        + table(["what", "s", "x plain forward", "x plain fwd+bwd"], cost)
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
                    ["rollout (vx.Explainer, forward + recompute): peak RSS growth", peak["rollout"]],
                    ["rollout extra over plain forward", extra],
                    ["rollout extra / stored probabilities", f"{100 * extra / stored:.1f} %"],
                ],
            )
        )
    report("ViT methods (cpu)", body)


if __name__ == "__main__":
    main()
