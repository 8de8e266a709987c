"""GPU readiness: fused SDPA kernels under capture, bf16/fp16 maps vs fp32, cost and memory.

On a CUDA machine this checks, in one run:
1. that a captured ViT still runs the CUDA flash / memory-efficient SDPA kernels (the math
   fallback is disabled while the captured forward and backward run, so a fallback would fail),
   and which kernels the profiler saw;
2. that maps computed under bf16 and fp16 autocast match fp32 maps (Spearman rank correlation
   per image, threshold 0.99) for rollout, generic and cdam;
3. capture overhead, method cost and peak GPU memory at 1,024 and 4,096 tokens.

Usage: python benchmarks/gpu_check.py [--model vit_small_patch16_224] [--batch 16]
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import timm
import torch

import vitexplain as vx
from _common import median_times, report, table


def sdpa_backends(allowed: list[str]):
    """Context allowing only the named SDPA backends (flash, efficient, cudnn)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([names[n] for n in allowed])


def kernels_seen(fn) -> list[str]:
    """Names of attention kernels the profiler saw while ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = {e.key for e in prof.key_averages()}
    return sorted(k for k in keys if any(s in k.lower() for s in ("flash", "efficient_attention", "mem_eff", "cudnn_attention", "_scaled_dot_product")))


def check_kernels(model, x) -> list[list[object]]:
    rows = []
    ex = vx.Explainer(model)
    for label, fn in [
        ("captured forward", lambda: _captured_forward(model, x)),
        ("rollout (forward)", lambda: ex.explain(x, method="rollout")),
        ("generic (forward + backward)", lambda: ex.explain(x, method="generic")),
    ]:
        with sdpa_backends(["flash", "efficient", "cudnn"]):
            try:
                fn()
                ok = "yes (math fallback disabled)"
            except RuntimeError as err:
                ok = f"NO: {str(err).splitlines()[0][:80]}"
            seen = kernels_seen(fn)
        rows.append([label, ok, ", ".join(seen) or "-"])
    return rows


def _captured_forward(model, x):
    with torch.no_grad(), vx.capture(model) as rec:
        model(x)
    return rec


def check_precision(model, x) -> list[list[object]]:
    rows = []
    ex = vx.Explainer(model)
    methods = ["rollout", "generic", "cdam"]
    reference = {e.method: e.maps for e in ex.explain(x, method=methods)}
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dtype):
            low = {e.method: e.maps for e in ex.explain(x, method=methods)}
        for m in methods:
            corr = vx.metrics.rank_correlation(low[m].float(), reference[m])
            rows.append([str(dtype).replace("torch.", ""), m, corr.min().item(), corr.mean().item()])
    return rows


def cost_and_memory(model_name: str, batch: int, tokens_side: int) -> list[list[object]]:
    model = timm.create_model(model_name, pretrained=False, dynamic_img_size=True).eval().cuda()
    patch = model.patch_embed.patch_size[0]
    size = tokens_side * patch
    x = torch.randn(batch, 3, size, size, device="cuda")
    ex = vx.Explainer(model)

    def plain():
        with torch.no_grad():
            model(x)

    def plain_fb():
        xg = x.clone().requires_grad_()
        out = model(xg)
        torch.autograd.grad(out[:, 0].sum(), xg)

    fns = {
        "plain forward": plain,
        "captured forward": lambda: _captured_forward(model, x),
        "rollout": lambda: ex.explain(x, method="rollout"),
        "plain forward+backward": plain_fb,
        "cdam": lambda: ex.explain(x, method="cdam"),
        "generic": lambda: ex.explain(x, method="generic"),
    }
    times = median_times(fns, reps=5, warmup=2, device="cuda")
    rows = []
    for name, fn in fns.items():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ref = times["plain forward+backward"] if name in ("cdam", "generic", "plain forward+backward") else times["plain forward"]
        rows.append([f"{tokens_side ** 2} tokens, batch {batch}", name, times[name] * 1e3, times[name] / ref, peak])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine).")
        return 0
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = timm.create_model(args.model, pretrained=False).eval().cuda()
    x = torch.randn(args.batch, 3, 224, 224, device="cuda")
    body = f"{torch.cuda.get_device_name(0)}, {args.model}\n\n"
    body += "Fused SDPA kernels with capture on:\n\n" + table(["what", "runs without math fallback", "attention kernels seen"], check_kernels(model, x))
    body += "\n\nbf16 / fp16 autocast maps vs fp32 maps (Spearman per image):\n\n" + table(["dtype", "method", "min", "mean"], check_precision(model, x))
    rows = cost_and_memory(args.model, 8, 32) + cost_and_memory(args.model, 1, 64)
    body += "\n\nCost and peak memory (1,024 and 4,096 tokens):\n\n" + table(["input", "what", "ms", "x plain", "peak extra MB"], rows)
    report("GPU check", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
