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
