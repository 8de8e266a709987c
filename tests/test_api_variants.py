"""The Python API on the variants a user's own model comes in: layers left in training mode inside a model in eval
mode, wrappers, saved explanations read back. Each call gives a correct result and leaves the model as it was found,
or raises a vitexplain error that says what to do."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import vitexplain as vx
from vitexplain.results import CaptionExplanation

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def x():
    return vx.data.shapes(n=2, seed=3).tensor


def _cnn_with_one_training_norm():
    model = vx.zoo.load("shapes-cnn").eval()
    name, norm = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))
    norm.train()  # e.g. left so after fine-tuning only the norms
    return model, name, norm


def test_a_batch_norm_left_in_training_mode_inside_an_eval_model_is_warned_about_and_its_statistics_kept(x):
    """model.eval() then one BatchNorm switched back to training: the explained forward updated its running
    statistics (the user's model was changed) and nothing was said, since only the model's own flag was read."""
    model, name, norm = _cnn_with_one_training_norm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=rf"training mode \(1 layer\(s\): {name}\).*batch norm"):
        vx.Explainer(model).explain(x, method="gradcam")
    changed = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert not changed, changed
    assert norm.training and not model.training  # the flags themselves as found


def test_monte_carlo_dropout_in_an_eval_model_is_warned_about(x):
    """Dropout layers switched to training in an eval model (Monte Carlo dropout) make maps random: said."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              proj_drop_rate=0.5).eval()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.train()
    with pytest.warns(UserWarning, match="training mode .*layer.*drop"):
        vx.Explainer(model).explain(torch.rand(1, 3, 32, 32), method="generic")


class Normalize(nn.Module):
    """A user's normalisation in front of the model: fixed statistics as buffers, no parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(1, 3, 1, 1))
        self.register_buffer("std", torch.ones(1, 3, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


@pytest.mark.parametrize("wrap", [lambda m: nn.Sequential(Normalize(), m), nn.DataParallel])
def test_a_wrapper_built_after_eval_is_not_a_model_in_training_mode(x, wrap):
    """nn.Sequential(normalize, model) or nn.DataParallel(model) built after model.eval() is itself in training mode
    (a new module) while every layer it runs is in eval mode: the maps are not random, so no warning (there was one,
    telling the user to call eval() on a model in eval mode)."""
    model = wrap(vx.zoo.load("shapes-cnn").eval())
    assert model.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = vx.Explainer(model).explain(x, method="gradcam")
    alone = vx.Explainer(vx.zoo.load("shapes-cnn").eval()).explain(x, method="gradcam")
    torch.testing.assert_close(e.maps, alone.maps)


def test_patch_dropout_left_in_training_mode_inside_an_eval_model_is_refused():
    """A PatchDropout in training mode inside a model in eval mode drops patches at random just the same: refused
    (the check read the model's own flag first and returned)."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              patch_drop_rate=0.5).eval()
    model.patch_drop.train()
    with pytest.raises(vx.UnsupportedModelError, match=r"patch_drop drops 50% of the patch tokens"):
        vx.Explainer(model).explain(torch.rand(2, 3, 32, 32), method="rollout")


def _same_explanation(got, want):
    torch.testing.assert_close(got.maps, want.maps.cpu(), rtol=0, atol=0)
    assert torch.equal(got.targets, want.targets.cpu())
    assert (got.method, got.options, got.signed, tuple(got.input_size)) == \
        (want.method, want.options, want.signed, tuple(want.input_size))
    assert got.layout == want.layout and got.boxes == want.boxes and got.target_names() == want.target_names()


@pytest.mark.parametrize("name, method, options, target", [
    ("shapes-vit", "rollout", {"discard_ratio": 0.5}, None),
    ("shapes-hier", "generic", {}, [1, "star"]),
    ("shapes-cnn", "gradcam", {}, [1, "star"]),
])
def test_a_saved_explanation_loads_back_and_draws_as_the_original(tmp_path, name, method, options, target):
    """save() wrote maps and a manifest that nothing read back (no load), and left out the token layout, the crop
    boxes and the label names that place and name the maps: a saved explanation could not be drawn again."""
    wide = [np.pad(im, ((0, 0), (16, 16), (0, 0)), mode="edge") for im in vx.data.shapes(n=2, seed=4).images]  # cropped
    e = vx.Explainer(vx.zoo.load(name)).explain(wide, method=method, target=target, **options)
    back = vx.Explanation.load(e.save(tmp_path / "e"))
    _same_explanation(back, e)
    assert back.images is None and back.logits is None
    torch.testing.assert_close(back.upsample((40, 56)), e.upsample((40, 56)).cpu())
    for i in range(2):  # the map on the original image (its crop) and on the region the model saw
        np.testing.assert_array_equal(back.overlay(i, image=wide[i]), e.overlay(i, image=wide[i]))
        np.testing.assert_array_equal(back.overlay(i, image=e.images[i]), e.overlay(i))


def test_a_callable_targets_score_name_survives_save_and_load(tmp_path):
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    e = ex.explain(vx.data.shapes(n=2, seed=3).tensor, method="cdam", target=vx.targets.norm())
    back = vx.Explanation.load(e.save(tmp_path / "e"))
    _same_explanation(back, e)
    assert back.target_names() == e.target_names() == ["score norm"] * 2


def test_a_saved_caption_explanation_loads_back(tmp_path):
    """Its manifest left out ``signed`` (an LRP caption map loaded as unsigned would be drawn min-max) and the
    layout; read back it equals the original."""
    ex = vx.Explainer(vx.zoo.load("shapes-captioner"))
    e = ex.explain_caption(vx.data.shapes(n=2, seed=3).tensor, method="cross", max_len=4)
    back = CaptionExplanation.load(e.save(tmp_path / "c"))
    torch.testing.assert_close(back.maps, e.maps.cpu(), rtol=0, atol=0)
    assert torch.equal(back.ids, e.ids.cpu()) and back.tokens == e.tokens and back.captions == e.captions
    assert (back.method, back.signed, back.layout, tuple(back.input_size)) == \
        (e.method, e.signed, e.layout, tuple(e.input_size))


def test_loading_what_is_not_a_saved_explanation_says_what_to_pass(tmp_path):
    with pytest.raises(vx.UsageError, match="no maps.npy or manifest.json there"):
        vx.Explanation.load(tmp_path)
    e = vx.Explainer(vx.zoo.load("shapes-vit")).explain(vx.data.shapes(n=1, seed=3).tensor, method="raw")
    with pytest.raises(vx.UsageError, match="holds an image explanation: read it with Explanation.load"):
        CaptionExplanation.load(e.save(tmp_path / "e"))
    (tmp_path / "e" / "manifest.json").write_text("{not json")
    with pytest.raises(vx.UsageError, match="cannot load an explanation"):
        vx.Explanation.load(tmp_path / "e")
    with pytest.raises(vx.UsageError, match="load needs a folder path"):
        vx.Explanation.load(None)


class Wrapper(nn.Module):
    """A user's model around a known one: the normalisation, then the backbone."""

    def __init__(self, backbone):
        super().__init__()
        self.normalize, self.backbone = Normalize(), backbone

    def forward(self, x):
        return self.backbone(self.normalize(x))


@pytest.mark.parametrize("wrap, where", [(lambda m: nn.Sequential(Normalize(), m), r"model\[1\]"),
                                         (Wrapper, r"model\.backbone")])
def test_a_wrapped_vit_is_refused_naming_the_model_to_explain(x, wrap, where):
    """nn.Sequential(normalize, vit) was refused with the list of every supported family, as if the ViT inside were
    unknown: the refusal names the child to explain, and that explains."""
    vit = vx.zoo.load("shapes-vit")
    with pytest.raises(vx.UnsupportedModelError, match=rf"child .* is a vit model \(VisionTransformer\).*"
                                                       rf"vx.Explainer\({where}\), on the input"):
        vx.Explainer(wrap(vit))
    assert vx.Explainer(vit).explain(x, method="generic").maps.shape == (2, 8, 8)


def test_an_rgba_or_one_channel_array_is_refused_saying_how_to_pass_it(tmp_path):
    """(H, W, 4) and (H, W, 1) uint8 arrays were refused without a hint (a 2-D one got one); what the hint says to
    pass is explained as the image file is."""
    from PIL import Image

    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    rgb = vx.data.shapes(n=1, seed=3).images[0]
    rgba = np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), 128, np.uint8)], axis=2)
    with pytest.raises(vx.UsageError, match=r"RGBA\? pass PIL.Image.fromarray\(x\).*or drop it: x\[..., :3\]"):
        ex.explain(rgba, method="raw")
    with pytest.raises(vx.UsageError, match=r"grayscale\? use np.repeat\(x, 3, axis=2\)"):
        ex.explain(rgb[..., :1], method="raw")
    Image.fromarray(rgba).save(tmp_path / "a.png")
    from_file = ex.explain(str(tmp_path / "a.png"), method="raw").maps
    torch.testing.assert_close(ex.explain(Image.fromarray(rgba), method="raw").maps, from_file, rtol=0, atol=0)


