"""LeGrad and smooth / integrated CDAM on the last stage of SAM 2's Hiera (timm ``HieraDet`` with and without its
head, Hugging Face ``Sam2HieraDetModel``), Hugging Face ``Sam3ViTModel``, timm CAFormer and timm TinyViT, against
float64 oracles built here (the pattern of tests/test_hier_legrad.py and tests/test_hier_cdam_rerun.py).

LeGrad's oracle: an eager float64 copy (fused attention off; Hugging Face: its eager attention), every softmax
output taped; per last-stage block l, ``s_l`` = the head written out here from the model's code (pooling, norm,
classifier; headless: the mean the adapter scores) on block l's output caught by a forward hook; ``dy/dA_l`` by
plain autograd; ReLU, summed over heads and queries, divided by both; the keys of each window placed on the grid
by the model's own window partition run on token indices (padding dropped); mean over the blocks; min-max.
Hugging Face's eager attention takes its softmax in float32 (``dtype=torch.float32``): the oracle's one float32
step there.

The re-run CDAM oracles: T is the output of the last block's token site (the tokens entering its attention), as
a leaf of a full eager float64 forward (integrated: replaced by ``alpha_k T`` on the midpoint path; smooth: the
last block's input replaced by a pre-hook with the method's seeded draws); per token ``sum_d T_d dy/dT_d``, put
on the grid by the model's own layout (TinyViT: its window reverse).
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
from hier_oracle import SoftmaxTape, unfuse_all
from test_hier_legrad import CLASSES, TARGET, Layer, _eye, _global, _reinit, _windowed

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
from timm.models import hieradet_sam2 as hieradet  # noqa: E402
from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, SepConv  # noqa: E402

import support_table as support  # noqa: E402


def _unit_gains(model: nn.Module) -> nn.Module:
    """Every weight matrix N(0, 1 / fan_in): random init makes SAM-style attention near uniform and its relevance
    too small to resolve in float32."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p[0].numel() ** 0.5)
    return model


def _hieradet(num_classes: int = CLASSES, **kwargs) -> nn.Module:
    """64 px: grids 16, 8, 4; block 3 pools into the 4 x 4 grid, block 4 attends in zero-padded windows of 3 on
    it, block 5 globally (the support table's build)."""
    config = dict(embed_dim=16, num_heads=1, stages=(1, 2, 3), q_pool=2, window_spec=(4, 2, 3), global_att_blocks=(5,),
                  global_pos_size=(4, 4), num_classes=num_classes)
    return _unit_gains(hieradet.HieraDet(**{**config, **kwargs}))


def _tinyvit() -> nn.Module:
    """128 px: grids 32 (MBConv), 16, 8, 4; the last stage's two blocks attend in 4 zero-padded windows of 3."""
    model = timm.create_model("tiny_vit_5m_224", num_classes=CLASSES, embed_dims=(16, 32, 48, 64), depths=(1, 2, 1, 2),
                              num_heads=(1, 2, 2, 4), window_sizes=(3, 3, 3, 3))
    with torch.no_grad():  # zero-initialised position biases: random ones, so the windows' slots differ
        for module in model.modules():
            if isinstance(getattr(module, "attention_biases", None), nn.Parameter):
                module.attention_biases.normal_(0, 1)
                module.attention_bias_cache = {}
    return model


