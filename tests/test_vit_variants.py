"""Plain ViT variants as users build them (random init, tiny): what the plan lists runs, what it refuses says why.

Found by a sweep of timm / torchvision / Hugging Face / OpenCLIP ViT variants (random init) through every method
the plan lists, against a hand-written rollout / raw-attention oracle from each model's eager probabilities.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from vitexplain.errors import UnsupportedMethodError

from support_table import CHEAP, reinit_heads

TOKEN_METHODS = ("cdam", "gradcam", "cdam_smooth", "cdam_integrated")


def _res_post_vit():
    from timm.models.vision_transformer import ResPostBlock, VisionTransformer

    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                             block_fn=ResPostBlock)


def _res_post_relpos():
    from timm.models.vision_transformer_relpos import ResPostRelPosBlock, VisionTransformerRelPos

    return VisionTransformerRelPos(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                                   block_fn=ResPostRelPosBlock)


def _eva_post_norm():
    from timm.models.eva import Eva

    return Eva(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, use_post_norm=True)


@pytest.mark.parametrize("build", [_res_post_vit, _res_post_relpos, _eva_post_norm], ids=["vit", "relpos", "eva"])
def test_res_post_norm_blocks_refuse_the_token_methods_and_run_the_rest(build):
    # x + norm1(attn(x)): norm1's output is not the tokens entering the attention (CDAM's T) and its input is
    # not the residual stream (the tail's input); the plan listed cdam and gradcam (maps of the wrong tensor,
    # constant on the timm ViT) and cdam_smooth / cdam_integrated, which then refused
    torch.manual_seed(0)
    model = build()
    reinit_heads(model)
    model.eval()
    ex = vx.Explainer(model)
    listed = ex.methods()
    assert not set(TOKEN_METHODS) & set(listed), listed
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with pytest.raises(UnsupportedMethodError, match=r"norm1\(attn\(x\)\)"):
        ex.explain(x, method="cdam")
    for method in ("rollout", "generic", "legrad"):
        assert method in listed
        maps = ex.explain(x, method=method, **CHEAP.get(method, {})).maps
        assert maps.shape == (2, 4, 4) and bool(torch.isfinite(maps).all())


def test_differential_attention_refuses_the_attention_methods_and_runs_the_gradient_ones():
    # timm attn_layer='diff' applies softmax(q1 k1^T) - lambda softmax(q2 k2^T) through two SDPA calls per block;
    # the plan listed raw / rollout / generic / LeGrad / LRP, and they read the block's last call (the subtracted
    # softmax) as if it were the attention applied to the values
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              attn_layer="diff").eval()
    ex = vx.Explainer(model)
    listed = ex.methods()
    assert not {"raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "legrad", "attnlrp", "cp_lrp"} & set(listed)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with pytest.raises(UnsupportedMethodError, match="differential attention"):
        ex.explain(x, method="rollout")
    for method in ("cdam", "cdam_integrated"):
        assert method in listed
        maps = ex.explain(x, method=method, **CHEAP.get(method, {})).maps
        assert maps.shape == (2, 4, 4) and bool(torch.isfinite(maps).all()) and float(maps.std()) > 0


class _TwoCalls(torch.nn.Module):
    """A block attention run twice, on the tokens and on them reversed, averaged: two attention calls per block."""

    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return 0.5 * (self.attn(x, **kwargs) + self.attn(x.flip(1), **kwargs).flip(1))


def test_a_block_with_two_attention_calls_refuses_the_per_block_attention_methods():
    # no model-specific rule knows such a block: the per-block methods read the block's last call as "the"
    # attention (the reversed pass here) and returned maps without a word
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()
    for block in model.blocks:
        block.attn = _TwoCalls(block.attn)
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for method in ("raw", "rollout", "generic", "legrad"):
        with pytest.raises(UnsupportedMethodError, match="issued 2 self-attention calls in one forward"):
            ex.explain(x, method=method, **CHEAP.get(method, {}))
    maps = ex.explain(x, method="gradcam").maps
    assert maps.shape == (2, 4, 4) and bool(torch.isfinite(maps).all())


@pytest.mark.parametrize("name", ["vit", "eva"])
def test_an_unpooled_timm_vit_refuses_the_readout_row_methods(name):
    # global_pool='' with num_classes=0 (timm's idiom for dense features) returns every token; the plan listed raw,
    # rollout, generic, ... and they read the class-token row, explaining a score of all tokens as the class token's
    import timm

    torch.manual_seed(0)
    size, kwargs = {"vit": (32, dict(patch_size=8)), "eva": (28, dict(patch_size=14))}[name]
    model = timm.create_model({"vit": "vit_tiny_patch16_224", "eva": "eva02_tiny_patch14_224"}[name], pretrained=False,
                              img_size=size, embed_dim=32, depth=2, num_heads=2, num_classes=0, global_pool="",
                              **kwargs).eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert model(x).dim() == 3  # every token comes out: nothing is pooled
    ex = vx.Explainer(model)
    listed = ex.methods()
    assert not {"raw", "rollout", "grad_rollout", "generic", "attn_gradcam"} & set(listed), listed
    with pytest.raises(UnsupportedMethodError, match="global_pool=''"):
        ex.explain(x, method="rollout", target=vx.targets.norm())
    maps = ex.explain(x, method="cdam", target=vx.targets.norm()).maps
    grid = size // kwargs["patch_size"]
    assert maps.shape == (2, grid, grid) and bool(torch.isfinite(maps).all()) and float(maps.std()) > 0


# -- rollout and raw against the model's own eager attention -------------------------------------------------------
_TINY = dict(embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _timm(name, **kwargs):
    def build():
        import timm

        model = timm.create_model(name, pretrained=False, **{**_TINY, **kwargs})
        with torch.no_grad():  # relative position bias tables start at zero: give them values that matter
            for pname, p in model.named_parameters():
                if "relative_position_bias_table" in pname:
                    p.normal_(0, 1.0)
        return model

    return build


def _hf_beit():
    import transformers

    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     image_size=32, patch_size=8, num_labels=5, use_relative_position_bias=True,
                                     use_mean_pooling=False)
    model = transformers.BeitForImageClassification(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "relative_position_bias_table" in pname:
                p.normal_(0, 1.0)
    return model


# name: build, input size, readout row ("class": the class token, "mean": the patches' mean)
ORACLE_CASES = {
    "vit no_embed_class + registers": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, no_embed_class=True,
                                              reg_tokens=2), (32, 32), "class"),
    "vit dynamic size, registers, 40x56": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8,
                                                 dynamic_img_size=True, reg_tokens=2), (40, 56), "class"),
    "vit patch 14, pos_embed none": (_timm("vit_tiny_patch16_224", img_size=42, patch_size=14, pos_embed="none"),
                                     (42, 42), "class"),
    "deit3 (layer scale, no_embed_class)": (_timm("deit3_small_patch16_224", img_size=32, patch_size=8), (32, 32), "class"),
    "eva02 rope, dynamic size, class token": (_timm("eva02_tiny_patch14_224", img_size=28, patch_size=14,
                                                    dynamic_img_size=True, global_pool="token"), (42, 56), "class"),
    "beit relative position bias": (_timm("beit_base_patch16_224", img_size=32, patch_size=8, global_pool="token"),
                                    (32, 32), "class"),
    "beit shared relative position bias, mean": (_timm("beit_base_patch16_224", img_size=32, patch_size=8,
                                                       use_rel_pos_bias=False, use_shared_rel_pos_bias=True),
                                                 (32, 32), "mean"),
    "vit_srelpos": (_timm("vit_srelpos_small_patch16_224", img_size=32, patch_size=8), (32, 32), "mean"),
    "vitamin (conv stem)": (lambda: __import__("timm").create_model("vitamin_small_224", pretrained=False, img_size=64,
                                                                   num_classes=5), (64, 64), "mean"),
    "HF BEiT relative position bias": (_hf_beit, (32, 32), "class"),
    # NaFlexViT (SigLIP 2 NaFlex, RADIO) on image tensors: class and register tokens in its embedding, any size
    "naflexvit registers, mean, 40x56": (_timm("naflexvit_base_patch16_gap", patch_size=8), (40, 56), "mean"),
    "naflexvit class + registers (radio)": (_timm("naflexvit_base_patch16_radio_v3", patch_size=8), (48, 32), "class"),
    "naflexvit factorized position embedding": (_timm("naflexvit_base_patch16_parfac_gap", patch_size=8), (32, 32),
                                                "mean"),
}


def _eager_attention(model, x):
    """Every layer's (B, H, N, N) attention probabilities, from the model's own eager path."""
    if hasattr(model, "config"):  # Hugging Face
        old = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                return list(model(x, output_attentions=True).attentions)
        finally:
            model.set_attn_implementation(old)
    kept, hooks, flags = [], [], []
    for module in model.modules():
        if hasattr(module, "fused_attn") and hasattr(module, "attn_drop"):
            flags.append((module, module.fused_attn))
            module.fused_attn = False
            hooks.append(module.attn_drop.register_forward_hook(lambda m, a, out: kept.append(out.detach())))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
        for module, flag in flags:
            module.fused_attn = flag
    return kept


@pytest.mark.parametrize("name", list(ORACLE_CASES))
def test_rollout_and_raw_equal_the_rollout_of_the_models_eager_attention(name):
    build, size, readout = ORACLE_CASES[name]
    torch.manual_seed(0)
    model = build()
    reinit_heads(model)
    model.eval()
    x = torch.randn(3, 3, *size, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(model)
    rollout, raw = ex.explain(x, method=["rollout", "raw"])
    layout = rollout.layout
    attention = _eager_attention(model, x)
    n = attention[0].shape[-1]
    prefix = layout.num_prefix_tokens
    grid = ((size[0] + layout.patch_size[0] - 1) // layout.patch_size[0], (size[1] + layout.patch_size[1] - 1) // layout.patch_size[1])
    assert layout.grid == grid and n == prefix + grid[0] * grid[1] and layout.readout == readout
    v = torch.zeros(3, n)
    if readout == "class":
        v[:, 0] = 1.0
    else:
        v[:, prefix:] = 1.0 / (n - prefix)
    row = v
    for a in reversed(attention):  # docs/methods.md: rownorm(0.5 mean_h A + 0.5 I), readout row pushed through
        hat = 0.5 * a.mean(1) + 0.5 * torch.eye(n)
        row = torch.bmm(row.unsqueeze(1), hat / hat.sum(-1, keepdim=True)).squeeze(1)
    want_rollout = row[:, prefix:].reshape(3, *grid)
    want_raw = torch.bmm(v.unsqueeze(1), attention[-1].mean(1)).squeeze(1)[:, prefix:].reshape(3, *grid)
    # measured 1e-7 relative (float32 rounding); 1e-5 of the map's max
    torch.testing.assert_close(rollout.maps, want_rollout, atol=1e-5 * float(want_rollout.abs().max()), rtol=0)
    torch.testing.assert_close(raw.maps, want_raw, atol=1e-5 * float(want_raw.abs().max()), rtol=0)
    one = ex.explain(x[1:2], method="rollout").maps
    torch.testing.assert_close(one[0], rollout.maps[1], atol=1e-5 * float(rollout.maps[1].abs().max()), rtol=0)


def test_naflexvit_refuses_a_size_its_patch_does_not_divide_saying_which_sizes_it_takes():
    # the model's own reshape fails inside its embedding (a RuntimeError about a shape); the API gave it raw
    import timm

    torch.manual_seed(0)
    model = timm.create_model("naflexvit_base_patch16_gap", pretrained=False, patch_size=8, **_TINY).eval()
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 3, 30, 36))
    with pytest.raises(vx.InputError, match="patch size 8x8 must divide the input: .* e.g. 24x32"):
        vx.Explainer(model).explain(torch.randn(1, 3, 30, 36), method="rollout")