def test_a_re_run_that_differs_in_training_mode_says_so():
    """A Swin in training mode (drop path 0.1 by default) was refused for CDAM with 'the partial forward does not
    reproduce the model's outputs' and a list of adapters to write; the cause is the training mode."""
    from timm.models.swin_transformer import SwinTransformer

    model = SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1), num_heads=(1, 2),
                            num_classes=3, drop_path_rate=0.5).train()
    with pytest.warns(UserWarning, match="training mode"), \
            pytest.raises(vx.UnsupportedModelError, match=r"'cdam' re-runs part of SwinTransformer.*does not "
                                                          r"reproduce.*in training mode.*drop_path.*model.eval\(\)"):
        vx.Explainer(model).explain(torch.rand(2, 3, 32, 32), method="cdam")
    assert vx.Explainer(model.eval()).explain(torch.rand(2, 3, 32, 32), method="cdam").maps.shape == (2, 4, 4)


def test_an_explanation_given_to_a_metric_is_told_which_tensor_to_pass():
    """vx.metrics took an Explanation and said only 'must be a torch.Tensor or a NumPy array'; the advice given
    (e.upsample at the masks' size) scores as its maps do when the cells cover the image exactly."""
    e = vx.Explainer(vx.zoo.load("shapes-vit")).explain(vx.data.shapes(n=2, seed=3).tensor, method="generic")
    masks = torch.zeros(2, 64, 64, dtype=torch.bool)
    masks[:, 8:40, 16:48] = True
    with pytest.raises(vx.InputError, match=r"got an Explanation: pass e.upsample\(\(H, W\)\)"):
        vx.metrics.pointing_game(e, masks)
    assert torch.equal(vx.metrics.pointing_game(e.upsample((64, 64)), masks), vx.metrics.pointing_game(e.maps, masks))


