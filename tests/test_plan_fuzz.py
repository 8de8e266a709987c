"""What fuzzing the one plan found: each listed method runs or refuses with a vitexplain error on
models, sizes and options the other tests do not use, and its options are not taken blindly."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(5)
    return VisionTransformer(img_size=(24, 40), patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()


def test_an_occlusion_batch_larger_than_the_patches_runs_the_patches_it_has(vit):
    # batch_size is how many occluded copies run per forward: more than the grid's patches (3 x 5)
    # is all of them; captum replicated the input batch_size times (2**40 copies: MemoryError)
    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(1))
    ex = vx.Explainer(vit)
    one = ex.explain(x, method="occlusion", batch_size=1).maps
    torch.testing.assert_close(ex.explain(x, method="occlusion", batch_size=2**40).maps, one)
    torch.testing.assert_close(ex.explain(x, method="occlusion", batch_size=2**63).maps, one)


@pytest.mark.parametrize("build, size", [
    # built for 64 px (attention biases for a 2 x 2 grid) and given 64 x 96
    (lambda: timm.models.efficientformer_v2.EfficientFormerV2(
        depths=(1, 1, 2, 2), embed_dims=(16, 24, 32, 48), img_size=64, num_vit=2, num_classes=5), (64, 96)),
    # timm's config: a fixed 224 x 224 input
    (lambda: timm.create_model("efficientformer_l1", pretrained=False, num_classes=5), (160, 160)),
])
def test_a_hybrid_built_for_one_size_refuses_another_with_an_input_error(build, size):
    # its attention keeps position biases for one grid: another size fails inside the model
    # (a raw RuntimeError 'shape ... is invalid'); a user is told it is the input size
    model = build().eval()
    ex = vx.Explainer(model)
    assert ex.family.name == "cnn"
    with pytest.raises(vx.InputError, match=rf"does not take a {size[0]}x{size[1]} input .*size it was built for"):
        ex.explain(torch.randn(1, 3, *size), method="gradcam")


def _cam_oracle(model, layer, x, classes):
    """Grad-CAM and LayerCAM by hand on what ``layer`` returned (copied in its forward hook, before the
    model's later in-place ops) and the gradient of the target score with respect to it."""
    store = {}

    def keep(module, inputs, output):
        store["a"] = output.detach().clone()
        output.register_hook(lambda g: store.__setitem__("g", g))  # fires with dy/d(output as returned)

    handle = model.get_submodule(layer).register_forward_hook(keep)
    try:
        model(x)[torch.arange(len(x)), classes].sum().backward()
    finally:
        handle.remove()
    a, g = store["a"], store["g"]
    return {"gradcam": (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0),
            "layercam": (g.clamp(min=0) * a).sum(1).clamp(min=0)}


@pytest.mark.parametrize("build, layer", [
    # DenseNet's forward applies F.relu(..., inplace=True) to features.norm5, its default layer
    (lambda: torchvision.models.DenseNet(growth_rate=8, block_config=(1, 1), num_init_features=8, bn_size=2,
                                         num_classes=5), None),
    # a BasicBlock adds the identity to bn2's output in place (out += identity), then an in-place ReLU
    (lambda: torchvision.models.resnet18(num_classes=5), "layer4.1.bn2"),
])
def test_grad_cams_read_the_module_output_before_the_model_changes_it_in_place(build, layer):
    torch.manual_seed(3)
    model = build().eval()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    classes = torch.tensor([1, 3])
    ex = vx.Explainer(model)
    options = {} if layer is None else {"module": layer}  # DenseNet: its default layer
    layer = layer or ex.adapter.target_layer
    expected = _cam_oracle(model, layer, x, classes)
    for method, want in expected.items():
        assert float(want.abs().max()) > 0
        got = ex.explain(x, method=method, target=classes, **options).maps
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()), msg=method)


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp", "integrated_gradients", "smoothgrad"])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_detached_score_is_a_target_error_for_every_method_that_differentiates_it(vit, method, batch):
    # these methods take the score's gradient themselves (not through the explained forward's
    # backward, where the check was): a raw 'element 0 of tensors does not require grad'
    x = torch.randn(batch, 3, 24, 40, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(vit)
    options = {"samples": 2} if method == "smoothgrad" else {"steps": 2} if method == "integrated_gradients" else {}
    for score in (lambda out: out[:, 0].detach(), lambda out: (out[:, 0] > 0).int()):
        with pytest.raises(vx.TargetError, match="detached"):
            ex.explain(x, method=method, target=score, **options)


def test_occlusion_needs_no_gradient_of_the_score(vit):
    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(vit)
    detached = ex.explain(x, method="occlusion", target=lambda out: out[:, 2].detach()).maps
    torch.testing.assert_close(detached, ex.explain(x, method="occlusion", target=2).maps)


@pytest.mark.parametrize("method", ["cdam", "gradcam", "cdam_smooth", "cdam_integrated", "legrad"])
def test_a_detached_score_is_a_target_error_on_swin(method):
    # Swin's token methods re-run the last block and differentiate the score themselves
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(img_size=(32, 48), patch_size=4, window_size=4, embed_dim=16, depths=(2, 2),
                            num_heads=(2, 4), num_classes=5).eval()
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(2))
    options = {"cdam_smooth": {"samples": 2}, "cdam_integrated": {"steps": 2}}.get(method, {})
    with pytest.raises(vx.TargetError, match="detached"):
        vx.Explainer(model).explain(x, method=method, target=lambda out: out[:, 0].detach(), **options)


