"""Smooth and integrated CDAM for hierarchical transformers (re-run of the last stage's last block and the head)
against their definitions computed here on an eager float64 copy of the whole model: T is the output of the
last stage's token site (the tokens entering the last attention), replaced in a full forward by a forward hook
(integrated: alpha_k T on the midpoint path, the block input as it is), or the last block's input replaced by a
forward pre-hook (smooth: the same standard-normal draws, seeded as the method documents, scaled by the input's
range); dy/dT by plain autograd; per token sum_d T_d dy/dT_d placed on the grid by the model's own layout."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import unfuse_all
from test_hier_legrad import TARGET, _target, build, eager_copy, images

#: kind -> (block re-run, token site, fn(per-token values as the site lays them out, summed over channels) -> grid)
CASES = {
    "pvt": ("stages.3.blocks.1", "stages.3.blocks.1.norm1", lambda v, m: v.view(-1, 4, 4)),
    "twins": ("blocks.3.1", "blocks.3.1.norm1", lambda v, m: v.view(-1, 4, 4)),
    "sam": ("blocks.2", "blocks.2.norm1", lambda v, m: v),
    "pit": ("transformers.2.blocks.1", "transformers.2.blocks.1.norm1", lambda v, m: v[:, 1:].reshape(-1, 4, 4)),
    "pit_distilled": ("transformers.2.blocks.1", "transformers.2.blocks.1.norm1", lambda v, m: v[:, 2:].reshape(-1, 4, 4)),
    "maxvit": ("stages.3.blocks.1.attn_grid", "stages.3.blocks.1.attn_grid.norm1", lambda v, m: v),  # channels-last
    "coatnet": ("stages.3.blocks.1", "stages.3.blocks.1.norm1", lambda v, m: v),  # (B, C, H, W): summed over dim 1
    # torchvision: T is (B, windows, slots, C) after its partition and axis swap, put back by its own departition
    "tv_maxvit": ("blocks.1.layers.1.layers.grid_attention", "blocks.1.layers.1.layers.grid_attention.attn_layer.0",
                  lambda v, m: _tv_grid(m.blocks[1].layers[1].layers.grid_attention, v)),
    "mvit": ("stages.3.blocks.1", "stages.3.blocks.1.norm1", lambda v, m: v.view(-1, 4, 4)),
    # Hiera's unrolled order, put on the grid by its own reroll of token indices
    "hf_pvt": ("pvt_v2.encoder.layers.3.blocks.1", "pvt_v2.encoder.layers.3.blocks.1.layer_norm_1",
               lambda v, m: v.view(-1, 4, 4)),
    "hf_segformer": ("segformer.stages.3.blocks.1", "segformer.stages.3.blocks.1.layernorm_before",
                     lambda v, m: v.view(-1, 4, 4)),
    "hf_hiera": ("hiera.encoder.stages.2.layers.2", "hiera.encoder.stages.2.layers.2.layernorm_before",
                 lambda v, m: v[:, m.hiera.encoder.reroll(torch.arange(16, dtype=torch.float64).view(1, 16, 1), 2)
                                [0, ..., 0].round().long().flatten()].view(-1, 4, 4)),
    "hf_pvt1": ("pvt.encoder.block.3.1", "pvt.encoder.block.3.1.layer_norm_1", lambda v, m: v[:, 1:].reshape(-1, 4, 4)),
    "hf_sam": ("vision_encoder.layers.2", "vision_encoder.layers.2.layer_norm1", lambda v, m: v),  # (B, H, W)
    "hiera_qpool2": ("blocks.5", "blocks.5.norm1", lambda v, m: v[:, m.reroll(
        torch.arange(16, dtype=torch.float64).view(1, 16, 1), 5)[0, ..., 0].round().long()]),
    # TNT: T is the last block's norm_out output; the smooth variant's noise goes on the outer tokens that enter it
    # (the block's second argument: the inner tokens' projection is added to them as they are), its standard
    # deviation from the range of norm_out's input
    "tnt": ("blocks.1.norm_out", "blocks.1.norm_out", lambda v, m: v[:, 1:].reshape(-1, 4, 4)),
    # LeViT (timm, linear and conv mode): T is the last block's input itself (the previous block's output), so the
    # integrated path scales the block input, its residual with it, and the smooth noise goes on T
    "levit": ("stages.2.blocks.1", "stages.2.blocks.0", lambda v, m: v.view(-1, 4, 4)),
    "levit_conv": ("stages.2.blocks.1", "stages.2.blocks.0", lambda v, m: v),  # (B, C, H, W): summed over dim 1
    # Hugging Face LeViT: the last attention residual layer and its MLP residual layer are re-run from T, its input
    "hf_levit": ("levit.encoder.stages.2.layers.2", "levit.encoder.stages.2.layers.1", lambda v, m: v.view(-1, 4, 4)),
    # Twins whose last stage is one block: its positional conv (PEG) runs after it, before the head
    "pcpvt": ("blocks.3.0", "blocks.3.0.norm1", lambda v, m: v.view(-1, 4, 4)),
}

#: kinds whose smooth variant perturbs a block's second argument (TNT's outer tokens) by the noise, not the input
OUTER_NOISE = {"tnt": "blocks.1"}
#: kinds whose T is the re-run block's input: the smooth oracle puts the noise on T (the site's output) itself
INPUT_IS_T = {"levit", "levit_conv", "hf_levit"}


def _tv_grid(layer: nn.Module, v: torch.Tensor) -> torch.Tensor:
    """(B, windows, slots) per-token values of a torchvision grid attention layer -> (B, H, W), by its departition."""
    gh, gw = layer.grid_size[0] // layer.p, layer.grid_size[1] // layer.p
    return layer.departition_op(layer.departition_swap(v[..., None]), layer.p, gh, gw)[:, 0]


def _per_token(t: torch.Tensor, g: torch.Tensor, kind: str) -> torch.Tensor:
    return (t * g).sum(dim=1 if kind in ("coatnet", "levit_conv") else -1)


def _site_run(eager, kind, x, *, replace_site=None, block_input=None):
    """A full eager forward; T (the site's output) as a leaf (or ``replace_site``), the block's input replaced by
    ``block_input`` if given. Returns (logits, leaf T)."""
    block, site, _ = CASES[kind]
    seen = []

    def at_site(mod, inp, out):
        leaf = (out if replace_site is None else replace_site).detach().requires_grad_(True)
        seen.append(leaf)
        return leaf

    def at_block(mod, args):
        return (block_input, *args[1:])

    def add_outer_noise(mod, args):  # block_input is then the noise itself
        return (args[0], args[1] + block_input, *args[2:])

    handles = [eager.get_submodule(site).register_forward_hook(at_site)]
    if block_input is not None and kind in OUTER_NOISE:
        handles.append(eager.get_submodule(OUTER_NOISE[kind]).register_forward_pre_hook(add_outer_noise))
    elif block_input is not None:
        handles.append(eager.get_submodule(block).register_forward_pre_hook(at_block))
    try:
        logits = eager(x)
        if kind == "hf_sam":  # headless: the mean of its neck's feature map, the embedding the adapter scores
            logits = logits.last_hidden_state.mean(dim=(2, 3))
        logits = getattr(logits, "logits", logits)  # Hugging Face outputs
    finally:
        for h in handles:
            h.remove()
    return logits, seen[-1]


def _eager(model):
    eager = copy.deepcopy(model).double().eval()
    unfuse_all(eager)
    if hasattr(eager, "set_attn_implementation"):
        eager.set_attn_implementation("eager")
    return eager


def integrated_oracle(kind, model, x, steps):
    eager = eager_copy(kind, model) if kind == "hf_sam" else _eager(model)
    x = x.double()
    t0 = _site_run(eager, kind, x)[1].detach()
    total = torch.zeros_like(t0)
    for k in range(steps):
        logits, leaf = _site_run(eager, kind, x, replace_site=(k + 0.5) / steps * t0)
        (g,) = torch.autograd.grad(logits[:, TARGET].sum(), leaf)
        total += g
    return CASES[kind][2](_per_token(t0, total / steps, kind), eager)


def smooth_oracle(kind, model, x, samples, noise, seed):
    eager = eager_copy(kind, model) if kind == "hf_sam" else _eager(model)
    block = CASES[kind][0]
    seen = []
    h = eager.get_submodule(block).register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    eager(x.double())
    h.remove()
    inp = seen[0].detach()
    flat = inp.flatten(1)
    sigma = (noise * (flat.amax(1) - flat.amin(1))).view(-1, *([1] * (inp.dim() - 1)))
    eps = torch.randn(samples, *inp.shape[1:], generator=torch.Generator().manual_seed(seed)).double()  # float32 draws
    total = 0.0
    for s in range(samples):
        if kind in INPUT_IS_T:
            logits, leaf = _site_run(eager, kind, x.double(), replace_site=inp + sigma * eps[s])
        else:
            noisy = sigma * eps[s] if kind in OUTER_NOISE else inp + sigma * eps[s]
            logits, leaf = _site_run(eager, kind, x.double(), block_input=noisy)
        (g,) = torch.autograd.grad(logits[:, TARGET].sum(), leaf)
        total = total + _per_token(leaf.detach(), g, kind)
    return CASES[kind][2](total / samples, eager)


def _close(got, want, label, rtol=1e-5):  # measured at most 1.8e-6 (Hugging Face SAM), float32 against float64
    scale = float(want.abs().max())
    error = float((got.double() - want).abs().max())
    assert scale > 0 and error <= rtol * scale, (label, error, scale)


@pytest.mark.parametrize("kind", list(CASES))
def test_integrated_cdam_matches_its_definition_on_the_whole_model(kind):
    model = build(kind)
    x = images(kind)
    want = integrated_oracle(kind, model, x, steps=4)
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam_integrated", target=_target(kind), steps=4, batch_size=3)  # 3: rows split across chunks
    _close(e.maps, want, kind)
    assert e.maps.shape[0] == x.shape[0] and tuple(e.maps.shape[1:]) == e.layout.grid
    one = ex.explain(x[1:], method="cdam_integrated", target=_target(kind), steps=4).maps
    assert float((one[0] - e.maps[1]).abs().max()) <= 1e-5 * float(e.maps.abs().max())


@pytest.mark.parametrize("kind", list(CASES))
def test_smooth_cdam_matches_its_definition_on_the_whole_model(kind):
    model = build(kind)
    x = images(kind)
    want = smooth_oracle(kind, model, x, samples=3, noise=0.1, seed=7)
    e = vx.Explainer(model).explain(x, method="cdam_smooth", target=_target(kind), samples=3, noise=0.1, seed=7)
    _close(e.maps, want, kind)


#: kind -> what its refusal must say (each family's own reason)
REFUSED = {
    "crossvit": "reads both branches",
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_models_whose_tokens_cannot_be_re_run_to_the_head_are_refused_with_their_own_reason(kind):
    ex = vx.Explainer(build(kind))
    assert "cdam_integrated" not in ex.methods() and "cdam_smooth" not in ex.methods()
    for method in ("cdam_smooth", "cdam_integrated"):
        with pytest.raises(vx.UnsupportedMethodError, match=REFUSED[kind]):
            ex.explain(images(kind, n=1), method=method)
