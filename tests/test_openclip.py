"""OpenCLIP image towers and CLIP models (adapters/openclip.py) against an eager oracle written here.

The oracle runs the tower block by block with its attention computed explicitly from the
``nn.MultiheadAttention`` weights (its output checked equal to the tower's own), keeps every layer's
probabilities A and their gradients, and the tokens T entering the last attention; rollout, Chefer's
rule (readout row of R - I) and CDAM are then written from their definitions.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from peers import require

open_clip = require("open_clip", "pip install open_clip_torch ftfy")
from open_clip.transformer import VisionTransformer  # noqa: E402

GRID = (4, 5)  # 32 x 40 px, patch 8
VECTOR = torch.randn(16, generator=torch.Generator().manual_seed(3))


def _tower(pool_type: str = "tok") -> VisionTransformer:
    torch.manual_seed(0)
    tower = VisionTransformer(image_size=(32, 40), patch_size=8, width=32, layers=3, heads=2, mlp_ratio=2.0,
                              output_dim=16, pool_type=pool_type, ls_init_value=0.5)
    with torch.no_grad():  # sharper attention than a random init gives
        for block in tower.transformer.resblocks:
            block.attn.in_proj_weight[:64].mul_(3.0)
    return tower.eval()


def _eager(tower: VisionTransformer, x: torch.Tensor):
    """The tower's pooled embedding with explicit attention: (pooled, [A_l (B, H, N, N)], T (B, N, D))."""
    h = tower._embeds(x)
    attentions, tokens = [], None
    for block in tower.transformer.resblocks:
        t = block.ln_1(h)
        tokens = t
        mha = block.attn
        b, n, d = t.shape
        heads = mha.num_heads
        q, k, v = torch.nn.functional.linear(t, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (z.view(b, n, heads, d // heads).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // heads) ** 0.5, dim=-1)
        attentions.append(a)
        o = mha.out_proj((a @ v).transpose(1, 2).reshape(b, n, d))
        h = h + block.ls_1(o)
        h = h + block.ls_2(block.mlp(block.ln_2(h)))
    pooled, _ = tower._pool(h)
    return pooled @ tower.proj, attentions, tokens


@pytest.mark.parametrize("pool_type", ["tok", "avg"])
def test_openclip_tower_matches_the_eager_oracle(pool_type):
    tower = _tower(pool_type)
    x = torch.randn(2, 3, 32, 40, generator=torch.Generator().manual_seed(1))
    pooled, attentions, tokens = _eager(tower, x)
    for a in attentions:
        a.retain_grad()
    tokens.retain_grad()
    with torch.no_grad():
        torch.testing.assert_close(pooled, tower(x), atol=1e-5, rtol=1e-4)  # the oracle is the tower
    torch.cosine_similarity(pooled, VECTOR[None], dim=-1).sum().backward()
    ex = vx.Explainer(tower)
    layout = ex.adapter.layout((32, 40))
    assert (layout.num_prefix_tokens, layout.grid, layout.readout) == (1, GRID, "class" if pool_type == "tok" else "mean")
    names = ["rollout", "generic", "cdam"]
    results = {e.method: e for e in ex.explain(x, method=names, target=vx.targets.similarity(VECTOR))}
    n = 1 + GRID[0] * GRID[1]
    row = torch.zeros(n)
    if pool_type == "tok":
        row[0] = 1.0
    else:
        row[1:] = 1.0 / (n - 1)
    eye = torch.eye(n)
    for i in range(2):
        r = eye.clone()
        for a in attentions:
            m = 0.5 * a[i].detach().mean(0) + 0.5 * eye
            r = (m / m.sum(-1, keepdim=True)) @ r
        torch.testing.assert_close(results["rollout"].maps[i], (row @ r)[1:].view(GRID), atol=1e-6, rtol=1e-4)
        r = eye.clone()
        for a in attentions:
            r = r + (a.grad[i] * a[i].detach()).clamp(min=0).mean(0) @ r
        generic = (row @ (r - eye))[1:].view(GRID)
        assert float(generic.abs().max()) > 0
        torch.testing.assert_close(results["generic"].maps[i], generic, atol=1e-7, rtol=1e-4)
        cdam = (tokens[i].detach() * tokens.grad[i]).sum(-1)[1:].view(GRID)
        torch.testing.assert_close(results["cdam"].maps[i], cdam, atol=1e-7, rtol=1e-4)


def test_a_clip_model_is_explained_through_its_image_tower_and_pool_none_is_refused():
    torch.manual_seed(0)
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
                                                               head_width=16),
                                 text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1)).eval()
    ex = vx.Explainer(model)
    assert ex.adapter.blocks[0] == "visual.transformer.resblocks.0"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ex.adapter.forward(x), model.encode_image(x))
    alone = vx.Explainer(model.visual).explain(x, method="generic", target=vx.targets.norm()).maps
    torch.testing.assert_close(ex.explain(x, method="generic", target=vx.targets.norm()).maps, alone)
    with pytest.raises(vx.UnsupportedModelError, match="pool_type='none'"):
        vx.Explainer(_tower("none"))
    with pytest.raises(vx.InputError, match="32x40"):
        vx.Explainer(_tower()).explain(torch.randn(1, 3, 48, 48), method="rollout", target=vx.targets.norm())