@pytest.mark.parametrize("family", ["vit", "swin"])
def test_a_method_after_legrad_in_one_call_equals_it_alone(vit, family):
    # LeGrad differentiates each layer's score over the explained graph; the capture's gradient
    # hooks added those gradients to the attention records, so a gradient method after it in the
    # same call (generic, grad_rollout, attn_gradcam) read them: maps off by 100-200%
    if family == "swin":
        from timm.models.swin_transformer import SwinTransformer

        torch.manual_seed(0)
        model = SwinTransformer(img_size=(32, 48), patch_size=4, window_size=4, embed_dim=16, depths=(2, 2),
                                num_heads=(2, 4), num_classes=5).eval()
        x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(2))
    else:
        model, x = vit, torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(model)
    methods = ["generic", "grad_rollout", "attn_gradcam"]
    together = ex.explain(x, method=["legrad", *methods], target=1)
    for e in together:
        alone = ex.explain(x, method=e.method, target=1).maps
        torch.testing.assert_close(e.maps, alone, rtol=1e-5, atol=1e-6 * float(alone.abs().max()), msg=e.method)


def test_a_module_that_runs_twice_per_forward_is_refused_by_name():
    # torchvision's BasicBlock applies its one ReLU module twice (after bn1, and after the sum):
    # module='layer4.1.relu' named two feature maps, and the Grad-CAM family read the last silently
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).eval()
    ex = vx.Explainer(model)
    x = torch.randn(1, 3, 64, 64)
    for method in ("gradcam", "gradcam++", "layercam"):
        with pytest.raises(vx.OptionError, match=r"'layer4\.1\.relu' runs 2 times in one forward.*'layer4\.1'"):
            ex.explain(x, method=method, module="layer4.1.relu")
    ex.explain(x, method="gradcam", module="layer4.1")  # its parent block, called once, is fine


@pytest.mark.parametrize("layers", [[0, 0], [-1, 1]])  # 2 layers: -1 is layer 1
def test_legrad_refuses_a_layer_listed_twice(vit, layers):
    # LeGrad averages over the listed layers: a layer named twice was silently weighed double
    x = torch.randn(1, 3, 24, 40)
    with pytest.raises(vx.OptionError, match=r"legrad option 'layers' names layers \[\d\] more than once"):
        vx.Explainer(vit).explain(x, method="legrad", layers=layers)


def test_methods_given_as_a_set_are_refused(vit):
    # results come back in the order the methods are named; a set has no order (its iteration
    # order changes with PYTHONHASHSEED), so results[0] was one method or another run to run
    with pytest.raises(vx.UsageError, match="a list of names.*in that order.*got a set"):
        vx.Explainer(vit).plan(method={"rollout", "cdam"})


@pytest.mark.parametrize("method, options", [("cdam_smooth", {"samples": 2}), ("smoothgrad", {"samples": 2})])
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_an_option_error(vit, method, options, seed):
    # torch seeds are 64-bit: past that, torch raised a raw 'Overflow when unpacking long long'
    x = torch.randn(1, 3, 24, 40)
    with pytest.raises(vx.OptionError, match=rf"{method} option 'seed' must be an integer in \[-9223372036854775808, "
                                              r"18446744073709551615\], or None"):
        vx.Explainer(vit).explain(x, method=method, seed=seed, **options)
    vx.Explainer(vit).explain(x, method=method, seed=2**64 - 1, **options)  # the largest torch takes


