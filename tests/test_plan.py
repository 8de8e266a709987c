"""One plan decides what runs: every entry point asks it, and it keeps its promises.

Checked against what the models actually do: a method the plan lists runs (its maps are one
per image), a method it refuses says why and is refused with the same reason by explain(),
the CLI's `methods --model` prints the plan's answer, and an explanation whose maps are not
one per image cannot exist.
"""

from __future__ import annotations

import pytest
import torch

import vitexplain as vx
from vitexplain import cli
from vitexplain.methods import CAPTION, CNN, SWIN, VIT, Option, registry
from vitexplain.plan import UnusedTargetWarning


@pytest.fixture(scope="module")
def resnet():
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=4).eval()  # no attention gates


@pytest.fixture(scope="module")
def vit():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()


def test_families_are_objects_with_one_tuple_of_defaults():
    assert [f.name for f in vx.methods.families()][:4] == ["vit", "swin", "cnn", "caption"]
    for fam in (VIT, SWIN, CNN, CAPTION):
        assert isinstance(fam.defaults, tuple) and fam.defaults
        assert set(fam.defaults) <= set(vx.methods.names(fam))  # defaults are registered methods
        assert vx.methods.family(fam.name) is fam
    assert CAPTION.entry == "explain_caption" and VIT.entry == "explain"
    with pytest.raises(vx.NotFoundError, match="no model family 'nope'"):
        vx.methods.family("nope")


def test_plan_of_defaults_skips_what_does_not_apply_and_says_why(resnet):
    plan = vx.Explainer(resnet).plan()
    assert plan.family is CNN and not plan.named
    assert plan.names == ["gradcam"]  # spatial and channel need gates this ResNet lacks
    assert set(plan.skipped) == {"spatial", "channel"}
    assert all("no channel/spatial attention-gate module" in why for why in plan.skipped.values())
    assert set(plan.refused) == {"spatial", "channel"} and list(plan.available) == ["gradcam", "gradcam++", "layercam"]
    # explain() refuses a refused method with the plan's own reason
    with pytest.raises(vx.UnsupportedMethodError, match="does not apply .* no channel/spatial attention-gate"):
        vx.Explainer(resnet).explain(torch.randn(1, 3, 32, 32), method="spatial")


def test_the_plan_checks_options_and_settles_the_capture(vit):
    ex = vx.Explainer(vit)
    plan = ex.plan(method=["rollout", "cdam"], rollout={"discard_ratio": 0.5})
    assert plan.names == ["rollout", "cdam"] and plan.step("rollout").options == {"discard_ratio": 0.5}
    assert plan.capture.grads and plan.capture.attention and ex.adapter.norm1 in plan.capture.activations
    assert not ex.plan(method="rollout").capture.grads
    with pytest.raises(vx.OptionError, match="not among the methods run"):
        ex.plan(method=["rollout"], cdam={})
    with pytest.raises(vx.OptionError, match="per method as name="):
        ex.plan(method=["rollout", "cdam"], discard_ratio=0.5)
    with pytest.raises(vx.UsageError, match="method must be a method name"):
        ex.plan(method=[3])
    for bad in (3, 2.5, None.__class__):  # not a name nor a list of names: a TypeError escaped for 3
        with pytest.raises(vx.UsageError, match="method must be a method name"):
            ex.plan(method=bad)
    assert ex.plan(method=iter(["rollout", "cdam"])).names == ["rollout", "cdam"]  # any iterable of names


def test_default_method_of_each_entry_point(vit, resnet):
    x = torch.randn(2, 3, 32, 32)
    e = vx.Explainer(vit).explain(x)  # method=None: the family's first default that applies
    assert e.method == VIT.defaults[0] and e.maps.shape == (2, 4, 4)
    e = vx.Explainer(resnet).explain(x)  # the default used to be 'cdam', which fails on every CNN
    assert e.method == "gradcam" and e.maps.shape[0] == 2


def test_an_explanation_holds_one_map_per_image():
    maps = torch.zeros(48, 4, 4)
    with pytest.raises(vx.CaptureError, match=r"shape \(48, 4, 4\) for a batch of 3 images"):
        vx.Explanation(maps=maps, targets=torch.zeros(3, dtype=torch.long), method="gradcam", options={},
                       logits=None, signed=False, input_size=(32, 32))
    with pytest.raises(vx.CaptureError, match="one map per image"):
        vx.results.CaptionExplanation(maps=torch.zeros(2, 3, 4, 4), tokens=[["a"]] * 3, ids=torch.zeros(3, 3),
                                      captions=["a"] * 3, method="cross", options={}, input_size=(32, 32))


