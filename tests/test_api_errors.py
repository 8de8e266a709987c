"""Bad input to the Python API gets a vitexplain error that says what is wrong and what to do,
and no NaN map is ever returned (the hostile-run cases of the reliability issue)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vitexplain as vx
from peers import require


@pytest.fixture(scope="module")
def model():
    return vx.zoo.load("shapes-vit")


@pytest.fixture(scope="module")
def ex(model):
    return vx.Explainer(model)


@pytest.fixture(scope="module")
def x():
    return vx.data.shapes(n=2, seed=3).tensor


@pytest.mark.parametrize("bad, error, message", [
    (lambda x: x[:, :2], vx.InputError, "takes 3 channels, the input has shape"),
    (lambda x: x.permute(0, 2, 3, 1), vx.InputError, r"channels-last\? pass x.permute\(0, 3, 1, 2\)"),
    (lambda x: x[0], vx.InputError, r"one image .* pass x\[None\]"),
    (lambda x: torch.nn.functional.interpolate(x, size=(96, 96)), vx.InputError, "does not take a 96x96 input.*expects 64x64"),
    (lambda x: x.double(), vx.InputError, "torch.float64 but the model's weights are torch.float32"),
    (lambda x: x.half(), vx.InputError, "torch.float16 but the model's weights are torch.float32"),
    (lambda x: (x * 255).to(torch.uint8), vx.InputError, "float tensor"),
    (lambda x: x[:0], vx.InputError, "empty"),
])
def test_bad_input_tensors(ex, x, bad, error, message):
    with pytest.raises(error, match=message):
        ex.explain(bad(x), method="cdam")


@pytest.mark.parametrize("target, message", [
    (1.0, "target must be None, a class index"),
    ([0.5, 1.9], "target 0.5 is a float"),  # used to be truncated to [0, 1] silently
    (torch.tensor([0.5, 1.9]), "integer class indices, got torch.float32"),
    ([0], "got 1 targets for a batch of 2"),
    (99, "out of range"),
])
def test_bad_targets(ex, x, target, message):
    with pytest.raises(vx.TargetError, match=message):
        ex.explain(x, method="cdam", target=target)


@pytest.mark.parametrize("target, same", [
    (torch.tensor(2), 2),  # a 0-d tensor (e.g. logits.argmax()) crashed with a TypeError (len of an int)
    (np.int64(2), 2),  # a NumPy integer is a class index; it was refused as "not a class index"
    (np.array(1), 1),
    (np.array([2, 0]), [2, 0]),
    ([torch.tensor(2), torch.tensor(0)], [2, 0]),  # a list of 0-d tensors (logits[i].argmax()): "is a Tensor"
    ([torch.tensor(2), "circle"], [2, 0]),
])
def test_tensor_and_numpy_class_indices_are_the_python_ints_they_hold(ex, x, target, same):
    got = ex.explain(x, method="cdam", target=target)
    want = ex.explain(x, method="cdam", target=same)
    assert got.targets.tolist() == want.targets.tolist()
    torch.testing.assert_close(got.maps, want.maps)


@pytest.mark.parametrize("target, message", [
    (torch.tensor(1.0), "got float 1.0"),
    (torch.tensor(True), "got bool True"),
    (np.array([0.5, 1.0]), "target 0.5 is a float"),
    (np.float32(1.0), "got float 1.0"),
    ([torch.tensor(1.0), torch.tensor(0.0)], r"target tensor\(1.\) is a Tensor.*a float is never rounded"),
    ([torch.tensor(True), torch.tensor(False)], r"target tensor\(True\) is a Tensor"),
])
def test_non_integer_tensor_and_numpy_targets_are_refused(ex, x, target, message):
    with pytest.raises(vx.TargetError, match=message):
        ex.explain(x, method="cdam", target=target)


def test_a_detached_score_cannot_be_explained_by_gradients(ex, x):
    with pytest.raises(vx.TargetError, match="does not depend on the model's outputs"):
        ex.explain(x, method="cdam", target=lambda out: out[:, 0].detach())
    ex.explain(x, method="rollout", target=lambda out: out[:, 0].detach())  # no gradient: fine


@pytest.mark.parametrize("method", ["cdam", "generic", "rollout", "gradcam", "legrad"])
def test_overflowing_outputs_are_an_error_not_nan_maps(ex, x, method):
    with pytest.raises(vx.NumericalError, match=r"outputs are not finite .* images \[0, 1\]"):
        ex.explain(x * 1e30, method=method)


def test_a_nan_target_score_is_an_error(ex, x):
    with pytest.raises(vx.NumericalError, match="target score is NaN or inf .* outputs are finite"):
        ex.explain(x, method="cdam", target=lambda out: out[:, 0] / 0.0 * 0.0)


def test_nan_weights_say_the_outputs_are_not_finite(model, x):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.head.weight.fill_(float("nan"))
    with pytest.raises(vx.NumericalError, match="outputs are not finite"):  # not legrad's re-run message
        vx.Explainer(broken).explain(x, method="legrad")


@pytest.mark.parametrize("method, options, message", [
    # the range said is the one accepted: start_layer is non-negative (it said [-4, 3], and -4 is refused)
    ("rollout", {"start_layer": 99}, r"'start_layer' must be in \[0, 3\] for this model \(4 layers\); got 99"),
    ("generic", {"start_layer": 4}, r"'start_layer' must be in \[0, 3\] .*; got 4"),
    ("grad_rollout", {"start_layer": -1}, r"'start_layer' must be an integer in \[0, inf\)"),
    ("cdam_smooth", {"samples": 10**9}, r"'samples' must be an integer in \[1, 10000\]"),
    ("cdam_integrated", {"steps": 10**9}, r"'steps' must be an integer in \[1, 10000\]"),
])
def test_options_out_of_what_the_model_or_memory_allows(ex, x, method, options, message):
    with pytest.raises(vx.OptionError, match=message):
        ex.explain(x, method=method, **options)


def test_overlay_index_out_of_range(ex):
    e = ex.explain(vx.data.shapes(n=2, seed=1).images)
    assert e.method == "generic"  # method=None is the family's default
    with pytest.raises(vx.UsageError, match="image index 7 is out of range: this explanation holds 2"):
        e.overlay(7)
    assert e.overlay(-1).shape == e.images[-1].shape


def test_cdam_smooth_on_a_frozen_model(model, x):
    frozen = copy.deepcopy(model).requires_grad_(False)
    got = vx.Explainer(frozen).explain(x, method="cdam_smooth", samples=4)
    want = vx.Explainer(model).explain(x, method="cdam_smooth", samples=4)
    torch.testing.assert_close(got.maps, want.maps)
    assert not any(p.requires_grad for p in frozen.parameters())


def test_a_bf16_model_given_float32_input(model, x):
    half = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(vx.InputError, match=r"pass x.to\(torch.bfloat16\)"):
        vx.Explainer(half).explain(x)
    assert vx.Explainer(half).explain(x.to(torch.bfloat16), method="rollout").maps.shape == (2, 8, 8)


def test_smoothgrad_of_a_bf16_model_equals_its_float32_copy(model, x):
    """captum adds float32 noise, which made a bf16 image float32: the model's first conv
    raised a dtype mismatch. The noise (seeded) is the same for a float32 copy of the bf16
    weights, so the maps differ by bf16 rounding only: measured 0.74% of the largest value here
    (0.24-0.35% on 4 random ViTs); 3% allowed."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    wide = copy.deepcopy(half).float()
    xb = x.to(torch.bfloat16)
    got = vx.Explainer(half).explain(xb, method="smoothgrad", target=1, samples=4).maps
    want = vx.Explainer(wide).explain(xb.float(), method="smoothgrad", target=1, samples=4).maps
    assert torch.isfinite(got).all() and float(want.abs().max()) > 0
    assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max())