def test_one_method_takes_its_options_per_method_as_several_do(x):
    """method="rollout", rollout={...} (the per-method form the guide gives for several methods) was refused with
    "rollout has no option 'rollout'"; it is the same call as the options given directly."""
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    got = ex.explain(x, method="rollout", rollout={"discard_ratio": 0.9, "head_fusion": "max"})
    want = ex.explain(x, method="rollout", discard_ratio=0.9, head_fusion="max")
    torch.testing.assert_close(got.maps, want.maps, rtol=0, atol=0)
    assert got.options == want.options and want.options["discard_ratio"] == 0.9
    assert ex.plan("rollout", rollout={"discard_ratio": 0.9}).steps[0].options["discard_ratio"] == 0.9
    with pytest.raises(vx.OptionError, match="rollout has no option 'generic'"):
        ex.explain(x, method="rollout", generic={})


def test_a_module_given_as_an_option_is_refused_in_a_line_naming_what_to_pass(x):
    """module=model.layer4 (the module, not its name) was refused with the module's repr in the message: the whole
    network printed, thousands of lines for a large model."""
    model = vx.zoo.load("shapes-cnn")
    ex = vx.Explainer(model)
    with pytest.raises(vx.OptionError, match=r"got a Sequential module \(pass its name.*module='layer4'\)") as info:
        ex.explain(x, method="gradcam", module=model.layer4)
    assert len(str(info.value)) < 300 and "\n" not in str(info.value)
    with pytest.raises(vx.OptionError, match=r"got a list \(\[0, 0, 0"):
        vx.Explainer(vx.zoo.load("shapes-vit")).explain(x, method="raw", layer=[0] * 1000)


def _captured_with_pool_input(model: nn.Module, x: torch.Tensor):
    """(the capture's recorder, the (B, N, D) tokens the model's ``attn_pool`` head received) of one forward of x."""
    seen = {}
    handle = model.attn_pool.register_forward_pre_hook(lambda m, args: seen.update(tokens=args[0].detach()))
    try:
        with vx.capture(model) as rec:
            model(x)
    finally:
        handle.remove()
    return rec, seen["tokens"]


