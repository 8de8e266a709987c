"""Hugging Face families beyond ViT: methods against oracles from the model's own eager attention.

For DINOv2 (with and without registers), BEiT (mean-pooling readout), DeiT with teacher and
the headless backbones (ViTModel, Dinov2Model, CLIPVisionModel, SiglipVisionModel, explained
with ``vx.targets.similarity`` / ``norm``; rollout and generic of the attention-pooling heads of
SigLIP and AIMv2 in tests/test_pool_readout.py), an eager copy of the model returns its attention
probabilities (``output_attentions=True``); their gradients and the tokens entering the last
attention are taken with plain autograd. Rollout, generic (readout row of ``R - I``) and CDAM
are then computed densely from their definitions and compared with the Explainer's maps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx
from hf_helpers import eager_oracle, sharpen_attention

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
GRID = (4, 4)


def _build(config_cls: str, model_cls: str, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**TINY, **kw})
    model = getattr(transformers, model_cls)(config).eval()
    sharpen_attention(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("classifier.weight", "cls_classifier.weight", "distillation_classifier.weight")):
                p.normal_(0, 1.0)  # random heads are near zero; make targets matter
    return model


VECTOR = torch.randn(32, generator=torch.Generator().manual_seed(7))


def _pooled(out):
    return getattr(out, "image_embeds", None) if getattr(out, "image_embeds", None) is not None else out.pooler_output


CASES = {
    # name: (build, prefix tokens, readout, target (None = predicted class), score of the eager outputs)
    "dinov2": (lambda: _build("Dinov2Config", "Dinov2ForImageClassification", num_labels=5), 1, "class", None, None),
    "dinov2_registers": (
        lambda: _build("Dinov2WithRegistersConfig", "Dinov2WithRegistersForImageClassification", num_labels=5, num_register_tokens=2),
        3, "class", None, None,
    ),
    "beit_mean": (lambda: _build("BeitConfig", "BeitForImageClassification", num_labels=5, use_mean_pooling=True), 1, "mean", None, None),
    "deit_teacher": (lambda: _build("DeiTConfig", "DeiTForImageClassificationWithTeacher", num_labels=5), 2, "prefix", None, None),
    "vit_msn": (lambda: _build("ViTMSNConfig", "ViTMSNForImageClassification", num_labels=5), 1, "class", None, None),
    "ijepa": (lambda: _build("IJepaConfig", "IJepaForImageClassification", num_labels=5), 0, "mean", None, None),
    "ijepa_headless": (
        lambda: _build("IJepaConfig", "IJepaModel"), 0, "mean", "similarity",
        lambda out: torch.cosine_similarity(out.last_hidden_state.mean(dim=1), VECTOR[None], dim=-1),
    ),
    "vit_headless": (lambda: _build("ViTConfig", "ViTModel"), 1, "class", "norm", lambda out: _pooled(out).norm(dim=-1)),
    "dinov2_headless": (
        lambda: _build("Dinov2Config", "Dinov2Model"), 1, "class", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
    "dinov3_registers_headless": (  # RoPE, 4 register tokens, final norm on the model and its layers in model.model
        lambda: _build("DINOv3ViTConfig", "DINOv3ViTModel", num_register_tokens=4), 5, "class", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
    "metaclip2_vision": (
        lambda: _build("MetaClip2VisionConfig", "MetaClip2VisionModel"), 1, "class", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
    "aimv2_vision": (  # no class token, an attention-pooling head: its query's row is the readout (as SigLIP's)
        lambda: _build("Aimv2VisionConfig", "Aimv2VisionModel"), 0, "pool", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
    "clip_vision": (
        lambda: _build("CLIPVisionConfig", "CLIPVisionModel"), 1, "class", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
    "siglip_vision": (
        lambda: _build("SiglipVisionConfig", "SiglipVisionModel"), 0, "pool", "similarity",
        lambda out: torch.cosine_similarity(_pooled(out), VECTOR[None], dim=-1),
    ),
}


def _target(kind):
    if kind == "similarity":
        return vx.targets.similarity(VECTOR)
    if kind == "norm":
        return vx.targets.norm()
    return None


@pytest.mark.parametrize("case", list(CASES))
def test_hf_family_matches_eager_oracle(case):
    build, prefix, readout, target_kind, score = CASES[case]
    model = build()
    ex = vx.Explainer(model)
    layout = ex.adapter.layout((32, 32))
    assert (layout.num_prefix_tokens, layout.readout, layout.grid) == (prefix, readout, GRID)
    assert ex.adapter.has_head == (target_kind is None)
    assert set(ex.methods()) >= {"raw", "rollout", "generic", "cdam", "cdam_smooth", "cdam_integrated", "legrad"}
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    names = ["rollout", "generic", "cdam", "grad_rollout", "cdam_integrated", "legrad"]
    results = {e.method: e for e in ex.explain(x, method=names, target=_target(target_kind))}
    n = prefix + 16
    v = torch.zeros(n)
    if readout == "class":
        v[0] = 1.0
    elif readout == "prefix":  # DeiT with teacher: the logits average the class and distillation heads
        v[:prefix] = 1.0 / prefix
    else:
        v[prefix:] = 1.0 / 16
    eye = torch.eye(n)
    for i in range(2):
        if score is None:
            target = int(results["generic"].targets[i])
            score_fn = lambda out, t=target: out.logits[:, t]  # noqa: E731
        else:
            score_fn = score
        attn, grads, (t, dt) = eager_oracle(model, x[i], score_fn, ex.adapter.norm1)
        torch.testing.assert_close(results["cdam"].maps[i], (t * dt).sum(-1)[prefix:].reshape(GRID), atol=1e-6, rtol=1e-4)
        if readout == "pool":  # the readout row is the pooling head's attention: tests/test_pool_readout.py
            continue
        r = eye.clone()
        for a in attn:
            m = 0.5 * a.mean(0) + 0.5 * eye
            r = (m / m.sum(-1, keepdim=True)) @ r
        torch.testing.assert_close(results["rollout"].maps[i], (v @ r)[prefix:].reshape(GRID), atol=1e-6, rtol=1e-4)
        r = eye.clone()
        for a, g in zip(attn, grads):
            r = r + (g * a).clamp(min=0).mean(0) @ r
        generic = (v @ (r - eye))[prefix:].reshape(GRID)
        torch.testing.assert_close(results["generic"].maps[i], generic, atol=1e-7, rtol=1e-4)
        assert float(generic.std()) > 0
    for name in ("grad_rollout", "cdam_integrated", "legrad"):
        maps = results[name].maps
        assert maps.shape == (2, *GRID) and torch.isfinite(maps).all() and float(maps.std()) > 0


def test_a_pooler_reading_a_patch_token_refuses_the_readout_methods_with_the_reason():
    """IJepaModel's optional pooler reads the first token, a patch (I-JEPA has no class token): no readout row of
    the attention is what it reads, so rollout-style methods are refused; the gradient methods go through it."""
    torch.manual_seed(0)
    config = transformers.IJepaConfig(**TINY)
    model = transformers.IJepaModel(config, add_pooling_layer=True).eval()
    ex = vx.Explainer(model)
    assert "rollout" not in ex.methods() and "generic" not in ex.methods() and "cdam" in ex.methods()
    x = torch.randn(2, 3, 32, 32)
    with pytest.raises(vx.UnsupportedMethodError, match="reads the first token, which is a patch"):
        ex.explain(x, method="rollout")
    e = ex.explain(x, method="cdam", target=vx.targets.similarity(VECTOR))
    assert e.maps.shape == (2, *GRID) and torch.isfinite(e.maps).all() and float(e.maps.std()) > 0


def test_headless_backbone_needs_a_score_target():
    model = CASES["clip_vision"][0]()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 32, 32)
    for target in (None, 3):
        with pytest.raises(vx.TargetError, match="no classifier head.*similarity"):
            ex.explain(x, method="cdam", target=target)
    e = ex.explain(x, method="cdam", target=lambda emb: emb.sum(-1))  # any callable works
    assert e.maps.shape == (1, *GRID) and bool((e.targets == -1).all())
    with torch.no_grad():
        pooled = model(pixel_values=x).pooler_output
    expected = torch.cosine_similarity(pooled, VECTOR[None], dim=-1)
    torch.testing.assert_close(vx.targets.similarity(VECTOR)(pooled), expected)
    torch.testing.assert_close(vx.targets.norm()(pooled), pooled.norm(dim=-1))
    with pytest.raises(vx.TargetError, match="last dimension"):
        vx.targets.similarity(torch.ones(5))(pooled)


def test_timm_headless_backbone_embedding_and_similarity():
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0).eval()
    ex = vx.Explainer(model)
    assert not ex.adapter.has_head and ex.adapter.label_names is None
    x = torch.randn(2, 3, 32, 32)
    vector = torch.randn(32)
    e = ex.explain(x, method="cdam", target=vx.targets.similarity(vector))
    # oracle: gradient of the cosine at the last block's first norm, by plain autograd
    kept = []
    handle = model.blocks[-1].norm1.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    emb = model(x)
    handle.remove()
    torch.cosine_similarity(emb, vector[None], dim=-1).sum().backward()
    expected = (kept[0] * kept[0].grad).sum(-1)[:, 1:].reshape(2, *GRID)
    torch.testing.assert_close(e.maps, expected.detach(), atol=1e-6, rtol=1e-4)
    with pytest.raises(vx.TargetError, match="no classifier head"):
        ex.explain(x, method="gradcam")


@pytest.mark.parametrize("kind", ["CLIP", "Siglip"])
def test_dual_encoder_explains_its_image_tower(kind):
    """CLIPModel / SiglipModel (image-text dual encoders): the explained score is a function of
    get_image_features (the model's own forward needs text). They were read with the *text*
    tower's layers (found first) and every method crashed in the model's forward."""
    torch.manual_seed(0)
    small = {k: v for k, v in TINY.items()}
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                bos_token_id=0, eos_token_id=1, pad_token_id=1)
    extra = dict(projection_dim=32) if kind == "CLIP" else {}
    config = getattr(transformers, f"{kind}Config")(vision_config=small, text_config=text, **extra)
    model = getattr(transformers, f"{kind}Model")(config).eval()
    ex = vx.Explainer(model)
    assert ex.adapter.blocks[0].startswith("vision_model.") and not ex.adapter.has_head
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    target = vx.targets.similarity(VECTOR)
    for e in ex.explain(x, method=ex.methods(), target=target):
        want = (2, 32, 32) if e.method in ("attnlrp", "cp_lrp") else (2, *GRID)
        assert e.maps.shape == want and torch.isfinite(e.maps).all(), e.method
    # oracle: CDAM by plain autograd on the image embedding (the last vision layer's first norm)
    prefix = 1 if kind == "CLIP" else 0
    cdam = ex.explain(x, method="cdam", target=target).maps
    kept = []
    norm = model.vision_model.encoder.layers[-1].layer_norm1
    handle = norm.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    try:
        out = model.get_image_features(pixel_values=x)
    finally:
        handle.remove()
    emb = out if isinstance(out, torch.Tensor) else out.pooler_output
    torch.cosine_similarity(emb, VECTOR[None], dim=-1).sum().backward()
    expected = (kept[0] * kept[0].grad).sum(-1)[:, prefix:].reshape(2, *GRID)
    torch.testing.assert_close(cdam, expected.detach(), atol=1e-6, rtol=1e-4)
    assert float(expected.detach().std()) > 0


def test_label_names_follow_the_class_index_when_id2label_keys_are_strings():
    """config.id2label set from a JSON file has string keys; sorted as text ("10" < "2") the
    label names were misordered and a label-name target explained another class, silently."""
    model = _build("ViTConfig", "ViTForImageClassification", num_labels=12)
    model.config.id2label = {str(i): f"class{i}" for i in range(12)}
    ex = vx.Explainer(model)
    assert ex.adapter.label_names == [f"class{i}" for i in range(12)]
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    by_name, by_index = ex.explain(x, method="cdam", target="class2"), ex.explain(x, method="cdam", target=2)
    assert by_name.targets.tolist() == [2] and by_name.target_names() == ["class2"]
    torch.testing.assert_close(by_name.maps, by_index.maps)
    model.config.id2label = {str(i): f"class{i}" for i in (0, 1, 3)}  # not the indices 0..C-1: no names
    assert vx.Explainer(model).adapter.label_names is None


def test_smoothgrad_with_one_target_vector_per_image_equals_the_images_one_by_one():
    """smoothgrad scores each image's noisy copies on their own. With similarity to one vector per
    image, (B, D), and as many copies as images, the copies of image 0 were each compared with a
    different image's vector, silently; they are scored as image 0's now, for any number of copies."""
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0).eval()
    ex = vx.Explainer(model)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    vectors = torch.randn(3, 32, generator=torch.Generator().manual_seed(5))
    for samples in (3, 2):  # as many copies as images (wrong maps), and not (it used to raise)
        got = ex.explain(x, method="smoothgrad", target=vx.targets.similarity(vectors), samples=samples).maps
        want = torch.cat([ex.explain(x[i:i + 1], method="smoothgrad", target=vx.targets.similarity(vectors[i]), samples=samples).maps
                          for i in range(3)])
        torch.testing.assert_close(got, want)
        assert float(want.abs().max()) > 0


def test_a_config_with_return_dict_false_is_explained_like_the_default():
    """config.return_dict=False makes the model return tuples; the adapter read attributes of
    them and crashed with an AttributeError (ViTModel runs with it; most models of transformers
    v5 do not, inside their own code)."""
    model = _build("ViTConfig", "ViTModel")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    want = vx.Explainer(model).explain(x, method="cdam", target=vx.targets.norm()).maps
    model.config.return_dict = False
    assert isinstance(model(pixel_values=x), tuple)
    got = vx.Explainer(model).explain(x, method="cdam", target=vx.targets.norm()).maps
    torch.testing.assert_close(got, want)


def test_a_label_name_shared_by_several_classes_is_refused_not_guessed():
    """ImageNet has two 'crane' classes (134, the bird; 517, the machine): the name resolved to
    the first silently. A name that several classes share is a TargetError naming them."""
    model = _build("ViTConfig", "ViTForImageClassification", num_labels=4)
    model.config.id2label = {0: "crane", 1: "heron", 2: "crane", 3: "truck"}
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(vx.TargetError, match=r"'crane' names several classes \[0, 2\]; pass the class index"):
        ex.explain(x, method="cdam", target="crane")
    with pytest.raises(vx.TargetError, match="several classes"):
        ex.explain(x, method="cdam", target=["crane"])
    assert ex.explain(x, method="cdam", target="truck").targets.tolist() == [3]


def test_a_timm_model_wrapped_by_transformers_is_explained_as_the_timm_model():
    """``AutoModelForImageClassification.from_pretrained("timm/...")`` returns a TimmWrapperForImageClassification
    (TimmWrapperModel headless) whose forward is its timm model's: its maps equal the timm model's own."""
    torch.manual_seed(0)
    config = transformers.TimmWrapperConfig(architecture="vit_tiny_patch16_224", num_labels=5,
                                            model_args=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2))
    wrapper = transformers.TimmWrapperForImageClassification(config).eval()
    sharpen_attention(wrapper)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(wrapper)
    with torch.no_grad():
        torch.testing.assert_close(ex.adapter.forward(x), wrapper(pixel_values=x).logits)
    names = ["rollout", "generic", "cdam"]
    for ours, timm_own in zip(ex.explain(x, method=names), vx.Explainer(wrapper.timm_model).explain(x, method=names)):
        assert torch.equal(ours.maps, timm_own.maps) and ours.targets.tolist() == timm_own.targets.tolist()
    for module in wrapper.modules():  # left as found
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("config_cls, model_cls", [("DINOv3ViTConfig", "DINOv3ViTBackbone"), ("Dinov2Config", "Dinov2Backbone"),
                                                   ("Dinov2WithRegistersConfig", "Dinov2WithRegistersBackbone")])
def test_a_backbone_of_a_known_type_is_refused_with_the_model_class_to_use(config_cls, model_cls):
    """DINOv3ViTBackbone / Dinov2Backbone share their model_type (and layers) with the models vitexplain explains,
    but return feature maps of several stages (a BackboneOutput: no logits, no pooled embedding, no
    last_hidden_state); they were taken for the headless model and every method raised a raw AttributeError. Every
    method is refused with the model class to load instead; the layout stays known for vx.capture."""
    model = _build(config_cls, model_cls)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert not hasattr(model(pixel_values=x), "last_hidden_state")
    expected = model_cls.replace("Backbone", "Model")
    ex = vx.Explainer(model)
    assert ex.methods() == []
    with pytest.raises(vx.UnsupportedModelError, match=f"{model_cls} is a backbone.*{expected}"):
        ex.explain(x, target=vx.targets.norm())
    with pytest.raises(vx.UnsupportedMethodError, match=f"{model_cls} is a backbone.*{expected}"):
        ex.explain(x, method="rollout", target=vx.targets.norm())
    with vx.capture(model) as rec:  # its attention is still recorded on a known token layout
        model(pixel_values=x)
    assert rec.layout.grid == GRID and len(rec.records) == model.config.num_hidden_layers


def test_a_timm_model_wrapped_by_transformers_keeps_the_wrappers_label_names():
    """The class names of a TimmWrapperForImageClassification live in the wrapper's config (id2label: what
    from_pretrained('timm/...') or a fine-tuned, saved wrapper carries), not in its timm model: explained as the
    timm model it had no label names, so a label target was refused and the CLI wrote no labels."""
    torch.manual_seed(0)
    config = transformers.TimmWrapperConfig(architecture="vit_tiny_patch16_224", num_labels=3,
                                            id2label={0: "cat", 1: "dog", 2: "fox"},
                                            model_args=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2))
    wrapper = transformers.TimmWrapperForImageClassification(config).eval()
    ex = vx.Explainer(wrapper)
    assert ex.adapter.label_names == ["cat", "dog", "fox"]
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    by_name = ex.explain(x, method="cdam", target="dog")
    assert by_name.targets.tolist() == [1] and by_name.target_names() == ["dog"]
    torch.testing.assert_close(by_name.maps, ex.explain(x, method="cdam", target=1).maps)
    plain = transformers.TimmWrapperForImageClassification(transformers.TimmWrapperConfig(
        architecture="vit_tiny_patch16_224", num_labels=3,
        model_args=dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)))
    assert vx.Explainer(plain).adapter.label_names is None  # LABEL_0, LABEL_1, ...: no names


def test_a_timm_model_wrapped_by_transformers_is_preprocessed_with_the_wrappers_data_config():
    """A wrapper keeps its checkpoint's timm data config (config.pretrained_cfg, which TimmWrapperImageProcessor
    uses); the timm model inside has its architecture's default (224 px, ImageNet statistics), which images were
    preprocessed with. At the checkpoint's size (nothing resampled) the preprocessed images equal the processor's."""
    cfg = dict(input_size=(3, 48, 48), mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4), crop_pct=1.0, interpolation="bilinear")
    config = transformers.TimmWrapperConfig(architecture="resnet18", num_labels=3, pretrained_cfg=dict(cfg))
    wrapper = transformers.TimmWrapperForImageClassification(config).eval()
    assert tuple(wrapper.timm_model.pretrained_cfg["mean"]) != cfg["mean"]
    ex = vx.Explainer(wrapper)
    image = np.random.default_rng(2).integers(0, 255, (48, 48, 3), dtype=np.uint8)
    pixels = transformers.TimmWrapperImageProcessor(pretrained_cfg=dict(cfg))([image], return_tensors="pt").pixel_values
    torch.testing.assert_close(ex.preprocess([image])[0], pixels, rtol=0, atol=1e-6)