@pytest.mark.parametrize("dtype, most", [(torch.float16, 0.03), (torch.bfloat16, 0.1)])
@pytest.mark.filterwarnings("ignore::vitexplain.errors.ConvergenceWarning")  # (8 steps: fast, not converged)
def test_integrated_gradients_of_a_half_model_equals_its_float32_copy(model, x, dtype, most):
    """captum's attributions of a float16 / bfloat16 input come back float32, and storing them into a buffer of the
    input's dtype raised torch's 'Index put requires the source and destination dtypes match'. The maps differ from
    a float32 copy of the same weights by the half precision's rounding only: measured 0.75% (float16) and 3.5%
    (bfloat16) of the largest value; 4x and 3x that allowed."""
    half = copy.deepcopy(model).to(dtype)
    wide = copy.deepcopy(half).float()
    xh = x.to(dtype)
    got = vx.Explainer(half).explain(xh, method="integrated_gradients", target=1, steps=8)
    want = vx.Explainer(wide).explain(xh.float(), method="integrated_gradients", target=1, steps=8)
    assert got.maps.dtype == torch.float32 and torch.isfinite(got.maps).all() and float(want.maps.abs().max()) > 0
    assert float((got.maps - want.maps).abs().max()) <= most * float(want.maps.abs().max())
    assert all(p.dtype == dtype for p in half.parameters())