def _coca():
    from open_clip.coca_model import CoCa, MultimodalCfg
    torch.manual_seed(0)
    text = dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1)
    model = CoCa(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16,
                                               attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=2,
                                               output_tokens=True),
                 text_cfg=text, multimodal_cfg=MultimodalCfg(**text))
    return model.eval()


def test_coca_is_explained_through_its_normalised_image_latent():
    """CoCa's encode_image returns the image latent normalised to unit length (normalize=True by default, unlike
    CLIP's); the adapter's head left it unnormalised, so its partial forwards did not reproduce the model and
    cdam_smooth / cdam_integrated, listed as available, were refused at run time. A cosine similarity does not see
    the normalisation: every method's maps on CoCa equal those on its bare image tower."""
    model = _coca()
    ex = vx.Explainer(model)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ex.adapter.forward(x), model.encode_image(x))
        torch.testing.assert_close(ex.adapter.forward(x).norm(dim=-1), torch.ones(2))
    names = ex.methods()
    assert {"cdam", "cdam_smooth", "cdam_integrated"} <= set(names) and "rollout" not in names
    target = vx.targets.similarity(VECTOR)
    tower = vx.Explainer(model.visual)
    for ours, alone in zip(ex.explain(x, method=names, target=target), tower.explain(x, method=names, target=target)):
        assert ours.method == alone.method and float(alone.maps.abs().max()) > 0
        torch.testing.assert_close(ours.maps, alone.maps, rtol=1e-4, atol=1e-6 * float(alone.maps.abs().max()))


def test_clip_models_with_a_timm_or_resnet_tower_are_refused_with_what_to_do():
    """OpenCLIP's TimmModel towers (SigLIP, EVA, ConvNeXt CLIPs: a timm trunk, then a head) and ModifiedResNet (RN50
    CLIPs) were refused with the generic 'does not know how to explain CLIP' although the message claims CLIP models;
    the refusal now names the tower, and its advice for a timm tower (explain the trunk, the head applied in the
    target) gives the CLIP embedding's CDAM, checked by autograd through encode_image."""
    torch.manual_seed(0)
    text = dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1)
    timm_clip = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(timm_model_name="vit_tiny_patch16_224", timm_pool="avg",
                                                                   timm_proj="linear", image_size=224),
                                     text_cfg=text).eval()
    resnet_clip = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(layers=(1, 1, 1, 1), width=16, head_width=16,
                                                                     image_size=64), text_cfg=text).eval()
    for model in (timm_clip, timm_clip.visual):
        with pytest.raises(vx.UnsupportedModelError, match=r"TimmModel.*vx.Explainer\(model(\.visual)?\.trunk\)"):
            vx.Explainer(model)
    for model in (resnet_clip, resnet_clip.visual):
        with pytest.raises(vx.UnsupportedModelError, match="ModifiedResNet.*register_adapter"):
            vx.Explainer(model)
    for model in (timm_clip, timm_clip.visual):  # the trunk's token layout stays findable (vx.capture reads it)
        assert vx.token_layout(model, (224, 224)).grid == (14, 14)
    # the advice: the trunk explained with the head in the target scores the CLIP embedding
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    visual = timm_clip.visual
    score = vx.targets.similarity(VECTOR)
    maps = vx.Explainer(visual.trunk).explain(x, method="cdam", target=lambda f: score(visual.head(f))).maps
    kept = []
    handle = visual.trunk.blocks[-1].norm1.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    try:
        score(timm_clip.encode_image(x)).sum().backward()
    finally:
        handle.remove()
    expected = (kept[0] * kept[0].grad).sum(-1)[:, 1:].reshape(2, 14, 14).detach()
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(maps, expected, rtol=1e-4, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("kind", ["parallel", "cascade"])
def test_a_tower_with_two_attention_poolers_is_refused_for_what_it_is(kind):
    """attentional_pool='parallel' / 'cascade' set pool_type='none' inside open_clip, but the tower does pool (the
    refusal said it returned every token): the refusal names the pooling."""
    tower = VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_ratio=2.0, output_dim=16,
                              attentional_pool=kind, attn_pooler_queries=4, attn_pooler_heads=2).eval()
    with pytest.raises(vx.UnsupportedModelError, match=f"attentional_pool='{kind}' .* attentional_pool=True"):
        vx.Explainer(tower)
