"""The method registry as a whole: fixed listing order, explicit (re)registration, declared
options checked the same way everywhere, and every registered method of every family run on a
model of its family: finite maps, batch of 3 == three batches of 1, and the model left exactly
as found after a normal run and after an exception inside its forward."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vitexplain as vx
from vitexplain.methods import Option, registry

# What `vx.methods.names(family)` lists, in this order (design.md's method list).
EXPECTED = {
    "vit": ["raw", "rollout", "grad_rollout", "generic", "attn_gradcam", "cdam", "gradcam", "cdam_smooth",
            "cdam_integrated", "legrad", "integrated_gradients", "occlusion", "smoothgrad", "attnlrp", "cp_lrp"],
    "cnn": ["spatial", "channel", "gradcam", "gradcam++", "layercam"],
    "caption": ["cross", "cross_generic", "attnlrp", "cp_lrp"],
    "vlm": ["cross", "cross_grad", "cross_generic"],
}
EXPECTED["swin"] = list(EXPECTED["vit"])  # the same methods, on windowed attention (methods/swin.py)
# through token resampling (methods/hier.py): no method that re-runs the model or reads the head per block
EXPECTED["hier"] = ["raw", "rollout", "grad_rollout", "generic", "cdam", "gradcam", "integrated_gradients", "occlusion",
                    "smoothgrad"]

# cheap settings for the methods that run many forwards
CHEAP: dict[str, dict[str, Any]] = {
    "cdam_smooth": {"samples": 3},
    "cdam_integrated": {"steps": 3},
    # the zero baseline: the tiny PVTv2's score (zero biases, a norm after each patch embedding) changes only before
    # the first of 3 points, which IG refuses (tests/test_ig_flat_path.py)
    "integrated_gradients": {"steps": 3, "baseline": 0.5},
    "smoothgrad": {"samples": 3},
}


def test_builtin_methods_listed_in_a_fixed_order_whatever_is_imported_first():
    for family, expected in EXPECTED.items():
        assert vx.methods.names(family)[: len(expected)] == expected
    code = (
        "import vitexplain.methods.caption, vitexplain.methods.cnn\n"
        "import vitexplain as vx\n"
        "print([vx.methods.names(f) for f in ('vit', 'cnn', 'caption')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([vx.methods.names(f) for f in ("vit", "cnn", "caption")])


def test_a_second_registration_raises_unless_override():
    original = registry.get("rollout", "vit")

    def mine(ctx, *, head_fusion: str = "mean", discard_ratio: float = 0.0, start_layer: int = 0):
        """my rollout"""

    listing = vx.methods.names()
    with pytest.raises(vx.UsageError, match="already registered.*override=True"):
        registry.register("rollout", vx.methods.VIT, options=dict(original.options))(mine)
    assert registry.get("rollout", "vit") is original
    try:
        registry.register("rollout", vx.methods.VIT, options=dict(original.options), override=True)(mine)
        assert registry.get("rollout", "vit").fn is mine
        assert vx.methods.names() == listing  # replacing keeps every family's order
        assert vx.methods.names("vit").index("rollout") == EXPECTED["vit"].index("rollout")
    finally:
        registry._REGISTRY[(vx.methods.VIT, "rollout")] = original
    assert registry.get("rollout", "vit") is original


def test_registration_requires_every_keyword_option_declared():
    def method(ctx, *, alpha: float = 0.5, beta: int = 2):
        """two options"""

    with pytest.raises(vx.UsageError, match=r"declare every keyword option.*\['alpha', 'beta'\].*\['alpha'\]"):
        registry.register("test_only_method", vx.methods.VIT, options={"alpha": Option(float)})(method)
    assert "test_only_method" not in vx.methods.names()


def test_an_option_that_breaks_the_family_convention_is_refused():
    def method(ctx, *, layer: str = "blocks.0"):
        """layer as a module name, where ViT methods take a block index"""

    with pytest.raises(vx.UsageError, match="'layer' is an integer"):
        registry.register("test_only_layer", vx.methods.VIT, options={"layer": Option(str)})(method)
    assert "test_only_layer" not in vx.methods.names()


def test_one_name_means_one_kind_of_option_in_every_family():
    """The vocabulary: an option name has one type (and optionality) in every method that takes it."""
    kinds: dict[str, set] = {}
    for spec in registry.specs():
        for name, option in spec.options.items():
            kinds.setdefault(name, set()).add((option.kind, option.sequence))
    mixed = {name: k for name, k in kinds.items() if len(k) > 1}
    assert not mixed, mixed


@pytest.mark.parametrize("spec", registry.specs(), ids=lambda s: f"{s.family}:{s.name}")
def test_every_declared_option_accepts_its_own_default(spec):
    assert set(spec.options) == set(spec.defaults)
    spec.check_options(dict(spec.defaults))  # the defaults pass their own declared ranges


@pytest.fixture(scope="module")
def vit() -> nn.Module:
    torch.manual_seed(1)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=6).eval()
    with torch.no_grad():  # sharpen the near-uniform attention of a random init
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4.0)
    return model


@pytest.mark.parametrize(
    "options, message",
    [
        ({"discard": 0.5}, "rollout has no option 'discard'; its options: head_fusion, discard_ratio, start_layer"),
        ({"discard_ratio": -3}, r"rollout option 'discard_ratio' must be a number in \[0, 1\); got -3"),
        ({"discard_ratio": 1.5}, r"must be a number in \[0, 1\); got 1.5"),
        ({"discard_ratio": float("nan")}, r"must be a number in \[0, 1\); got nan"),
        ({"head_fusion": "avg"}, "must be one of 'mean', 'max', 'min'; got 'avg'"),
        ({"start_layer": True}, r"must be an integer in \[0, inf\); got True"),
        ({"start_layer": 1.0}, r"must be an integer in \[0, inf\); got 1.0"),
    ],
)
def test_bad_options_are_option_errors_with_the_cli_message(vit, options, message):
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(vx.OptionError, match=message) as err:
        vx.Explainer(vit).explain(x, method="rollout", **options)
    assert isinstance(err.value, vx.VitexplainError) and isinstance(err.value, TypeError)
    # the same check, with the same message, is what the command line calls
    with pytest.raises(vx.OptionError) as direct:
        registry.get("rollout", "vit").check_options(options)
    assert str(direct.value) == str(err.value)


def test_index_options_are_checked_against_the_model(vit):
    x = torch.randn(1, 3, 32, 32)
    ex = vx.Explainer(vit)
    with pytest.raises(vx.OptionError, match=r"raw option 'layer' must be in \[-3, 2\] for this model \(3 layers\); got 3"):
        ex.explain(x, method="raw", layer=3)
    with pytest.raises(vx.OptionError, match=r"raw option 'head' must be in \[-2, 1\].*\(2 heads\); got -3"):
        ex.explain(x, method="raw", head=-3)
    torch.testing.assert_close(ex.explain(x, method="raw", layer=-1, head=-1).maps, ex.explain(x, method="raw", layer=2, head=1).maps)
    with pytest.raises(vx.OptionError, match="per method"):
        ex.explain(x, method=["rollout", "raw"], layer=1)


def test_non_finite_and_empty_inputs_are_input_errors(vit):
    ex = vx.Explainer(vit)
    x = torch.randn(3, 3, 32, 32)
    x[1, 0, 4, 4] = float("nan")
    x[2, 2, 0, 0] = float("inf")
    with pytest.raises(vx.InputError, match=r"NaN or infinite values \(images \[1, 2\]\)"):
        ex.explain(x, method="rollout")
    with pytest.raises(vx.InputError, match="empty"):
        ex.explain(torch.zeros(0, 3, 32, 32), method="cdam")
    with pytest.raises(vx.UsageError, match="no images"):
        ex.explain([], method="cdam")


def test_captioner_rejects_empty_batches_and_max_len_0():
    ex = vx.Explainer(vx.zoo.load("shapes-captioner"))
    x = vx.data.shapes(1, seed=5).tensor
    with pytest.raises(vx.UsageError, match="max_len must be a positive"):
        ex.explain_caption(x, max_len=0)
    with pytest.raises(vx.InputError, match="empty"):
        ex.explain_caption(x[:0])


# -- every registered method of every family -----------------------------------------------------

def _vit_case() -> tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(1)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=6).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4.0)
    return model, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2)), "blocks.2"


def _swin_case() -> tuple[nn.Module, torch.Tensor, str]:
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(1)
    model = SwinTransformer(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                            num_classes=6).eval()
    with torch.no_grad():
        model.head.fc.weight.normal_()
    return model, torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2)), "layers.1.blocks.1"


def _hier_case() -> tuple[nn.Module, torch.Tensor, str]:
    import timm

    torch.manual_seed(1)
    model = timm.create_model("pvt_v2_b0", pretrained=False, num_classes=6, embed_dims=(16, 32, 48, 64),
                              depths=(1, 2, 1, 1), num_heads=(1, 2, 2, 4)).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    return model, torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(2)), "stages.1.blocks.1"


def _cnn_case() -> tuple[nn.Module, torch.Tensor, str]:
    return vx.zoo.load("shapes-cnn"), vx.data.shapes(3, seed=9, num_objects=2).tensor, "layer4"


def _caption_case() -> tuple[nn.Module, torch.Tensor, str]:
    return vx.zoo.load("shapes-captioner"), vx.data.shapes(3, seed=9, num_objects=2).tensor, "layers.1"


_PROCESSORS: dict[int, Any] = {}  # a VLM case's processor, by id(model)


def _vlm_case() -> tuple[nn.Module, Any, str]:
    import vlm_helpers

    model, proc = vlm_helpers.llava()
    _PROCESSORS[id(model)] = proc
    images = vlm_helpers.images(2, ((32, 40), (30, 30), (36, 32)))
    with torch.no_grad():  # transformers installs its own output-capturing hooks on a model's first call
        model(**proc(images=images[:1], text=["<image>a"], return_tensors="pt"))
    return model, images, "model.language_model.layers.1"


CASES: dict[str, Callable[[], tuple[nn.Module, Any, str]]] = {
    "vit": _vit_case, "swin": _swin_case, "hier": _hier_case, "cnn": _cnn_case, "caption": _caption_case,
    "vlm": _vlm_case,
}
_BUILT: dict[str, tuple[nn.Module, torch.Tensor, str]] = {}


def _case(family: str) -> tuple[nn.Module, torch.Tensor, str]:
    if family not in _BUILT:
        _BUILT[family] = CASES[family]()
    return _BUILT[family]


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything an explanation could leave changed on a model or on torch's globals."""
    from torch.nn.modules import module as torch_module

    modules = list(model.named_modules())
    return {
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks),
                   len(m._backward_pre_hooks)) for n, m in modules],
        "global_hooks": (len(torch_module._global_forward_hooks), len(torch_module._global_forward_pre_hooks),
                         len(torch_module._global_backward_hooks)),
        "training": [m.training for _, m in modules],
        "flags": [(getattr(m, "fused_attn", None), getattr(m, "_qkv_same_embed_dim", None)) for _, m in modules],
        "patched_forward": [n for n, m in modules if "forward" in m.__dict__],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grad_is_none": [p.grad is None for p in model.parameters()],
        "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
        "function_modes": torch._C._len_torch_function_stack(),
        "grad_enabled": torch.is_grad_enabled(),
    }