#: kind -> (builder, input size, headless): grids of the last stage are 4 x 4 (Sam3: its one 8 x 8 grid)
KINDS = {
    "hieradet": (_hieradet, 64, False),
    # headless (timm's sam2_hiera_* default, num_classes=0): the head's norm of the pooled grid is the output
    "hieradet_headless": (lambda: _hieradet(num_classes=0), 64, True),
    # one pooling for three stages: block 3 widens the tokens on the 8 x 8 grid (block 2 there is narrower)
    "hieradet_qpool1": (lambda: _hieradet(stages=(1, 2, 2), q_pool=1, window_spec=(4, 3, 3), global_att_blocks=(4,),
                                          global_pos_size=(8, 8)), 64, False),
    "hf_sam2": (lambda: _unit_gains(transformers.Sam2HieraDetModel(support.hf_sam2_hiera_config())), 64, True),
    # patch 14 on 112 px: an 8 x 8 grid, windows of 3 (9 windows, zero-padded), global layers 1 and 3
    "sam3": (lambda: _unit_gains(transformers.Sam3ViTModel(transformers.Sam3ViTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, image_size=112,
        patch_size=14, window_size=3, global_attn_indexes=[1, 3], pretrain_image_size=56))), 112, True),
    # 128 px: grids 32, 16 (separable convs), 8, 4 (global attention, two blocks each); timm's MLP head
    "caformer": (lambda: MetaFormer(depths=(1, 1, 2, 2), dims=(16, 32, 64, 96),
                                    token_mixers=[SepConv, SepConv, Attention, Attention],
                                    norm_layers=[LayerNorm2dNoBias] * 2 + [LayerNormNoBias] * 2, num_classes=CLASSES),
                 128, False),
    "tinyvit": (_tinyvit, 128, False),
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _reinit(KINDS[kind][0]())


def images(kind: str, n: int = 2, seed: int = 1) -> torch.Tensor:
    size = KINDS[kind][1]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def target(kind: str):
    """Class TARGET; headless: a callable scoring entry TARGET of the embedding the adapter scores (the oracle's)."""
    return (lambda pooled: pooled[:, TARGET]) if KINDS[kind][2] else TARGET


def eager_copy(model: nn.Module) -> nn.Module:
    eager = copy.deepcopy(model).double().eval()
    unfuse_all(eager)
    if hasattr(eager, "set_attn_implementation"):  # Hugging Face: the eager softmax, taped
        eager.set_attn_implementation("eager")
    return eager


