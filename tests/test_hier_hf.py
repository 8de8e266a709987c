"""Hugging Face hierarchical models (PVTv2, SegFormer, SAM's vision encoder): the footprint rule
against dense float64 oracles built here from an eager float64 copy's softmax outputs (taped),
average-pooling footprints and SAM's own window partition applied to token indices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import DenseCall, adaptive_matrix, assert_matches_oracle, carry, pool_matrix, scatter_windows, taped_attention

transformers = pytest.importorskip("transformers")

SIZE = (64, 64)
_SR = dict(image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 2, 1, 1], num_attention_heads=[1, 2, 2, 4])


def build(kind: str, eager: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if kind == "pvt":
        model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**_SR, num_labels=5))
    elif kind == "pvt_linear":
        model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**_SR, num_labels=5, linear_attention=True))
    elif kind == "segformer":
        model = transformers.SegformerForImageClassification(
            transformers.SegformerConfig(**_SR, decoder_hidden_size=32, num_labels=5))
    else:
        config = transformers.SamVisionConfig(
            image_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, global_attn_indexes=[1],
            window_size=3, output_channels=16, mlp_dim=64)
        if eager:  # SAM picks its attention class when built
            config._attn_implementation = "eager"
        model = transformers.SamVisionModel(config)
        with torch.no_grad():  # random-init SAM's relevance is ~1e-14 of the readout, below what a float64
            for p in model.parameters():  # oracle of u R - u R_id resolves: give every weight matrix unit-ish gain
                if p.dim() >= 2:
                    p.normal_(0, 1.0 / p[0].numel() ** 0.5)
    return model.eval()


VECTOR = torch.randn(16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _sam_score(model, x):
    hidden = model(pixel_values=x).last_hidden_state
    return hidden.mean(dim=(2, 3)) @ VECTOR.to(hidden.dtype)


def _logit(model, x):
    return model(pixel_values=x).logits[:, 1]


def _out(grid, conv):
    k, s, p = conv.kernel_size, conv.stride, conv.padding
    return tuple((grid[i] + 2 * p[i] - k[i]) // s[i] + 1 for i in range(2))


def dense_chain(kind, model, x):
    source = model
    if kind == "sam":  # an eager build with the same weights
        source = build("sam", eager=True)
        source.load_state_dict(model.state_dict())
    taped = iter(taped_attention(source, x, _sam_score if kind == "sam" else _logit))
    b, items = x.shape[0], []
    if kind == "sam":
        from transformers.models.sam.modeling_sam import SamVisionLayer

        grid = (SIZE[0] // 16, SIZE[1] // 16)
        n = grid[0] * grid[1]
        for layer in model.vision_encoder.layers:
            a, g = next(taped)
            if layer.window_size > 0:  # the layer's own partition of token indices (+1: padding is 0)
                idx, _ = SamVisionLayer.window_partition(layer, (torch.arange(n) + 1).view(1, *grid, 1).double(),
                                                         layer.window_size)
                idx = idx.reshape(idx.shape[0], -1).long() - 1
                a = a.reshape(b, idx.shape[0], -1, *a.shape[-2:])  # (B * nW * heads, n, n) as SAM makes it
                g = g.reshape(b, idx.shape[0], -1, *g.shape[-2:])
                a, g = scatter_windows(a, idx, idx, n, n), scatter_windows(g, idx, idx, n, n)
            else:
                a, g = a.reshape(b, -1, n, n).double(), g.reshape(b, -1, n, n).double()
            items.append(DenseCall(a, g, torch.eye(n, dtype=torch.float64), torch.eye(n, dtype=torch.float64)))
        items.append(pool_matrix(grid, 3, 1, 1))  # the neck's 3 x 3 conv
        return items, grid
    stages = model.pvt_v2.encoder.layers if kind.startswith("pvt") else model.segformer.stages
    grid = SIZE
    for s, stage in enumerate(stages):
        conv = (stage.patch_embedding if kind.startswith("pvt") else stage.patch_embeddings).proj
        new = _out(grid, conv)
        if s > 0:
            items.append(pool_matrix(grid, conv.kernel_size, conv.stride, conv.padding))
        grid = new
        n = grid[0] * grid[1]
        for block in stage.blocks:
            a, g = next(taped)
            attn = block.attention
            if kind == "pvt_linear":
                keys = adaptive_matrix(grid, (7, 7))
            else:
                sr = getattr(attn, "spatial_reduction", None) if kind == "pvt" else getattr(getattr(attn, "sequence_reduction", None), "sequence_reduction", None)
                keys = pool_matrix(grid, sr.kernel_size, sr.stride, sr.padding) if isinstance(sr, nn.Conv2d) \
                    else torch.eye(n, dtype=torch.float64)
            # (Hugging Face's eager softmax runs in float32 even in a float64 model)
            items.append(DenseCall(a.double(), g.double(), keys, torch.eye(n, dtype=torch.float64)))
    return items, grid


@pytest.mark.parametrize("kind", ["pvt", "pvt_linear", "segformer", "sam"])
def test_hugging_face_hierarchical_models_match_the_dense_float64_oracle(kind):
    model = build(kind)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, last = dense_chain(kind, model, x)
    ex = vx.Explainer(model)
    assert ex.family == "hier"
    target = (lambda pooled: pooled @ VECTOR.float()) if kind == "sam" else 1  # headless: a score of the embedding
    n_last = last[0] * last[1]
    u = torch.full((2, n_last), 1.0 / n_last, dtype=torch.float64)
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=target)):
        want = carry(items, u, method).view(e.maps.shape)
        assert tuple(e.maps.shape[1:]) == e.layout.grid, method
        assert_matches_oracle(e.maps, want, method)


@pytest.mark.parametrize("name", ["HF PvtV2 classifier", "HF Sam2HieraDetModel (SAM 2's image encoder backbone, headless)"])
def test_a_config_with_return_dict_false_is_explained_like_the_default(name):
    """config.return_dict=False makes the model return tuples; the hierarchical adapters read attributes of them
    and crashed with an AttributeError. They ask for a ModelOutput, so the maps equal the default's."""
    import support_table

    row = next(r for r in support_table.rows() if r.name == name)
    torch.manual_seed(0)
    model = row.build().eval()
    target = vx.targets.norm() if row.target == "norm" else 1
    x = torch.rand(2, 3, *row.size, generator=torch.Generator().manual_seed(4))
    want = vx.Explainer(model).explain(x, method="rollout", target=target).maps
    model.config.return_dict = False
    assert isinstance(model(pixel_values=x), tuple)
    torch.testing.assert_close(vx.Explainer(model).explain(x, method="rollout", target=target).maps, want)