def test_a_method_that_returns_maps_of_another_batch_is_an_error(vit):
    """The TNT bug class: a method reading a layer that mixes the batch with tokens."""

    def first_image_only(ctx):
        """test-only: returns one map whatever the batch"""
        return torch.zeros(1, 4, 4)

    registry.register("test_only_one_map", VIT, attention=False)(first_image_only)
    try:
        with pytest.raises(vx.CaptureError, match=r"shape \(1, 4, 4\) for a batch of 3 images"):
            vx.Explainer(vit).explain(torch.randn(3, 3, 32, 32), method="test_only_one_map")
    finally:
        del registry._REGISTRY[(VIT, "test_only_one_map")]
    assert "test_only_one_map" not in vx.methods.names()


def _tiny(name: str, **kwargs):
    import importlib

    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(**kwargs).eval()


@pytest.mark.parametrize("name, kwargs", [
    ("timm.models.tnt.TNT", dict(img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_outer=2,
                                  num_heads_inner=2, num_classes=3)),
    ("timm.models.crossvit.CrossVit", dict(img_size=(32, 32), img_scale=(1.0, 1.0), patch_size=(8, 16), embed_dim=(16, 32),
                                            depth=((1, 1, 0),), num_heads=(2, 2), mlp_ratio=(2.0, 2.0), num_classes=3)),
])
def test_models_whose_stages_mix_images_list_no_method_they_then_refuse(name, kwargs):
    """CrossViT used to list gradcam, gradcam++ and layercam and refuse all three at run time;
    TNT ran them and returned 48 maps for 3 images. What the plan lists must run, per image."""
    from vitexplain.plan import applicable

    model = _tiny(name, **kwargs)
    model.pretrained_cfg = dict(getattr(model, "pretrained_cfg", None) or {}, input_size=(3, 32, 32))
    ex = vx.Explainer(model)
    x = torch.randn(3, 3, 32, 32)
    available, refused = applicable(ex.adapter)
    assert available or refused
    for method in available:
        assert ex.explain(x, method=method).maps.shape[0] == 3, method
    for method, why in refused.items():
        assert why, method
        with pytest.raises(vx.UnsupportedMethodError, match="does not apply"):
            ex.explain(x, method=method)


def test_cli_methods_for_a_model_prints_what_its_plan_says(capsys):
    assert cli.main(["methods", "--model", "resnet10t"]) == 0
    out = capsys.readouterr().out
    applies, refused = out.split("Methods that do not apply")
    assert "gradcam" in applies and "spatial" not in applies and "channel" not in applies
    assert "spatial" in refused and "no channel/spatial attention-gate module" in refused
    assert cli.main(["methods", "--family", "nope"]) == 2
    assert "no model family 'nope'" in capsys.readouterr().err


def test_family_conventions_are_enforced_at_registration():
    with pytest.raises(vx.UsageError, match="in cnn methods 'module' is a string"):
        registry.register("test_only_bad_module", CNN, options={"module": Option(int)})(lambda ctx, *, module=0: None)
    assert "test_only_bad_module" not in vx.methods.names()


def test_a_target_given_only_to_class_agnostic_methods_is_said_to_change_nothing(tmp_path):
    """rollout/raw (and the CNN gates) read no class: a target given to them alone is named in a
    warning (the maps equal those of any other class), never when a method of the call reads it."""
    import warnings

    images = list(vx.data.shapes(2, seed=5).images)
    ex = vx.Explainer(vx.zoo.load("shapes-vit"))
    with pytest.warns(UnusedTargetWarning, match=r"rollout does not depend on the target class.*use .*generic"):
        with_target = ex.explain(images, method="rollout", target=3)
    with pytest.warns(UserWarning, match=r"rollout, raw do not depend on the target class"):
        ex.explain(images, method=["rollout", "raw"], target=[1, 2])
    with pytest.warns(UserWarning, match=r"spatial does not depend on the target class.*use gradcam"):
        vx.Explainer(vx.zoo.load("shapes-cnn")).explain(images, method="spatial", target=1)
    with warnings.catch_warnings():  # nothing to say: no target, or a method of the call reads it
        warnings.simplefilter("error")
        plain = ex.explain(images, method="rollout")
        ex.explain(images, method="rollout", target=vx.targets.norm())  # (a headless backbone needs one)
        both = ex.explain(images, method=["rollout", "generic"], target=3)
        vx.explore(ex.model, images[:1], tmp_path / "page.html", method=["rollout", "generic"], top_k=2)
    assert torch.equal(with_target.maps, plain.maps)
    torch.testing.assert_close(both[0].maps, plain.maps, rtol=1e-5, atol=1e-7)  # (fused kernel there: rounding)
    assert with_target.targets.tolist() == [3, 3]