def outputs(kind: str, eager: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's outputs, or the embedding the adapter scores (Hugging Face: the mean of the last tokens)."""
    if kind == "hf_sam2":
        return eager(pixel_values=x).last_hidden_state.mean(dim=(1, 2))
    if kind == "sam3":
        return eager(pixel_values=x).last_hidden_state.mean(dim=1)
    return eager(x)


# -- window slots by the models' own partition code on token indices (-1: padding) ---------------------------------
def _padded_index(grid, ws) -> torch.Tensor:
    """(1, H_p, W_p, 1) token index + 1 of the grid, zero-padded at the bottom / right to a multiple of ws."""
    idx = (torch.arange(grid[0] * grid[1]) + 1).view(1, *grid, 1).double()
    return F.pad(idx, (0, 0, 0, (-grid[1]) % ws, 0, (-grid[0]) % ws))


def _slots(windows: torch.Tensor) -> torch.Tensor:
    return windows.reshape(windows.shape[0], -1).round().long() - 1


def hieradet_slots(grid, ws) -> torch.Tensor:  # the block pads, then timm's window_partition
    return _slots(hieradet.window_partition(_padded_index(grid, ws), (ws, ws)))


def hf_sam2_slots(grid, ws) -> torch.Tensor:  # Hugging Face's window_partition pads itself
    from transformers.models.sam2.modeling_sam2 import window_partition
    return _slots(window_partition((torch.arange(grid[0] * grid[1]) + 1).view(1, *grid, 1).double(), ws)[0])


def sam3_slots(grid, ws) -> torch.Tensor:
    from transformers.models.sam3.modeling_sam3 import window_partition
    return _slots(window_partition((torch.arange(grid[0] * grid[1]) + 1).view(1, *grid, 1).double(), ws)[0])


def tinyvit_slots(grid, ws) -> torch.Tensor:  # TinyVitBlock's pad, view and transpose
    idx = _padded_index(grid, ws)
    nh, nw = idx.shape[1] // ws, idx.shape[2] // ws
    return _slots(idx.view(1, nh, ws, nw, ws, 1).transpose(2, 3).reshape(nh * nw, ws * ws))


def _norm_c(norm: nn.Module, pooled: torch.Tensor) -> torch.Tensor:
    """A channel norm (LayerNorm, LayerNorm2d) of (B, C) pooled features, written out."""
    return F.layer_norm(pooled, pooled.shape[-1:], norm.weight, norm.bias, norm.eps)


def plan(kind: str, m: nn.Module) -> tuple[list[Layer], Callable, tuple[int, int]]:
    """(the last stage's calls, head(eager, tokens) -> outputs, the last grid)."""
    if kind.startswith("hieradet") or kind == "hf_sam2":
        # the blocks after the last pooling block on the last grid, from the widening one (softmax i = block i)
        chosen = {"hieradet_qpool1": (3, 4)}.get(kind, (4, 5))
        grid = (8, 8) if kind == "hieradet_qpool1" else (4, 4)
        n = grid[0] * grid[1]
        layers = []
        for i in chosen:
            block = m.blocks[i]
            ws = block.window_size[0] if kind != "hf_sam2" else block.window_size
            heads = block.attn.num_heads if kind != "hf_sam2" else block.attn.num_attention_heads
            slots = (hf_sam2_slots if kind == "hf_sam2" else hieradet_slots)
            place = _windowed(slots(grid, ws), n, heads) if ws else _global(_eye(n))
            # Hugging Face's attention computes a softmax it never uses before the real one: softmax 2i + 1
            layers.append(Layer(2 * i + 1 if kind == "hf_sam2" else i, f"blocks.{i}", place))
        if kind == "hf_sam2":
            return layers, lambda e, t: t.mean(dim=(1, 2)), grid

        def head(e, t):  # ClNormMlpClassifierHead: the mean over the grid, its LayerNorm, the linear layer (if any)
            assert isinstance(e.head.pre_logits, nn.Identity)
            return e.head.fc(_norm_c(e.head.norm, t.mean(dim=(1, 2))))
        return layers, head, grid
    if kind == "sam3":
        grid, n = (8, 8), 64
        layers = [Layer(i, f"layers.{i}", _windowed(sam3_slots(grid, layer.window_size), n, 2) if layer.window_size
                        else _global(_eye(n))) for i, layer in enumerate(m.layers)]
        return layers, lambda e, t: t.mean(dim=(1, 2)), grid
    if kind == "caformer":  # softmaxes 0, 1: stage 2's blocks; 2, 3: the last stage's
        layers = [Layer(2 + b, f"stages.3.blocks.{b}", _global(_eye(16))) for b in range(2)]

        def head(e, t):  # (B, N, C): the mean, the head's channel norm, MlpHead (fc1, act, norm, fc2)
            mlp = e.head.fc
            return mlp.fc2(mlp.norm(mlp.act(mlp.fc1(_norm_c(e.head.norm, t.mean(dim=1))))))
        return layers, head, (4, 4)
    if kind == "tinyvit":  # softmaxes 0, 1: stage 1; 2: stage 2; 3, 4: the last stage's blocks
        layers = [Layer(3 + b, f"stages.3.blocks.{b}", _windowed(tinyvit_slots((4, 4), 3), 16, 4)) for b in range(2)]

        def head(e, t):  # (B, H, W, C): NormMlpClassifierHead: the mean, its LayerNorm2d, the linear layer
            assert isinstance(e.head.pre_logits, nn.Identity)
            return e.head.fc(_norm_c(e.head.norm, t.mean(dim=(1, 2))))
        return layers, head, (4, 4)
    raise KeyError(kind)


def legrad_oracle(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, H, W) LeGrad over the last grid, min-max per image."""
    eager = eager_copy(model)
    layers, head, grid = plan(kind, eager)
    seen: dict[str, torch.Tensor] = {}
    hooks = [eager.get_submodule(layer.module).register_forward_hook(
        lambda mod, inp, out, name=layer.module: seen.__setitem__(name, out)) for layer in layers]
    tape = SoftmaxTape()
    try:
        with tape:
            outputs(kind, eager, x.double())
    finally:
        for h in hooks:
            h.remove()
    total = 0.0
    for layer in layers:
        score = head(eager, seen[layer.module])[:, TARGET].sum()
        (g,) = torch.autograd.grad(score, tape.outputs[layer.softmax], retain_graph=True)
        total = total + layer.place(torch.relu(g.double()), x.shape[0])  # HF eager softmax: float32 (dtype=)
    m = total / len(layers)
    low, high = m.amin(1, keepdim=True), m.amax(1, keepdim=True)
    return ((m - low) / (high - low)).view(-1, *grid)


#: kind -> (the last block, its token site, fn(per-token values as the site lays them out) -> (B, H, W))
SITES = {
    "hieradet": ("blocks.5", "blocks.5.norm1", lambda v: v),
    "hieradet_headless": ("blocks.5", "blocks.5.norm1", lambda v: v),
    "hf_sam2": ("blocks.5", "blocks.5.layer_norm1", lambda v: v),
    "sam3": ("layers.3", "layers.3.layer_norm1", lambda v: v),
    "caformer": ("stages.3.blocks.1", "stages.3.blocks.1.norm1", lambda v: v.view(-1, 4, 4)),
    # (B * 4 windows, 9 slots): TinyViT's window reverse, then its crop of the padding
    "tinyvit": ("stages.3.blocks.1", "stages.3.blocks.1.attn.norm",
                lambda v: v.view(-1, 2, 2, 3, 3).transpose(2, 3).reshape(-1, 6, 6)[:, :4, :4]),
}


def _site_run(kind, eager, x, *, replace_site=None, block_input=None):
    """A full eager forward with T (the site's output, or ``replace_site``) as a leaf, the last block's input
    replaced by ``block_input`` if given. Returns (outputs, leaf T)."""
    block, site, _ = SITES[kind]
    seen = []

    def at_site(mod, inp, out):
        leaf = (out if replace_site is None else replace_site).detach().requires_grad_(True)
        seen.append(leaf)
        return leaf

    handles = [eager.get_submodule(site).register_forward_hook(at_site)]
    if block_input is not None:
        handles.append(eager.get_submodule(block).register_forward_pre_hook(lambda mod, args: (block_input, *args[1:])))
    try:
        out = outputs(kind, eager, x)
    finally:
        for h in handles:
            h.remove()
    return out, seen[-1]


def integrated_oracle(kind, model, x, steps):
    eager = eager_copy(model)
    x = x.double()
    t0 = _site_run(kind, eager, x)[1].detach()
    total = torch.zeros_like(t0)
    for k in range(steps):
        out, leaf = _site_run(kind, eager, x, replace_site=(k + 0.5) / steps * t0)
        total += torch.autograd.grad(out[:, TARGET].sum(), leaf)[0]
    return SITES[kind][2]((t0 * total / steps).sum(dim=-1))


def smooth_oracle(kind, model, x, samples, noise, seed):
    eager = eager_copy(model)
    seen = []
    h = eager.get_submodule(SITES[kind][0]).register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        outputs(kind, eager, x.double())
    finally:
        h.remove()
    inp = seen[0].detach()
    flat = inp.flatten(1)
    sigma = (noise * (flat.amax(1) - flat.amin(1))).view(-1, *([1] * (inp.dim() - 1)))
    eps = torch.randn(samples, *inp.shape[1:], generator=torch.Generator().manual_seed(seed)).double()  # float32 draws
    total = 0.0
    for s in range(samples):
        out, leaf = _site_run(kind, eager, x.double(), block_input=inp + sigma * eps[s])
        (g,) = torch.autograd.grad(out[:, TARGET].sum(), leaf)
        total = total + (leaf.detach() * g).sum(dim=-1)
    return SITES[kind][2](total / samples)


#: float32 against the float64 oracle, relative to the map's largest value: measured at most 9.6e-7 for legrad, 2.4e-6
#: for integrated CDAM (SAM 3, whose rotary angles stay float32 in a float64 copy), 1.8e-6 for smooth CDAM, a batch
#: against its images one by one at most 1.3e-6 (CAFormer), over images of seeds 1 and 5 with one and two torch
#: threads; 1e-5 is about four times the largest
TOLERANCE = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, label: object, tolerance: float = TOLERANCE) -> float:
    scale = float(want.abs().max())
    error = float((got.double() - want).abs().max())
    assert scale > 0 and error <= tolerance * scale, (label, error, scale)
    return error / scale


@pytest.mark.parametrize("kind", list(KINDS))
def test_legrad_matches_the_dense_float64_oracle(kind):
    model = build(kind)
    x = images(kind)
    want = legrad_oracle(kind, model, x)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and {"legrad", "cdam_smooth", "cdam_integrated"} <= set(ex.methods())
    e = ex.explain(x, method="legrad", target=target(kind))
    _close(e.maps, want, kind)
    assert e.maps.shape[0] == x.shape[0] and tuple(e.maps.shape[1:]) == e.layout.grid
    one = ex.explain(x[1:], method="legrad", target=target(kind)).maps  # a batch equals its images one by one
    assert float((one[0] - e.maps[1]).abs().max()) <= TOLERANCE, kind


@pytest.mark.parametrize("kind", list(SITES))
def test_integrated_cdam_matches_its_definition_on_the_whole_model(kind):
    model = build(kind)
    x = images(kind)
    want = integrated_oracle(kind, model, x, steps=4)
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam_integrated", target=target(kind), steps=4, batch_size=3)  # rows split in chunks
    _close(e.maps, want, kind)
    assert tuple(e.maps.shape[1:]) == e.layout.grid
    one = ex.explain(x[1:], method="cdam_integrated", target=target(kind), steps=4).maps
    assert float((one[0] - e.maps[1]).abs().max()) <= TOLERANCE * float(e.maps.abs().max())


@pytest.mark.parametrize("kind", list(SITES))
def test_smooth_cdam_matches_its_definition_on_the_whole_model(kind):
    model = build(kind)
    x = images(kind)
    want = smooth_oracle(kind, model, x, samples=3, noise=0.1, seed=7)
    e = vx.Explainer(model).explain(x, method="cdam_smooth", target=target(kind), samples=3, noise=0.1, seed=7)
    _close(e.maps, want, kind)


def test_a_hieradet_whose_last_stage_only_pools_is_refused():
    """Three stages of one block, two poolings: the last stage's only block reads the grid before (its keys), so no
    block attends on the grid the head reads: legrad and the re-run CDAM variants are not offered, with why."""
    torch.manual_seed(0)
    model = _reinit(_hieradet(stages=(1, 1, 1), window_spec=(4, 2, 2), global_att_blocks=(2,)))
    ex = vx.Explainer(model)
    assert "legrad" not in ex.methods() and "cdam_integrated" not in ex.methods()
    with pytest.raises(vx.UnsupportedMethodError, match="pools the grid before"):
        ex.explain(images("hieradet", n=1), method="legrad", target=TARGET)


def test_a_caformer_whose_last_stages_are_convs_is_refused():
    """Attention first, separable convs last: no last-stage block attends, and the refusal says so."""
    torch.manual_seed(0)
    model = _reinit(MetaFormer(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64), token_mixers=[SepConv, Attention, SepConv, SepConv],
                               norm_layers=[LayerNorm2dNoBias, LayerNormNoBias, LayerNorm2dNoBias, LayerNorm2dNoBias],
                               num_classes=CLASSES))
    ex = vx.Explainer(model)
    assert ex.family == "hier" and "legrad" not in ex.methods() and "cdam_smooth" not in ex.methods()
    with pytest.raises(vx.UnsupportedMethodError, match="separable convs, no attention"):
        ex.explain(torch.randn(1, 3, 64, 64), method="legrad", target=TARGET)