@pytest.fixture(scope="module")
def padded_vit():
    # timm pads a 30 x 45 input to 32 x 48 on the bottom and right: a 4 x 6 grid of 8-px patches,
    # the last row and column of patches partly padding
    torch.manual_seed(6)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                             dynamic_img_size=True, dynamic_img_pad=True).eval()


def _blocks(pixels, patch=8):
    """(B, H, W) per-pixel values summed over each patch's own pixels (patch i covers rows
    [8 i, 8 i + 8) cut to the image), by hand."""
    b, h, w = pixels.shape
    gh, gw = -(-h // patch), -(-w // patch)
    out = torch.zeros(b, gh, gw, dtype=pixels.dtype)
    for i in range(gh):
        for j in range(gw):
            out[:, i, j] = pixels[:, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch].sum((1, 2))
    return out


def test_occlusion_on_a_padded_grid_occludes_each_patch_s_own_pixels(padded_vit):
    # the patch mask split the 30 rows evenly (0-7, 8-14, 15-22, 23-29): 'patch 1' left its row 15
    # to 'patch 2', which left row 23 to 'patch 3': cells mixed two patches' pixels
    x = torch.randn(2, 3, 30, 45, generator=torch.Generator().manual_seed(3))
    e = vx.Explainer(padded_vit).explain(x, method="occlusion", target=1)
    assert e.maps.shape == (2, 4, 6)
    with torch.no_grad():
        base = padded_vit(x)[:, 1]
        want = torch.zeros(2, 4, 6)
        for i in range(4):
            for j in range(6):
                xo = x.clone()
                xo[:, :, i * 8:(i + 1) * 8, j * 8:(j + 1) * 8] = 0.0
                want[:, i, j] = base - padded_vit(xo)[:, 1]
    torch.testing.assert_close(e.maps, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_integrated_gradients_on_a_padded_grid_sums_each_patch_s_own_pixels(padded_vit):
    # adaptive average pooling over 30 rows into 4 cells has overlapping bins ([0, 8), [7, 15), ...):
    # pixels were counted in two cells and the cells did not sum to the attribution
    from captum.attr import IntegratedGradients

    x = torch.randn(2, 3, 30, 45, generator=torch.Generator().manual_seed(3))
    e = vx.Explainer(padded_vit).explain(x, method="integrated_gradients", target=1, steps=4)
    pixels = IntegratedGradients(padded_vit).attribute(x, baselines=0.0, target=1, n_steps=4).sum(1)
    want = _blocks(pixels.detach())
    torch.testing.assert_close(e.maps, want.float(), rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("method", ["attnlrp", "cp_lrp"])
def test_lrp_patches_on_a_padded_grid_sum_each_patch_s_own_pixels(padded_vit, method):
    # resolution='patches' (and extras['grid']) pooled the pixel relevance with adaptive average
    # pooling, whose bins overlap on a 30 x 45 input: not each patch's sum, and not conserving
    x = torch.randn(2, 3, 30, 45, generator=torch.Generator().manual_seed(3))
    ex = vx.Explainer(padded_vit)
    pixels = ex.explain(x, method=method, target=1)
    patches = ex.explain(x, method=method, target=1, resolution="patches")
    want = _blocks(pixels.maps.double())
    assert patches.maps.shape == (2, 4, 6)
    torch.testing.assert_close(patches.maps.double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    torch.testing.assert_close(pixels.extras["grid"].double(), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_swin_on_a_padded_input_puts_each_pixel_in_its_own_last_stage_token():
    # Hugging Face's Swin pads 30 x 45 to 32 x 48: its last stage is a 4 x 6 grid of 8-px tokens.
    # The layout said 7 px (30 // 4, 45 // 6), so occlusion occluded 7-px blocks (the last 9 px)
    import transformers

    torch.manual_seed(0)
    config = transformers.SwinConfig(image_size=32, patch_size=4, window_size=4, embed_dim=16, depths=[2, 2],
                                     num_heads=[2, 4], num_labels=5)
    model = transformers.SwinForImageClassification(config).eval()
    x = torch.randn(1, 3, 30, 45, generator=torch.Generator().manual_seed(3))
    e = vx.Explainer(model).explain(x, method="occlusion", target=1)
    assert e.maps.shape == (1, 4, 6) and e.layout.patch_size == (8, 8)
    with torch.no_grad():
        base = model(pixel_values=x).logits[:, 1]
        want = torch.zeros(1, 4, 6)
        for i in range(4):
            for j in range(6):
                xo = x.clone()
                xo[:, :, i * 8:(i + 1) * 8, j * 8:(j + 1) * 8] = 0.0
                want[:, i, j] = base - model(pixel_values=xo).logits[:, 1]
    torch.testing.assert_close(e.maps, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    # upsampled, each token's value lies on its own 8-px block (with 7 px they drifted by a pixel a cell)
    up = e.upsample(mode="nearest")[0]
    blocks = e.maps[0].repeat_interleave(8, 0).repeat_interleave(8, 1)[:30, :45]
    torch.testing.assert_close(up, blocks)


def test_a_hierarchical_layout_on_an_uneven_input_says_the_embedding_stride():
    # PVTv2's patch embedding (kernel 7, stride 4, padding 3) makes 8 x 12 tokens of a 30 x 45
    # input: 4 px each. The layout said 30 // 8 = 3 px, so the captum methods split the pixels
    # evenly instead of by token, and disagreed with the layout the explanation reports
    torch.manual_seed(0)
    model = timm.create_model("pvt_v2_b0", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4),
                              num_classes=5).eval()
    ex = vx.Explainer(model)
    layout = ex.adapter.layout((30, 45))
    assert layout.grid == (8, 12) and layout.patch_size == (4, 4)
    e = ex.explain(torch.randn(1, 3, 30, 45), method="occlusion", target=1)
    assert e.layout.patch_size == layout.patch_size


@pytest.mark.parametrize("options, message", [
    # heads= averages exactly the chosen heads: layers= and head_fusion= were ignored silently
    ({"heads": [(0, 1)], "layers": [1]}, "heads.*layers"),
    ({"heads": [(0, 1), (1, 0)], "head_fusion": "max"}, "heads.*head_fusion"),
    # a pair given twice was averaged in twice
    ({"heads": [(0, 1), (0, 1)]}, r"heads.*\(0, 1\).*more than once"),
    ({"heads": [(0, 1), (-2, 1)]}, r"heads.*\(0, 1\).*more than once"),  # 2 layers: -2 is layer 0
])
def test_vlm_cross_options_that_would_be_ignored_or_counted_twice_are_refused(options, message):
    import vlm_helpers

    model, processor = vlm_helpers.BUILDERS["llava"]()
    with pytest.raises(vx.OptionError, match=message):
        vx.Explainer(model, processor=processor).explain_caption(vlm_helpers.images(3), method="cross",
                                                                 prompt="what is", max_len=2, **options)


@pytest.mark.parametrize("family", ["vit", "swin", "hier"])
def test_raw_refuses_one_head_and_a_head_fusion_together(vit, family):
    # head= reads one head, head_fusion= fuses all of them: with both, head_fusion was ignored silently
    if family == "swin":
        from timm.models.swin_transformer import SwinTransformer

        model = SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(2,), num_heads=(2,),
                                num_classes=5).eval()
        x = torch.randn(1, 3, 32, 32)
    elif family == "hier":
        model = timm.create_model("pvt_v2_b0", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1),
                                  num_heads=(1, 2, 2, 4), num_classes=5).eval()
        x = torch.randn(1, 3, 64, 64)
    else:
        model, x = vit, torch.randn(1, 3, 24, 40)
    ex = vx.Explainer(model)
    with pytest.raises(vx.OptionError, match="raw options 'head' and 'head_fusion'"):
        ex.explain(x, method="raw", head=0, head_fusion="max")
    ex.explain(x, method="raw", head=0)  # each alone is fine
    ex.explain(x, method="raw", head_fusion="max")


def test_numpy_and_0d_tensor_option_values_are_the_numbers_they_hold(vit):
    # options computed with NumPy or torch (np.int64(1), a 0-d tensor) were refused as "must be an integer";
    # they now give exactly the maps of the same Python numbers, and the explanation records plain numbers
    import numpy as np

    x = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(vit)
    plain = ex.explain(x, method="rollout", discard_ratio=0.5, start_layer=1)
    for ratio, start in ((np.float32(0.5), np.int64(1)), (torch.tensor(0.5), torch.tensor(1)), (np.array(0.5), 1)):
        e = ex.explain(x, method="rollout", discard_ratio=ratio, start_layer=start)
        torch.testing.assert_close(e.maps, plain.maps, rtol=0, atol=0)
        assert e.options == {"discard_ratio": 0.5, "start_layer": 1} and type(e.options["start_layer"]) is int
    with pytest.raises(vx.OptionError, match="discard_ratio"):
        ex.explain(x, method="rollout", discard_ratio=np.array([0.5, 0.2]))
    with pytest.raises(vx.OptionError, match="start_layer"):
        ex.explain(x, method="rollout", start_layer=np.float64(1.5))
