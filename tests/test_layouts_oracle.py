"""ViT methods and their options on token layouts tests/test_methods.py does not use, against
hand-written formulas.

tests/test_methods.py checks every method on a class-token ViT with a square grid. Here the same
formulas (Chefer et al.'s generic rule, rollout, gradient rollout, raw attention, attention Grad-CAM;
CDAM, token Grad-CAM, LeGrad) are written out again, densely and in float64, on a 3 x 5 grid (24 x 40
input) for: register tokens, global average pooling without and with registers, a class token with
average pooling, a distilled DeiT (class and distillation tokens) and EVA with rotary embeddings
(registers, average pooling; and class token). Each oracle runs an eager float64 copy of the model
(``fused_attn=False``), reads A and dy/dA from a hook on ``attn_drop``, one image at a time.

The readout row v is docs/methods.md's: one-hot at the class token when the head reads it, ``1/2`` on
the class and distillation tokens for a distilled DeiT (its output averages the two heads), else
``1/N`` on every patch; generic and grad_rollout read ``v (R - I)``, rollout and raw ``v R``.
Floor: 1e-5 relative (max abs difference over the oracle's largest value); measured at most
4.0e-6 (attn_gradcam, class token with average pooling: maps near 1e-6 in float32), below 1e-6
for the other methods. An all-zero attn_gradcam oracle (every head's weight negative: the map is
clamped) is compared as it is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx

RTOL = 1e-5
SIZE = (24, 40)
_V = dict(img_size=SIZE, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)
_EVA = dict(_V, use_rot_pos_emb=True)
MODELS = {
    "registers": (lambda: VisionTransformer(reg_tokens=3, **_V), "class"),
    "average pooling": (lambda: VisionTransformer(class_token=False, global_pool="avg", **_V), "mean"),
    "average pooling + registers": (lambda: VisionTransformer(class_token=False, reg_tokens=2, global_pool="avg", **_V),
                                    "mean"),
    "class token, average pooling": (lambda: VisionTransformer(global_pool="avg", **_V), "mean"),
    "DeiT distilled": (lambda: VisionTransformerDistilled(**_V), "prefix"),
    "EVA rope + registers (average pooling)": (lambda: Eva(num_reg_tokens=2, **_EVA), "mean"),
    "EVA rope, class token": (lambda: Eva(global_pool="token", **_EVA), "class"),
}
METHODS = ["raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "cdam", "gradcam", "legrad"]


def _rollout(mats, v, minus_identity=False, discard=0.0, keep_class=False):
    """Rollout of fused matrices: per layer the smallest ``discard`` fraction of entries zeroed
    (stable order; the class->class entry kept for a class readout), then rownorm(0.5 M + 0.5 I)."""
    eye = torch.eye(mats[0].shape[-1], dtype=torch.float64)
    r = eye.clone()
    for m in mats:
        if discard > 0:
            flat = m.flatten().clone()
            for idx in torch.argsort(flat, stable=True)[: int(flat.numel() * discard)].tolist():
                if not (keep_class and idx == 0):
                    flat[idx] = 0.0
            m = flat.view_as(m)
        a = 0.5 * m + 0.5 * eye
        r = (a / a.sum(-1, keepdim=True)) @ r
    return v @ (r - eye if minus_identity else r)


def oracles(model, image, target, prefix, readout):
    """Every method's map of one image, over the patch tokens (flat), float64."""
    m = copy.deepcopy(model).double()
    attn, blocks_out, store = [], [], {}

    def keep_attn(module, args, out):
        out.retain_grad()
        attn.append(out)

    def keep_tokens(module, args, out):
        out.retain_grad()
        store["t"] = out

    for blk in m.blocks:
        blk.attn.fused_attn = False
        blk.attn.attn_drop.register_forward_hook(keep_attn)
        blk.register_forward_hook(lambda module, args, out: blocks_out.append(out))
    m.blocks[-1].norm1.register_forward_hook(keep_tokens)
    m(image[None].double())[0, target].backward(retain_graph=True)
    A = [a[0].detach() for a in attn]  # (H, N, N)
    G = [a.grad[0] for a in attn]
    n = A[0].shape[-1]
    v = torch.zeros(n, dtype=torch.float64)
    if readout == "class":
        v[0] = 1.0
    elif readout == "prefix":  # the distilled DeiT's output: the mean of its class and distillation heads
        v[:prefix] = 1.0 / prefix
    else:
        v[prefix:] = 1.0 / (n - prefix)
    eye = torch.eye(n, dtype=torch.float64)
    r = eye.clone()
    for a, g in zip(A, G):
        r = r + (g * a).clamp(min=0).mean(0) @ r  # Chefer et al. 2021, eq. 13 with R = I
    w = (v @ G[-1])[:, prefix:].mean(-1, keepdim=True)  # (H, 1): each head's mean gradient on the readout row
    t, gt = store["t"][0, prefix:].detach(), store["t"].grad[0, prefix:]
    legrad = torch.zeros(n, dtype=torch.float64)
    for out, a in zip(blocks_out, attn):
        (g,) = torch.autograd.grad(m.forward_head(m.norm(out))[0, target], a, retain_graph=True)
        legrad += torch.relu(g[0]).mean(dim=(0, 1))
    legrad = legrad[prefix:]
    fuse = {"mean": lambda a: a.mean(0), "max": lambda a: a.amax(0), "min": lambda a: a.amin(0)}
    keep = readout == "class"
    chefer = {}
    for s in (1, 2):
        rs = eye.clone()
        for a, g in zip(A[s:], G[s:]):
            rs = rs + (g * a).clamp(min=0).mean(0) @ rs
        chefer[s] = (v @ (rs - eye))[prefix:]
    return {
        **{f"rollout {how} discard {p} start {s}":
           _rollout([fuse[how](a) for a in A[s:]], v, discard=p, keep_class=keep)[prefix:]
           for how, p, s in (("max", 0.0, 0), ("min", 0.0, 0), ("mean", 0.5, 0), ("mean", 0.0, 1), ("max", 0.9, 1))},
        **{f"grad_rollout discard {p} start {s}":
           _rollout([(a * g).mean(0).clamp(min=0) for a, g in zip(A[s:], G[s:])], v, minus_identity=True, discard=p,
                    keep_class=keep)[prefix:]
           for p, s in ((0.5, 0), (0.0, 1))},
        **{f"generic start {s}": r_s for s, r_s in chefer.items()},
        "raw": (v @ A[-1].mean(0))[prefix:],
        "rollout": _rollout([a.mean(0) for a in A], v)[prefix:],
        "grad_rollout": _rollout([(a * g).mean(0).clamp(min=0) for a, g in zip(A, G)], v, minus_identity=True)[prefix:],
        "generic": (v @ (r - eye))[prefix:],
        "attn_gradcam": (w * (v @ A[-1])[:, prefix:]).mean(0).clamp(min=0),
        "cdam": (t * gt).sum(-1),
        "gradcam": torch.relu((t * gt.mean(0)).sum(-1)),
        "legrad": (legrad - legrad.min()) / (legrad.max() - legrad.min()),
    }


