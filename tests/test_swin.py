"""Swin / SwinV2 (timm, torchvision, Hugging Face): windowed attention methods against dense oracles.

Oracles here never use vitexplain's window code:

- the window slots of each block come from the libraries' own ``window_partition`` (timm,
  Hugging Face) or torchvision's inline pad/roll/view, applied to a grid of token indices;
- the per-window probabilities and dy/dA come from an *eager* copy of the model (timm
  ``fused_attn=False``, Hugging Face ``attn_implementation="eager"``), i.e. the softmax output
  the model itself computed and autograd's gradient w.r.t. it, while the method runs on the
  fused (SDPA) model where it can;
- each block's dense N x N matrix is built by scattering the windows, and rollout / Chefer's
  rule are multiplied densely, first layer first, with an explicit merge matrix;
- CDAM is checked per token by central finite differences in float64: S_i = d/de y when the
  attention input token i is scaled by (1 + e) inside the model's own forward.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from vitexplain.adapters import adapter_for
from vitexplain.methods import swin
from vitexplain.methods.context import Context
from vitexplain.targets import resolve
from vitexplain.adapters.swin import HFSwinAdapter, TimmSwinAdapter, TorchvisionSwinAdapter
from hf_helpers import perturb_norms

import timm  # noqa: E402,F401  (a dependency of the package: never skipped)
import torchvision as tv  # noqa: E402  (a dependency of the package: never skipped)
transformers = pytest.importorskip("transformers")

from timm.models.swin_transformer import SwinTransformer, window_partition as timm_partition  # noqa: E402
from timm.models.swin_transformer_v2 import SwinTransformerV2  # noqa: E402
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr  # noqa: E402
from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformerBlockV2  # noqa: E402
from torchvision.models.swin_transformer import SwinTransformer as TVSwin  # noqa: E402
from transformers import (DonutSwinConfig, DonutSwinForImageClassification, SwinConfig, SwinForImageClassification,  # noqa: E402
                          Swinv2Config, Swinv2ForImageClassification)
from transformers.models.swin.modeling_swin import window_partition as hf_partition  # noqa: E402

KINDS = ("timm", "timm2", "timmcr", "tv", "tv2", "hf", "hf2", "hfdonut")  # hfdonut: Donut's Swin (no final norm)
ADAPTERS = {"timm": TimmSwinAdapter, "tv": TorchvisionSwinAdapter, "hf": HFSwinAdapter, "hfdonut": HFSwinAdapter}
POST_NORM = ("timm2", "timmcr", "tv2", "hf2")
CLASSES = 5


def build(kind: str, size: tuple[int, int] = (64, 64), attn: str = "sdpa") -> nn.Module:
    """A tiny random-init Swin (patch 4, window 4, dims 16/32, 2 stages, 2 blocks each),
    with its norms and head re-initialised so that gradients and classes matter."""
    torch.manual_seed(0)
    tiny = dict(embed_dim=16, depths=(2, 2), num_heads=(2, 4))
    if kind.startswith("timm"):
        cls = {"timm": SwinTransformer, "timm2": SwinTransformerV2, "timmcr": SwinTransformerV2Cr}[kind]
        model = cls(img_size=size, patch_size=4, window_size=4, num_classes=CLASSES, **tiny)
        if kind == "timm":
            for module in model.modules():
                if hasattr(module, "fused_attn"):
                    module.fused_attn = attn == "sdpa"
    elif kind in ("tv", "tv2"):
        extra = dict(block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2) if kind == "tv2" else {}
        model = TVSwin(patch_size=[4, 4], window_size=[4, 4], num_classes=CLASSES, embed_dim=16, depths=[2, 2],
                       num_heads=[2, 4], **extra)
    else:
        cfg_cls, cls = {"hf": (SwinConfig, SwinForImageClassification), "hf2": (Swinv2Config, Swinv2ForImageClassification),
                        "hfdonut": (DonutSwinConfig, DonutSwinForImageClassification)}[kind]
        config = cfg_cls(image_size=size[0], patch_size=4, window_size=4, num_labels=CLASSES, embed_dim=16,
                         depths=[2, 2], num_heads=[2, 4])
        config._attn_implementation = attn if kind == "hf" else "eager"
        model = cls(config)
    generator = torch.Generator().manual_seed(1)
    perturb_norms(model, generator)
    with torch.no_grad():
        head = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == CLASSES][-1]
        head.weight.normal_(0.0, 1.0, generator=generator)
    return model.eval()


def eager_twin(kind: str, model: nn.Module, size: tuple[int, int]) -> nn.Module:
    """The same weights with eager (Python softmax) attention."""
    if kind not in ("timm", "hf"):
        return model
    twin = build(kind, size, attn="eager")
    twin.load_state_dict(model.state_dict())
    return twin


def window_shift(kind: str, model: nn.Module, block: str, grid: tuple[int, int]) -> tuple[tuple, tuple]:
    """A block's window and shift as its own forward uses them (read from the model)."""
    module = model.get_submodule(block)
    if kind.startswith("timm"):
        return tuple(module.window_size), tuple(module.shift_size)
    if kind.startswith("hf"):
        return (int(module.window_size),) * 2, (int(module.shift_size),) * 2
    window, shift = list(module.attn.window_size), list(module.attn.shift_size)
    padded = [-(-g // w) * w for g, w in zip(grid, window)]
    return tuple(window), tuple(0 if w >= p else s for w, p, s in zip(window, padded, shift))


def oracle_slots(kind: str, model: nn.Module, block: str, grid: tuple[int, int]) -> torch.Tensor:
    """(nW, n): the grid index in each window slot (-1: padding), from the libraries' own ops."""
    (wh, ww), (sh, sw) = window_shift(kind, model, block, grid)
    h, w = grid
    ph, pw = (-h) % wh, (-w) % ww
    idx = torch.arange(h * w, dtype=torch.float64).view(1, h, w, 1)
    if kind.startswith("timm"):  # roll the real grid, then pad, then timm's window_partition
        idx = F.pad(torch.roll(idx, (-sh, -sw), (1, 2)), (0, 0, 0, pw, 0, ph), value=-1)
        windows = timm_partition(idx, (wh, ww))
    elif kind.startswith("hf"):  # pad, roll, Hugging Face's window_partition
        windows = hf_partition(torch.roll(F.pad(idx, (0, 0, 0, pw, 0, ph), value=-1), (-sh, -sw), (1, 2)), wh)
    else:  # torchvision's shifted_window_attention, inline: pad, roll, view, permute
        x = torch.roll(F.pad(idx, (0, 0, 0, pw, 0, ph), value=-1), (-sh, -sw), (1, 2))
        hp, wp = h + ph, w + pw
        windows = x.view(1, hp // wh, wh, wp // ww, ww, 1).permute(0, 1, 3, 2, 4, 5)
    return windows.reshape(-1, wh * ww).long()


def grids_of(adapter, size) -> list[tuple[int, int]]:
    grid = (size[0] // 4, size[1] // 4)
    out = [grid]
    for _ in range(adapter.num_stages - 1):
        grid = ((grid[0] + 1) // 2, (grid[1] + 1) // 2)
        out.append(grid)
    return out


def eager_attention(kind: str, model: nn.Module, x: torch.Tensor, cls: int):
    """Per block: the eager model's own probabilities (B * nW, H, n, n) and autograd dy/dA."""
    twin = eager_twin(kind, model, tuple(x.shape[-2:]))
    with vx.capture(twin, grads=True) as rec:  # eager records hold the model's softmax outputs
        logits = adapter_for(twin).forward(x.clone().requires_grad_(True))
    rec.backward(logits[:, cls])
    adapter = adapter_for(twin)
    out = []
    for block in adapter.blocks:
        record = [r for r in rec.records if r.name.startswith(block)][-1]
        assert record.source == "eager"
        out.append((record._probs.detach().double(), record._grad_probs.double()))
    return out


def dense(windows: torch.Tensor, slots: torch.Tensor, n: int, batch: int) -> torch.Tensor:
    """Scatter per-window (B * nW, H, m, m) into the dense (B, H, N, N) matrix."""
    per = windows.double().view(batch, slots.shape[0], *windows.shape[1:])
    out = torch.zeros(batch, per.shape[2], n, n, dtype=torch.float64)
    for w in range(slots.shape[0]):
        real = slots[w] >= 0
        ids = slots[w][real]
        out[:, :, ids[:, None], ids[None, :]] = per[:, w][:, :, real][:, :, :, real]
    return out


def merge_matrix(fine: tuple[int, int], coarse: tuple[int, int]) -> torch.Tensor:
    """D (N_coarse, N_fine): each merged token spreads 1 / #children over its 2 x 2 children."""
    d = torch.zeros(coarse[0] * coarse[1], fine[0] * fine[1], dtype=torch.float64)
    for i in range(fine[0]):
        for j in range(fine[1]):
            d[(i // 2) * coarse[1] + j // 2, i * fine[1] + j] = 1.0
    return d / d.sum(dim=1, keepdim=True)


class Oracle:
    """Dense per-block matrices of one model and input."""

    def __init__(self, kind: str, model: nn.Module, x: torch.Tensor, cls: int) -> None:
        adapter = adapter_for(model)
        size = tuple(x.shape[-2:])
        self.batch = x.shape[0]
        self.grids = grids_of(adapter, size)
        self.stages = [b.stage for b in adapter.swin_blocks]
        eager = eager_attention(kind, model, x, cls)
        self.probs, self.grads, self.support = [], [], []
        for block, stage, (p, g) in zip(adapter.blocks, self.stages, eager):
            grid = self.grids[stage]
            slots = oracle_slots(kind, model, block, grid)
            n = grid[0] * grid[1]
            self.probs.append(dense(p, slots, n, self.batch))
            self.grads.append(dense(g, slots, n, self.batch))
            self.support.append(dense(torch.ones(slots.shape[0], 1, *p.shape[-2:]), slots, n, 1)[0, 0] > 0)

    def chain(self, matrix: Callable[[int], torch.Tensor], step: str, to_stage: int = 0,
              deviation: bool = False) -> torch.Tensor:
        """Dense product R, first layer first; the readout row (mean over the last stage) of R,
        or of R - R_identity (the merges alone) with ``deviation``."""
        n0 = self.grids[to_stage][0] * self.grids[to_stage][1]
        eye = torch.eye(n0, dtype=torch.float64).expand(self.batch, n0, n0)
        r, r_id, stage = eye.clone(), eye.clone(), to_stage
        for l, s in enumerate(self.stages):
            if s < to_stage:
                continue
            if s != stage:
                d = merge_matrix(self.grids[stage], self.grids[s])
                r, r_id, stage = d @ r, d @ r_id, s
            m = matrix(l)
            n = m.shape[-1]
            if step == "rollout":
                a_hat = 0.5 * m + 0.5 * torch.eye(n, dtype=torch.float64)
                r = (a_hat / a_hat.sum(-1, keepdim=True)) @ r
            else:
                r = r + m @ r
        readout = torch.full((self.batch, 1, r.shape[1]), 1.0 / r.shape[1], dtype=torch.float64)
        out = readout @ (r - r_id if deviation else r)
        return out.view(self.batch, *self.grids[to_stage])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def discard(m: torch.Tensor, support: torch.Tensor, ratio: float) -> torch.Tensor:
    """Zero each image's smallest `ratio` of the entries on the support (same-window pairs)."""
    out = m.clone()
    count = int(int(support.sum()) * ratio)
    for b in range(m.shape[0]):
        values = m[b][support]
        threshold_idx = values.argsort()[:count]
        flat = out[b][support]
        flat[threshold_idx] = 0
        out[b][support] = flat
    return out


# -- recognition, geometry, capture ---------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_adapter_recognises_every_swin_family(kind):
    model = build(kind)
    adapter = adapter_for(model)
    assert isinstance(adapter, ADAPTERS[kind.rstrip("2").removesuffix("cr")]) and adapter.family == "swin"
    assert adapter.post_norm == (kind in POST_NORM)
    assert vx.Explainer(model).family == "swin"
    assert "rollout" in vx.Explainer(model).methods() and "cdam" in vx.Explainer(model).methods()
    layout = adapter.layout((64, 64))
    assert layout.grid == (8, 8) and layout.readout == "mean" and layout.windowed
    assert vx.token_layout(model, (64, 64)) == layout  # the one recognition path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("size", [(64, 64), (72, 72)])
def test_window_partition_matches_the_models_own_attention_input(kind, size):
    """partition(T) equals the windows each attention module received (shift and padding
    included); the record shapes match the geometry."""
    model = build(kind, size)
    adapter = adapter_for(model)
    x = torch.randn(2, 3, *size)
    names = [b.attention for b in adapter.swin_blocks] + adapter.blocks
    with vx.capture(model, activations=names) as rec:
        adapter.forward(x)
    grids = adapter.stage_grids(size)
    assert grids == grids_of(adapter, size)
    for i, block in enumerate(adapter.swin_blocks):
        geometry = adapter.geometry(i, grids[block.stage])
        assert torch.equal(geometry.index(), oracle_slots(kind, model, block.name, grids[block.stage]))
        received = rec.activation(block.attention).input
        block_in = adapter.to_grid(rec.activation(block.name).input, grids[block.stage])
        norm = None if adapter.post_norm else model.get_submodule(block.name + (".layernorm_before" if kind in ("hf", "hfdonut") else ".norm1"))
        tokens = block_in if norm is None else norm(block_in)
        if adapter.windowed_input:
            torch.testing.assert_close(geometry.partition(tokens), received, rtol=0, atol=0)
            torch.testing.assert_close(geometry.unpartition(received), tokens, rtol=0, atol=0)
        else:
            torch.testing.assert_close(received, tokens, rtol=0, atol=0)
        record = [r for r in rec.records if r.name.startswith(block.name)][-1]
        assert record.batch_size == 2 * geometry.num_windows and record.num_queries == geometry.window_area


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_recomputed_window_probabilities_match_eager_attention(kind):
    """SDPA records (q, k, mask incl. shift mask and relative position bias) recompute the
    eager model's own softmax output to 1e-5."""
    model = build(kind)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), vx.capture(model) as rec:
        adapter_for(model).forward(x)
    assert {r.source for r in rec.records} == {"sdpa"}
    eager = eager_attention(kind, model, x, cls=0)
    for record, (probs, _) in zip(rec.records, eager):
        assert (record.probs().double() - probs).abs().max() < 1e-5
    if kind == "hf":  # and Hugging Face's own output_attentions (last block of each stage)
        twin = eager_twin(kind, model, (64, 64))
        attentions = twin(x, output_attentions=True).attentions
        for stage, att in enumerate(attentions):
            last = [r for r in rec.records if f"layers.{stage}." in r.name][-1]
            assert (last.probs() - att).abs().max() < 1e-5


# -- windowed propagation against the dense oracle ----------------------------------------
def fuse(probs: torch.Tensor, how: str) -> torch.Tensor:
    return {"mean": probs.mean(1), "max": probs.amax(1), "min": probs.amin(1)}[how]


def captured(model: nn.Module, x: torch.Tensor, cls: int) -> Context:
    """One fused forward + backward of the target logit, as the Explainer captures it."""
    adapter = adapter_for(model)
    x = x.clone().requires_grad_(True)
    with torch.enable_grad(), vx.capture(model, grads=True) as rec:
        outputs = adapter.forward(x)
    target = resolve(cls, outputs)
    rec.backward(target.score(outputs))
    return Context(adapter, x, outputs, target, rec, adapter.layout(tuple(x.shape[-2:])), method="test")


# every build on a divisible grid; padded grids (72 px: 18 x 18 and 9 x 9 tokens, window 4) for
# roll-then-pad (timm) and pad-then-roll (torchvision, Hugging Face), V1 and V2 blocks
ORACLE_CASES = [(kind, (64, 64)) for kind in KINDS] + [(k, (72, 72)) for k in ("timm", "tv2", "hf")]


@pytest.mark.parametrize("kind, size", ORACLE_CASES, ids=[f"{k}-{s[0]}" for k, s in ORACLE_CASES])
def test_attention_methods_match_dense_oracle(kind, size):
    """Windowed propagation == dense products of the scattered eager windows (1e-5 relative)."""
    model = build(kind, size)
    x = torch.randn(2, 3, *size)
    cls = 2
    oracle = Oracle(kind, model, x, cls)
    mean = lambda l: fuse(oracle.probs[l], "mean")  # noqa: E731
    grad_weighted = lambda l: (oracle.probs[l] * oracle.grads[l]).mean(1).clamp(min=0)  # noqa: E731
    chefer = lambda l: (oracle.grads[l] * oracle.probs[l]).clamp(min=0).mean(1)  # noqa: E731
    # the front door once (one shared forward and backward) ...
    front = vx.Explainer(model).explain(x, method=["rollout", "grad_rollout", "generic"], target=cls)
    errors = {
        "rollout": rel_err(front[0].maps, oracle.chain(mean, "rollout")),
        "grad_rollout": rel_err(front[1].maps, oracle.chain(grad_weighted, "rollout", deviation=True)),
        "generic": rel_err(front[2].maps, oracle.chain(chefer, "generic", deviation=True)),
    }
    # ... and the options on one capture
    ctx = captured(model, x, cls)
    errors["rollout/max"] = rel_err(swin.rollout(ctx, head_fusion="max"), oracle.chain(lambda l: fuse(oracle.probs[l], "max"), "rollout"))
    want = oracle.chain(lambda l: discard(mean(l), oracle.support[l], 0.5), "rollout")
    errors["rollout/discard"] = rel_err(swin.rollout(ctx, discard_ratio=0.5), want)
    errors["rollout/stage1"] = rel_err(swin.rollout(ctx, stage=1), oracle.chain(mean, "rollout", to_stage=1))
    errors["generic/stage1"] = rel_err(swin.generic(ctx, stage=1), oracle.chain(chefer, "generic", to_stage=1, deviation=True))
    for layer in (0, 1, -1):
        grid = oracle.grids[oracle.stages[layer]]
        a = oracle.probs[layer]
        errors[f"raw/{layer}"] = rel_err(swin.raw(ctx, layer=layer), mean(layer).mean(1).view(-1, *grid))
        got = swin.raw(ctx, layer=layer, head=1, query=(1, 2))
        errors[f"raw/{layer}/query"] = rel_err(got, a[:, 1, 1 * grid[1] + 2].view(-1, *grid))
    a, g = oracle.probs[-1], oracle.grads[-1]
    weights = g.mean(dim=2).mean(dim=-1, keepdim=True)  # per head: mean over keys of the readout row
    unclamped = (weights * a.mean(dim=2)).mean(1).view(-1, *oracle.grids[-1])
    got = swin.attn_gradcam(ctx)
    errors["attn_gradcam"] = float((got - unclamped.clamp(min=0)).abs().max() / unclamped.abs().max())
    print(kind, size, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("kind", ["timm", "tv2"])
def test_rollout_is_a_distribution_and_matches_a_batch_of_one(kind):
    model = build(kind, (72, 72))
    x = torch.randn(3, 3, 72, 72)
    ex = vx.Explainer(model)
    maps = ex.explain(x, method=["rollout", "generic", "cdam", "raw"], target=1)
    torch.testing.assert_close(maps[0].maps.sum(dim=(1, 2)), torch.ones(3), rtol=0, atol=1e-5)
    for i in range(3):
        singles = ex.explain(x[i : i + 1], method=["rollout", "generic", "cdam", "raw"], target=1)
        for batched, single in zip(maps, singles):
            torch.testing.assert_close(batched.maps[i : i + 1], single.maps, rtol=1e-4, atol=1e-7)


# -- last-stage token methods -----------------------------------------------------------------
def scaled_token_outputs(kind: str, model: nn.Module, x: torch.Tensor, tokens: torch.Tensor, factors: torch.Tensor):
    """The model's own forward on copies of one image, copy k with token ``tokens[k]`` of the
    last attention's input scaled by ``factors[k]`` (the residual stream untouched)."""
    adapter = adapter_for(model)
    block = adapter.swin_blocks[-1]
    grid = grids_of(adapter, tuple(x.shape[-2:]))[-1]
    copies = torch.arange(len(tokens))
    scale = factors.to(x.dtype)[:, None]

    def hook(mod, args):
        inp = args[0].clone()
        if kind.startswith("tv"):  # torchvision's attention module receives the grid
            inp[copies, tokens // grid[1], tokens % grid[1]] *= scale
        else:
            slots = oracle_slots(kind, model, block.name, grid)
            where = torch.stack([(slots == t).nonzero()[0] for t in tokens.tolist()])
            per_copy = inp.view(len(tokens), -1, *inp.shape[1:])
            per_copy[copies, where[:, 0], where[:, 1]] *= scale
        return (inp, *args[1:])

    handle = model.get_submodule(block.attention).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return adapter.forward(x.expand(len(tokens), -1, -1, -1))
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", KINDS)
def test_cdam_matches_finite_differences_along_the_attention_input(kind):
    """S_i = T_i . dy/dT_i = d/de y(T_i -> (1 + e) T_i) at e = 0 (float64 central differences,
    Richardson-extrapolated from steps 2e-2 and 1e-2), with the residual stream untouched: the
    attention path only, V1 and V2 alike."""
    model = build(kind).double()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    cls = 3
    maps = vx.Explainer(model).explain(x, method="cdam", target=cls).maps.double().flatten()
    tokens = torch.arange(maps.numel())

    def central(step: float) -> torch.Tensor:
        up = scaled_token_outputs(kind, model, x, tokens, torch.full((len(tokens),), 1 + step))[:, cls]
        down = scaled_token_outputs(kind, model, x, tokens, torch.full((len(tokens),), 1 - step))[:, cls]
        return (up - down) / (2 * step)

    fd = (4 * central(1e-2) - central(2e-2)) / 3
    assert fd.abs().max() > 0
    error = rel_err(maps, fd)
    print(kind, f"cdam vs finite differences: {error:.1e}")
    assert error < 1e-5  # measured 0.9e-6 .. 1.0e-6 (the float32 map's precision)


@pytest.mark.parametrize("kind", ["timm", "tv", "hf"])
def test_gradcam_and_cdam_match_autograd_at_the_last_norm1(kind):
    """V1 blocks normalise before attention: T = norm1(x) of the last block, and full-model
    autograd w.r.t. it is the attention-path gradient."""
    model = build(kind)
    adapter = adapter_for(model)
    x = torch.randn(2, 3, 64, 64)
    cls = 1
    norm = model.get_submodule(adapter.blocks[-1] + (".layernorm_before" if kind in ("hf", "hfdonut") else ".norm1"))
    seen = []
    handle = norm.register_forward_hook(lambda m, a, out: seen.append(out) or out.retain_grad())
    try:
        adapter.forward(x)[:, cls].sum().backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    t, g = seen[-1].detach(), seen[-1].grad
    t, g = t.reshape(2, 8, 8, -1), g.reshape(2, 8, 8, -1)
    ex = vx.Explainer(model)
    cdam, gradcam = ex.explain(x, method=["cdam", "gradcam"], target=cls)
    errors = (rel_err(cdam.maps, (t * g).sum(-1)), rel_err(gradcam.maps, torch.relu((t * g.mean(dim=(1, 2), keepdim=True)).sum(-1))))
    print(kind, "cdam, gradcam vs autograd:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 1e-5


@pytest.mark.parametrize("kind", ["timm", "tv2", "hf2", "hfdonut"])  # hfdonut: its head re-run has no final norm
def test_integrated_cdam_is_complete_and_smooth_cdam_without_noise_is_cdam(kind):
    model = build(kind)
    adapter = adapter_for(model)
    x = torch.randn(2, 3, 64, 64)
    cls = 0
    ex = vx.Explainer(model)
    integrated = ex.explain(x, method="cdam_integrated", target=cls, steps=64).maps
    # y(T) - y(T' = 0): the model's own forward with the last attention's input zeroed
    module = model.get_submodule(adapter.swin_blocks[-1].attention)
    handle = module.register_forward_pre_hook(lambda m, args: (torch.zeros_like(args[0]), *args[1:]))
    try:
        with torch.no_grad():
            y0 = adapter.forward(x)[:, cls]
    finally:
        handle.remove()
    with torch.no_grad():
        y = adapter.forward(x)[:, cls]
    gap = integrated.sum(dim=(1, 2)) - (y - y0)
    assert gap.abs().max() < 1e-3 * (y - y0).abs().max()  # midpoint rule, 64 steps: measured <= 1.6e-4
    smooth, plain = ex.explain(x, method=["cdam_smooth", "cdam"], target=cls, cdam_smooth={"samples": 3, "noise": 0.0})
    torch.testing.assert_close(smooth.maps, plain.maps, rtol=1e-5, atol=1e-7)
    noisy = ex.explain(x, method="cdam_smooth", target=cls, samples=3).maps
    assert not torch.allclose(noisy, plain.maps)


@pytest.mark.parametrize("kind", ["timm", "tv", "hf2"])
def test_legrad_matches_eager_autograd_oracle(kind):
    """LeGrad on the last stage: d s_l / dA_l by autograd through the eager model's own
    softmax outputs, scattered densely, ReLU, mean over heads and query tokens, mean over l."""
    model = build(kind)
    x = torch.randn(2, 3, 64, 64)
    cls = 4
    got = vx.Explainer(model).explain(x, method="legrad", target=cls).maps
    twin = eager_twin(kind, model, (64, 64))
    adapter = adapter_for(twin)
    last = adapter.stage_blocks(-1)
    outputs = {}
    hooks = [twin.get_submodule(adapter.blocks[i]).register_forward_hook(
        lambda m, a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in last]
    try:
        with vx.capture(twin, grads=True) as rec:
            adapter.forward(x.clone().requires_grad_(True))
    finally:
        for h in hooks:
            h.remove()
    grid = grids_of(adapter, (64, 64))[-1]
    if kind == "timm":
        head = lambda t: twin.forward_head(twin.norm(t))  # noqa: E731
    elif kind == "tv":
        head = lambda t: twin.head(twin.flatten(twin.avgpool(twin.permute(twin.norm(t)))))  # noqa: E731
    else:
        base = twin.swinv2
        head = lambda t: twin.classifier(base.pooler(base.layernorm(t).transpose(1, 2)).flatten(1))  # noqa: E731
    total = 0
    for i in last:
        probs = [r for r in rec.records if r.name.startswith(adapter.blocks[i])][-1]._out
        (grad,) = torch.autograd.grad(head(outputs[i])[:, cls].sum(), probs, retain_graph=True)
        slots = oracle_slots(kind, twin, adapter.blocks[i], grid)
        d = dense(grad, slots, grid[0] * grid[1], 2)
        total = total + torch.relu(d).mean(dim=(1, 2))
    want = (total / len(last)).view(2, -1)
    want = (want - want.amin(1, keepdim=True)) / (want.amax(1, keepdim=True) - want.amin(1, keepdim=True))
    error = rel_err(got.flatten(1), want)
    print(kind, f"legrad vs eager autograd: {error:.1e}")
    assert error < 1e-5


# -- classes, errors, side effects ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["timm", "tv2", "hf"])
def test_gradient_maps_are_class_sensitive_and_attention_maps_are_not(kind):
    model = build(kind)
    x = torch.randn(1, 3, 64, 64)
    ex = vx.Explainer(model)
    names = ["rollout", "raw", "generic", "grad_rollout", "cdam", "gradcam", "legrad", "attn_gradcam"]
    first = ex.explain(x, method=names, target=0)
    second = ex.explain(x, method=names, target=3)
    for a, b in zip(first, second):
        assert torch.isfinite(a.maps).all() and a.maps.std() > 0, a.method
        if a.method in ("rollout", "raw"):
            torch.testing.assert_close(a.maps, b.maps)
        else:
            assert not torch.allclose(a.maps, b.maps, rtol=1e-3, atol=0), a.method


def test_every_listed_method_runs_on_every_family_and_leaves_the_model_as_found():
    x = torch.randn(1, 3, 32, 32)
    cheap = {"cdam_smooth": {"samples": 2}, "cdam_integrated": {"steps": 4}, "integrated_gradients": {"steps": 4},
             "smoothgrad": {"samples": 2}}
    for kind in KINDS:
        model = build(kind, (32, 32))
        before = {n: p.requires_grad for n, p in model.named_parameters()}
        names = vx.Explainer(model).methods()
        assert set(names) >= {"raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "gradcam", "cdam",
                              "cdam_smooth", "cdam_integrated", "legrad", "integrated_gradients", "occlusion", "smoothgrad"}
        results = vx.Explainer(model).explain(x, method=names, **{n: cheap.get(n, {}) for n in names})
        for e in results:
            assert e.maps.shape[0] == 1 and torch.isfinite(e.maps).all(), (kind, e.method)
        assert not model.training
        assert {n: p.requires_grad for n, p in model.named_parameters()} == before
        assert all(p.grad is None for p in model.parameters())
        for module in model.modules():
            assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks


class Doubled(SwinTransformer):
    """A model whose forward does more than its head: re-running the head cannot reproduce it."""

    def forward(self, x):
        return super().forward(x) * 2.0


def test_a_partial_forward_that_does_not_reproduce_the_model_raises():
    torch.manual_seed(0)
    model = Doubled(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                    num_classes=CLASSES).eval()
    with torch.no_grad():
        model.head.fc.weight.normal_()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 32, 32)
    for method in ("cdam", "gradcam", "cdam_smooth", "cdam_integrated", "legrad"):
        with pytest.raises(vx.UnsupportedModelError, match="does not reproduce"):
            ex.explain(x, method=method)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert ex.explain(x, method="generic").maps.shape == (1, 8, 8)  # attention methods re-run nothing


def test_clear_errors_for_what_does_not_apply():
    model = build("timm")
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(vx.UnsupportedMethodError, match="last stage"):
        ex.explain(x, method="legrad", layers=[0])
    with pytest.raises(vx.OptionError, match="outside the stage grid"):
        ex.explain(x, method="raw", query=(8, 0))
    with pytest.raises(vx.OptionError, match="'head' must be in"):
        ex.explain(x, method="raw", head=7)
    with pytest.raises(vx.OptionError, match="'stage' must be in"):
        ex.explain(x, method="rollout", stage=2)
    with pytest.raises(vx.OptionError, match="'layer' must be in"):
        ex.explain(x, method="raw", layer=4)
    with pytest.raises(vx.UnsupportedMethodError, match="is a swin model"):
        ex.explain(x, method="spatial")
    backbone = transformers.SwinBackbone(SwinConfig(image_size=64, patch_size=4, window_size=4, embed_dim=16,
                                                    depths=[2, 2], num_heads=[2, 4], out_features=["stage2"]))
    with pytest.raises(vx.UnsupportedModelError, match="not an image classifier"):
        vx.Explainer(backbone)


def test_headless_hugging_face_swin_model_explains_a_callable_score():
    config = SwinConfig(image_size=64, patch_size=4, window_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4])
    model = transformers.SwinModel(config).eval()
    direction = torch.randn(32)
    score = lambda pooled: pooled @ direction  # noqa: E731  (the adapter returns the pooled embedding)
    ex = vx.Explainer(model)
    for method in ("cdam", "generic", "legrad"):
        maps = ex.explain(torch.randn(2, 3, 64, 64), method=method, target=score).maps
        assert torch.isfinite(maps).all() and maps.std() > 0
    with pytest.raises(vx.TargetError):  # no classifier: a class index means nothing
        ex.explain(torch.randn(1, 3, 64, 64), method="cdam", target=0)


def test_an_adapter_without_a_capability_refuses_the_methods_that_need_it():
    model = build("tv")

    class NoRerun(TorchvisionSwinAdapter):
        capabilities = TorchvisionSwinAdapter.capabilities - {"tail"}

    ex = vx.Explainer(model, adapter=NoRerun(model))
    assert "cdam" not in ex.methods() and "generic" in ex.methods()
    with pytest.raises(vx.UnsupportedMethodError, match="Methods that apply"):
        ex.explain(torch.randn(1, 3, 64, 64), method="cdam")


def test_hugging_face_swin_v1_refuses_an_input_narrower_than_its_window_and_stays_usable():
    """transformers' Swin V1 shrinks a layer's window in place when a stage grid is narrower than it, then
    fails on its relative-position table, and stays broken; the explainer refuses such input before the model
    runs. V2 (a position MLP for any window) takes it."""
    model = build("hf")  # patch 4, window 4, two stages: a 64 x 64 input has grids 16 and 8
    x_small = torch.randn(1, 3, 24, 24)  # grids 6 and 3: the second is narrower than the window
    broken = copy.deepcopy(model)  # the oracle: the model itself fails on it, and afterwards on any input
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            broken(pixel_values=x_small)
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            broken(pixel_values=torch.randn(1, 3, 64, 64))
    ex = vx.Explainer(model)
    windows = [layer.window_size for layer in model.modules() if type(layer).__name__ == "SwinLayer"]
    for method in ("rollout", "cdam"):
        with pytest.raises(vx.InputError, match=r"3x3.*at least 32x32"):
            ex.explain(x_small, method=method)
    assert [layer.window_size for layer in model.modules() if type(layer).__name__ == "SwinLayer"] == windows
    assert ex.explain(torch.randn(2, 3, 32, 40), method="rollout").maps.shape == (2, 8, 10)  # grids 8x10, 4x5: fits
    v2 = build("hf2")
    assert torch.isfinite(vx.Explainer(v2).explain(x_small, method="rollout").maps).all()


def test_hugging_face_swin_v1_keeps_its_shifts_after_an_input_whose_grid_equals_its_window():
    """On an input where a stage grid equals the window (32 x 32 here: stage 1 is 4 x 4, window 4), transformers'
    Swin V1 sets that stage's shift_size to 0 in place and keeps it: later inputs at the model's own size then ran
    without the shifted windows, so explaining one small image changed the model's logits and every later map.
    The explanation at 32 x 32 still uses the unshifted windows transformers computes there (it equals a fresh
    copy's), and the model is left as found."""
    model = build("hf")
    fresh = copy.deepcopy(model)
    shifts = [layer.shift_size for layer in model.modules() if type(layer).__name__ == "SwinLayer"]
    assert 0 in shifts and any(shifts)  # a shifted block in each stage
    x, small = torch.randn(2, 3, 64, 64), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    ex = vx.Explainer(model)
    names = ["rollout", "generic", "cdam_integrated"]
    got = ex.explain(small, method=names)
    assert [layer.shift_size for layer in model.modules() if type(layer).__name__ == "SwinLayer"] == shifts
    with torch.no_grad():
        assert torch.equal(model(pixel_values=x).logits, logits)
    for ours, theirs in zip(got, vx.Explainer(copy.deepcopy(fresh)).explain(small, method=names)):
        torch.testing.assert_close(ours.maps, theirs.maps)
    for ours, theirs in zip(ex.explain(x, method=names), vx.Explainer(fresh).explain(x, method=names)):
        torch.testing.assert_close(ours.maps, theirs.maps)


@pytest.mark.parametrize("kind", ["timm", "timm2", "timmcr"])
def test_a_max_pooling_head_refuses_the_methods_that_start_from_the_mean_readout(kind):
    """timm's Swins take global_pool='max': the head then reads the channel-wise maximum of the last tokens,
    not the mean raw, rollout, grad_rollout, generic and attention Grad-CAM start from, so those are refused
    with the reason; CDAM (the gradient of the model's own output) and LeGrad (the model's own head on each
    block's tokens) still apply, and LeGrad is the default."""
    cls = {"timm": SwinTransformer, "timm2": SwinTransformerV2, "timmcr": SwinTransformerV2Cr}[kind]
    torch.manual_seed(0)
    model = cls(img_size=(32, 32), patch_size=4, window_size=4, num_classes=CLASSES, embed_dim=16, depths=(1, 1),
                num_heads=(1, 2), global_pool="max").eval()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    for method in ("raw", "rollout", "grad_rollout", "generic", "attn_gradcam"):
        with pytest.raises(vx.UnsupportedMethodError, match=r"global_pool='max'.*mean of its last tokens"):
            ex.explain(x, method=method, target=1)
    assert {"cdam", "legrad"} <= set(ex.methods())
    e = ex.explain(x, target=1)
    assert e.method == "legrad" and e.maps.shape == (1, *e.layout.grid)
