"""Cost of vx.capture on a fused-attention ViT, side by side with the eager-switch approach.

Rows (median wall time, ratio to the plain fused model):
- plain fused forward;
- captured forward (records only);
- captured forward that also recomputes every layer's head-mean probabilities;
- the same model switched to eager attention with hooks on attention dropout (what
  vit-explain / Chefer's code do);
- forward+backward: plain vs ``grads=True`` capture (plus reading every layer's dy/dA).

Usage: python benchmarks/capture_overhead.py [--model vit_small_patch16_224] [--batch 8] [--reps 10]

``--single shapes-hier,pvt_v2_b0``: instead, the cost of capturing one forward (records only) of each
named model (a zoo name or a timm name, random init, batch 2 at the model's input size), as the median
of interleaved plain / captured forwards under ``torch.no_grad``; printed only, docs/ not rewritten.
"""

from __future__ import annotations

import argparse
import copy

import timm
import torch

import vitexplain as vx
from _common import median_times, report, table


def single_forward(names: list[str], reps: int, device: str) -> None:
    """Print plain vs captured time of one forward for each named model (see the module docstring)."""
    rows = []
    for name in names:
        if name in vx.zoo.names():
            model = vx.zoo.load(name).eval().to(device)
            size = vx.zoo.info(name)["pretrained_cfg"]["input_size"][1:]
        else:
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False).eval().to(device)
            size = model.pretrained_cfg["input_size"][1:]
        x = torch.randn(2, 3, *size, device=device)

        def plain() -> None:
            with torch.no_grad():
                model(x)

        def captured() -> None:
            with torch.no_grad(), vx.capture(model):
                model(x)

        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        times = median_times({"plain": plain, "captured": captured}, reps=reps, warmup=3, device=device)
        rows.append([name, f"2 x 3 x {size[0]} x {size[1]}", times["plain"] * 1e3, times["captured"] * 1e3,
                     times["captured"] / times["plain"], len(rec.records)])
    print(f"one forward, {device}, {torch.get_num_threads()} thread(s), median of {reps} interleaved runs\n")
    print(table(["model", "input", "plain ms", "captured ms", "ratio", "records"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--single", default="", help="comma separated models: time one captured forward of each")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.single:
        single_forward(args.single.split(","), args.reps, args.device)
        return

    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).eval().to(args.device)
    size = model.pretrained_cfg["input_size"][1:]
    x = torch.randn(args.batch, 3, *size, device=args.device)

    eager = copy.deepcopy(model)
    kept: list[torch.Tensor] = []
    for module in eager.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
            module.attn_drop.register_forward_hook(lambda m, i, o: kept.append(o))

    def plain() -> None:
        with torch.no_grad():
            model(x)

    def captured() -> None:
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        assert len(rec) > 0

    def captured_probs() -> None:
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
            [r.fused_probs("mean") for r in rec.records]

    def eager_hooks() -> None:
        kept.clear()
        with torch.no_grad():
            eager(x)

    def plain_fb() -> None:
        xg = x.clone().requires_grad_()
        model(xg)[:, 0].sum().backward()

    def captured_fb() -> None:
        xg = x.clone().requires_grad_()
        with vx.capture(model, grads=True) as rec:
            out = model(xg)
        out[:, 0].sum().backward()
        assert rec.records[-1]._grad_out is not None

    def captured_fb_grads() -> None:
        xg = x.clone().requires_grad_()
        with vx.capture(model, grads=True) as rec:
            out = model(xg)
        out[:, 0].sum().backward()
        [(r.fused_probs("mean"), r.grad_probs().mean(1)) for r in rec.records]

    def eager_fb() -> None:
        kept.clear()
        xg = x.clone().requires_grad_()
        out = eager(xg)
        [a.retain_grad() for a in kept]
        out[:, 0].sum().backward()

    forward = median_times(
        {"plain": plain, "captured": captured, "captured_probs": captured_probs, "eager": eager_hooks},
        reps=args.reps, device=args.device,
    )
    backward = median_times(
        {"plain": plain_fb, "captured": captured_fb, "captured_grads": captured_fb_grads, "eager": eager_fb},
        reps=args.reps, device=args.device,
    )
    for model_ in (model, eager):
        for p in model_.parameters():
            p.grad = None
    f0, b0 = forward["plain"], backward["plain"]
    rows = [
        ["forward: plain fused model", forward["plain"] * 1e3, 1.0],
        ["forward: vx.capture, records only", forward["captured"] * 1e3, forward["captured"] / f0],
        ["forward: vx.capture + every layer's head-mean probs", forward["captured_probs"] * 1e3, forward["captured_probs"] / f0],
        ["forward: model switched to eager + hooks", forward["eager"] * 1e3, forward["eager"] / f0],
        ["fwd+bwd: plain fused model", backward["plain"] * 1e3, 1.0],
        ["fwd+bwd: vx.capture(grads=True)", backward["captured"] * 1e3, backward["captured"] / b0],
        ["fwd+bwd: vx.capture(grads=True) + every layer's A and dy/dA", backward["captured_grads"] * 1e3, backward["captured_grads"] / b0],
        ["fwd+bwd: eager + hooks + retain_grad", backward["eager"] * 1e3, backward["eager"] / b0],
    ]
    body = (
        f"{args.model}, batch {args.batch}, {args.device}, median of {args.reps} interleaved runs\n\n"
        + table(["what", "ms", "x plain"], rows)
    )
    report(f"Capture overhead ({args.device})", body)


if __name__ == "__main__":
    main()