@pytest.mark.parametrize("kind", ["SamModel", "SamHQModel"])
def test_sams_image_encoder_inside_the_full_model_is_explained_and_the_full_model_points_at_it(kind):
    """A SAM (or SAM-HQ) checkpoint loads as the full model; its image encoder, ``model.vision_encoder``
    (SamVisionEncoder / SamHQVisionEncoder), is SAM's ViT and is explained as SamVisionModel is (checked
    against the dense oracle above): with the same weights the maps are equal, also for SamHQVisionModel.
    The full model outputs masks decoded from prompts and is refused, naming the encoder to explain."""
    vision = build("sam")
    kwargs = {k: getattr(vision.config, k) for k in ("image_size", "hidden_size", "num_hidden_layers",
                                                      "num_attention_heads", "global_attn_indexes", "window_size",
                                                      "output_channels", "mlp_dim")}
    config = getattr(transformers, kind.replace("Model", "Config"))(vision_config=kwargs)
    full = getattr(transformers, kind)(config).eval()
    full.vision_encoder.load_state_dict(vision.vision_encoder.state_dict())
    with pytest.raises(vx.UnsupportedModelError, match=rf"{kind} is not supported.*vx\.Explainer\(model\.vision_encoder\)"):
        vx.Explainer(full)
    encoders = [full.vision_encoder]
    if kind == "SamHQModel":
        hq = transformers.SamHQVisionModel(transformers.SamHQVisionConfig(**kwargs)).eval()
        hq.vision_encoder.load_state_dict(vision.vision_encoder.state_dict())
        encoders.append(hq)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    target = lambda pooled: pooled @ VECTOR.float()  # noqa: E731
    for method in ("rollout", "generic", "cdam"):
        want = vx.Explainer(vision).explain(x, method=method, target=target).maps
        for encoder in encoders:
            ex = vx.Explainer(encoder)
            assert ex.family == "hier"
            torch.testing.assert_close(ex.explain(x, method=method, target=target).maps, want)