@pytest.fixture(scope="module")
def captioner():
    return vx.Explainer(vx.zoo.load("shapes-captioner"))


@pytest.mark.parametrize("caption, message", [
    ([5, 999], r"token ids \[999\] outside the vocabulary"),
    ([-5], r"token ids \[-5\] outside the vocabulary"),  # used to be read as a word
    ([[], []], "caption 0 is empty"),
    ([], "got 0 captions for 2 images"),
    ("", "empty"),
])
def test_bad_captions(captioner, x, caption, message):
    with pytest.raises(vx.UsageError, match=message):
        captioner.explain_caption(x, method="cross", caption=caption)


def test_small_integer_smooth_samples_equal_one_draw_batch_by_batch(ex, x):
    """Noise is drawn batch_size samples at a time (memory bounded): the draw does not depend on
    how many images are explained together."""
    both = ex.explain(x, method="cdam_smooth", samples=5, batch_size=2)
    for i in range(2):
        alone = ex.explain(x[i : i + 1], method="cdam_smooth", samples=5, batch_size=2)
        torch.testing.assert_close(both.maps[i : i + 1], alone.maps, rtol=1e-4, atol=1e-6)


def test_a_hugging_face_vit_on_another_size_than_its_configured_one_gets_an_input_error():
    """Hugging Face SigLIP adds its fixed position embeddings without checking the size first: at another size
    its forward fails with a bare shape error, which becomes an InputError naming the configured size (the
    model's own message kept); at its configured size it runs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(config).eval()
    ex = vx.Explainer(model)
    with pytest.raises(vx.InputError, match=r"does not take a 32x48 input \(RuntimeError: .*expects 32x32 images"):
        ex.explain(torch.rand(2, 3, 32, 48), method="rollout", target=vx.targets.norm())
    assert ex.explain(torch.rand(2, 3, 32, 32), method="rollout", target=vx.targets.norm()).maps.shape == (2, 4, 4)


@pytest.mark.parametrize("channels", [1, 4])
def test_a_model_built_for_other_than_three_channels_takes_its_own(channels):
    """timm in_chans / Hugging Face num_channels: the input check took the channel count from
    the normalisation mean (three values whatever in_chans), so the model's own input was refused
    with advice to repeat it to 3 channels, and images (RGB) crashed inside the model."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3,
                              in_chans=channels).eval()
    ex = vx.Explainer(model)
    x = torch.randn(2, channels, 32, 32)
    e = ex.explain(x, method="cdam", target=1)
    # oracle: CDAM by plain autograd at the last block's first norm
    kept = []
    handle = model.blocks[-1].norm1.register_forward_hook(lambda m, a, o: (o.retain_grad(), kept.append(o))[0])
    try:
        model(x)[:, 1].sum().backward()
    finally:
        handle.remove()
    torch.testing.assert_close(e.maps, (kept[0] * kept[0].grad).sum(-1)[:, 1:].reshape(2, 4, 4).detach(), atol=1e-6, rtol=1e-4)
    with pytest.raises(vx.InputError, match=f"takes {channels} channels, the input has shape \\(2, 3, 32, 32\\)"):
        ex.explain(torch.randn(2, 3, 32, 32), method="cdam")
    with pytest.raises(vx.InputError, match=f"takes {channels}-channel input.*preprocessed to 3 channels"):
        ex.explain(np.full((32, 32, 3), 100, np.uint8), method="cdam")