def _explain(model: nn.Module, family: str, x: torch.Tensor, name: str) -> torch.Tensor:
    options = CHEAP.get(name, {})
    if family == "vlm":  # images and a prompt; per image its words' maps at the original resolution
        e = vx.Explainer(model, processor=_PROCESSORS[id(model)]).explain_caption(x, method=name, prompt="what is",
                                                                                  max_len=3)
        return [m[: len(words)] for m, words in zip(e.image_maps, e.tokens)]
    ex = vx.Explainer(model)
    if family == "caption":
        e = ex.explain_caption(x, method=name, **options)
        return [e.maps[i, : len(words)] for i, words in enumerate(e.tokens)]
    return ex.explain(x, method=name, **options).maps


ALL = [(family, name) for family in EXPECTED for name in vx.methods.names(family)]


@pytest.mark.parametrize("family, name", ALL, ids=[f"{f}:{n}" for f, n in ALL])
def test_every_method_is_finite_batch_invariant_and_leaves_the_model_as_found(family, name):
    model, x, deep = _case(family)
    before = _state(model)
    batch = _explain(model, family, x, name)
    singles = [_explain(model, family, x[i : i + 1], name) for i in range(len(x))]
    assert _state(model) == before
    if family in ("caption", "vlm"):
        for i, single in enumerate(singles):
            assert torch.isfinite(batch[i]).all()
            torch.testing.assert_close(batch[i], single[0], rtol=1e-4, atol=1e-5)
        return
    assert torch.isfinite(batch).all() and batch.shape[0] == x.shape[0]
    assert float(batch.std()) > 0, "a constant map explains nothing"
    torch.testing.assert_close(batch, torch.cat(singles), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family, name", ALL, ids=[f"{f}:{n}" for f, n in ALL])
@pytest.mark.parametrize("fail_at_call", [0, 1])
def test_every_method_leaves_the_model_as_found_after_an_exception_in_its_forward(family, name, fail_at_call):
    # fail_at_call 0: the explained forward raises; 1: a later forward raises (methods that
    # re-run the model or part of it), or nothing does and the method completes
    model, x, deep = _case(family)
    before = _state(model)
    calls = {"n": 0}

    def boom(module: nn.Module, args: Any, output: Any) -> None:
        calls["n"] += 1
        if calls["n"] == fail_at_call + 1:
            raise RuntimeError("boom inside the forward")

    handle = model.get_submodule(deep).register_forward_hook(boom)
    try:
        if fail_at_call == 0:
            with pytest.raises(RuntimeError, match="boom inside the forward"):
                _explain(model, family, x[:1], name)
        else:
            try:
                _explain(model, family, x[:1], name)
            except RuntimeError as err:
                assert "boom inside the forward" in str(err)
    finally:
        handle.remove()
    assert _state(model) == before