def sharpened(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """Model ``name`` of MODELS (seeded, eval, its near-uniform random attention sharpened) and its 2 images."""
    torch.manual_seed(8)
    model = MODELS[name][0]().eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(3.0)
    return model, torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(9))


@pytest.fixture(scope="module", params=list(MODELS))
def case(request):
    readout = MODELS[request.param][1]
    model, x = sharpened(request.param)
    with torch.no_grad():
        classes = model(x).argsort(1)[:, -2]  # the runner-up class
    ex = vx.Explainer(model)
    layout = ex.explain(x[:1], method="raw").layout
    assert layout.grid == (3, 5) and layout.readout == readout
    expected = [oracles(model, x[i], int(classes[i]), layout.num_prefix_tokens, readout) for i in range(len(x))]
    return ex, x, classes, expected


@pytest.mark.parametrize("method", METHODS)
def test_methods_equal_their_formulas_on_every_layout(case, method):
    ex, x, classes, expected = case
    maps = ex.explain(x, method=method, target=classes).maps
    for i, oracle in enumerate(expected):
        want = oracle[method].reshape(3, 5).float()
        scale = float(want.abs().max())
        assert scale > 0 or method == "attn_gradcam", f"{method}: the oracle is all zero"
        torch.testing.assert_close(maps[i], want, rtol=0, atol=RTOL * max(scale, 1e-30), msg=f"{method} image {i}")


OPTIONS = [
    ("rollout", {"head_fusion": "max"}, "rollout max discard 0.0 start 0"),
    ("rollout", {"head_fusion": "min"}, "rollout min discard 0.0 start 0"),
    ("rollout", {"discard_ratio": 0.5}, "rollout mean discard 0.5 start 0"),
    ("rollout", {"start_layer": 1}, "rollout mean discard 0.0 start 1"),
    ("rollout", {"head_fusion": "max", "discard_ratio": 0.9, "start_layer": 1}, "rollout max discard 0.9 start 1"),
    ("grad_rollout", {"discard_ratio": 0.5}, "grad_rollout discard 0.5 start 0"),
    ("grad_rollout", {"start_layer": 1}, "grad_rollout discard 0.0 start 1"),
    ("generic", {"start_layer": 1}, "generic start 1"),
    ("generic", {"start_layer": 2}, "generic start 2"),
]


@pytest.mark.parametrize("method, options, key", OPTIONS, ids=[k for _, _, k in OPTIONS])
def test_options_equal_their_formulas_on_every_layout(case, method, options, key):
    """Head fusion, discard_ratio (the class->class entry kept under a class readout only) and
    start_layer, on the same layouts."""
    ex, x, classes, expected = case
    maps = ex.explain(x, method=method, target=classes, **options).maps
    for i, oracle in enumerate(expected):
        want = oracle[key].reshape(3, 5).float()
        torch.testing.assert_close(maps[i], want, rtol=0, atol=RTOL * float(want.abs().max()), msg=f"{key} image {i}")