def test_a_model_on_the_meta_device_gets_a_clear_error():
    """A model built under torch.device('meta') has no weight values; its explanation crashed
    with a RuntimeError ('Tensor.item() cannot be called on meta tensors') in the score check."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3).to("meta")
    with pytest.raises(vx.UnsupportedModelError, match="meta device.*load real weights"):
        vx.Explainer(model).explain(torch.randn(1, 3, 32, 32), method="generic")
    with pytest.raises(vx.UnsupportedModelError, match="meta device"):
        vx.Explainer(model).explain(torch.randn(1, 3, 32, 32, device="meta"), method="rollout")


def test_upsample_sizes_and_modes(ex, x, tmp_path):
    """Explanation.upsample took only a (H, W) pair (an int, as torch's interpolate takes, was a
    TypeError), and a zero size or an unknown mode escaped as torch errors; saving into a file
    path was a FileExistsError."""
    e = ex.explain(x, method="cdam")
    square = e.upsample(40)
    torch.testing.assert_close(square, torch.nn.functional.interpolate(e.maps[:, None], size=(40, 40), mode="bilinear",
                                                                       align_corners=False)[:, 0])
    assert e.upsample(np.int64(24), mode="nearest").shape == (2, 24, 24)
    for size in ((0, 10), -3, (10, 2.5), True, "64"):
        with pytest.raises(vx.UsageError, match="size must be"):
            e.upsample(size)
    with pytest.raises(vx.UsageError, match="mode must be one of"):
        e.upsample(mode="cubic")
    (tmp_path / "taken").write_text("")
    with pytest.raises(vx.UsageError, match="it is a file"):
        e.save(tmp_path / "taken")


def test_a_size_the_patch_does_not_divide_says_which_sizes_work():
    """A timm ViT with dynamic_img_size takes any multiple of its patch size; refusing 50x70 the
    error said it 'expects 224x224 images' (its pretrained config's size), which is not the problem."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=1, num_classes=3, dynamic_img_size=True).eval()
    ex = vx.Explainer(model)
    with pytest.raises(vx.InputError, match="patch size 16x16 must divide the input.*e.g. 48x64") as info:
        ex.explain(torch.randn(1, 3, 50, 70), method="rollout")
    assert "224" not in str(info.value)
    assert ex.explain(torch.randn(1, 3, 48, 64), method="rollout").maps.shape == (1, 3, 4)  # the size it suggested


@pytest.mark.parametrize("library", ["timm", "open_clip"])
def test_patch_dropout_in_training_mode_is_refused_with_what_to_do(library):
    """timm's and OpenCLIP's PatchDropout keep a random subset of the patches in training mode: the attention then
    covers tokens no map can place (the refusal used to say the layout did not match, or that a token count was
    wrong). In eval mode the same model is explained."""
    torch.manual_seed(0)
    if library == "timm":
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                                  patch_drop_rate=0.5)
        target = 1
    else:
        open_clip = require("open_clip", "pip install open_clip_torch ftfy")
        model = open_clip.transformer.VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=2,
                                                        mlp_ratio=2.0, output_dim=16, patch_dropout=0.5)
        target = vx.targets.norm()
    x = torch.rand(2, 3, 32, 32)
    ex = vx.Explainer(model.train())
    for method in ("rollout", "cdam"):
        with pytest.raises(vx.UnsupportedModelError, match=r"drops 50% of the patch tokens .* call model.eval\(\)"):
            ex.explain(x, method=method, target=target)
    model.eval()
    assert ex.explain(x, method="cdam", target=target).maps.shape == (2, 4, 4)


def test_a_timm_vit_without_blocks_gets_a_clear_error():
    """depth=0: nothing to explain by attention or tokens (the adapter read the last block's norm: an IndexError)."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=0, num_heads=2, num_classes=3).eval()
    with pytest.raises(vx.UnsupportedModelError, match="no transformer blocks"):
        vx.Explainer(model)