def test_an_attention_pooling_head_over_the_patch_tokens_only_is_read_with_the_class_token_at_zero():
    """timm's ViT with global_pool='map' and a class token drops the prefix tokens before its pooling head
    (pool_include_prefix=False, the default): the head's attention row has the patch keys only, and raw, rollout,
    grad_rollout and generic raised torch's 'size of tensor a (16) must match ... (17)'. Oracle: raw of the last
    layer is the head's attention row (computed here from its weights, the class token given 0) times the last
    block's attention, read at the patch keys."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              global_pool="map").eval()
    x = torch.rand(2, 3, 32, 32)
    rec, tokens = _captured_with_pool_input(model, x)  # tokens (B, 16, D): the patch tokens only
    pool = model.attn_pool
    b, n, d = tokens.shape
    q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, 1, pool.num_heads, -1).transpose(1, 2)
    k = pool.kv(tokens).reshape(b, n, 2, pool.num_heads, -1).permute(2, 0, 3, 1, 4)[0]
    row = torch.softmax(q @ k.transpose(-2, -1) * pool.scale, dim=-1).mean(dim=1)[:, 0]  # (B, 16)
    row = torch.cat([torch.zeros(b, 1), row], dim=1)  # the class token: not read by the head
    last = [r for r in rec.records if r.name == "blocks.1.attn"][0].probs().mean(dim=1)  # (B, 17, 17)
    want = torch.bmm(row.unsqueeze(1), last).squeeze(1)[:, 1:].reshape(b, 4, 4)
    ex = vx.Explainer(model)
    torch.testing.assert_close(ex.explain(x, method="raw").maps, want, rtol=1e-5, atol=1e-6)
    for e in ex.explain(x, method=["rollout", "grad_rollout", "generic"]):
        assert e.maps.shape == (2, 4, 4) and torch.isfinite(e.maps).all() and float(e.maps.abs().max()) > 0


def test_average_pooling_that_includes_the_prefix_tokens_reads_every_token():
    """timm's ViT with global_pool='avg' and pool_include_prefix=True averages the class and register tokens with
    the patches, but the maps read the mean over the patch queries only: silently another readout than the head's.
    Oracle: raw of the last layer is the mean over every query row of its head-mean attention, at the patch keys."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              global_pool="avg", pool_include_prefix=True, reg_tokens=2).eval()
    x = torch.rand(2, 3, 32, 32)
    with vx.capture(model) as rec:
        model(x)
    last = [r for r in rec.records if r.name == "blocks.1.attn"][0].probs().mean(dim=1)  # (B, 19, 19)
    want = last.mean(dim=1)[:, 3:].reshape(2, 4, 4)
    e = vx.Explainer(model).explain(x, method="raw")
    assert e.layout.readout == "all"
    torch.testing.assert_close(e.maps, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool_type", ["token", "avg"])
@pytest.mark.parametrize("prefix", [True, False])
def test_a_prr_pooling_head_is_read_through_its_attention(pool_type, prefix):
    """timm's ViT with global_pool='prr' (a parameter-free self-attention over the tokens, the class token with them
    or not, then its first token or the mean) was read with the patch mean as readout, silently another row than the head's. Oracle: raw
    of the last layer is the head's attention row (query 0, or the mean over its queries; computed here from its
    input) times the last block's attention, read at the patch keys."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              global_pool="prr", pool_include_prefix=prefix).eval()
    model.attn_pool.pool = pool_type
    x = torch.rand(2, 3, 32, 32)
    rec, tokens = _captured_with_pool_input(model, x)
    pool = model.attn_pool
    b, n, _ = tokens.shape
    qkv = pool.pre_norm(tokens).reshape(b, n, pool.num_heads, pool.head_dim).transpose(1, 2)
    attn = torch.softmax(qkv * pool.scale @ qkv.transpose(-2, -1), dim=-1).mean(dim=1)  # (B, 16, 16)
    row = attn[:, 0] if pool_type == "token" else attn.mean(dim=1)
    if n == 16:  # the class token dropped before the head (pool_include_prefix=False)
        row = torch.cat([torch.zeros(b, 1), row], dim=1)
    last = [r for r in rec.records if r.name == "blocks.1.attn"][0].probs().mean(dim=1)
    want = torch.bmm(row.unsqueeze(1), last).squeeze(1)[:, 1:].reshape(b, 4, 4)
    e = vx.Explainer(model).explain(x, method="raw")
    assert e.layout.readout == "pool"
    torch.testing.assert_close(e.maps, want, rtol=1e-5, atol=1e-6)
