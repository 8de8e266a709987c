"""CNNs and uses of the CNN family the other CNN tests do not cover (found by a sweep of timm, torchvision and
Hugging Face CNNs at random init: plans, every listed method, batches against their images one by one, non-square
and channels-last inputs, training mode, the model left as found):

- torchvision CNNs were given timm's default preprocessing (bicubic, 224 px, crop 0.875): torchvision's weights
  resize with bilinear interpolation, and Inception v3 was trained at 299 px (resize 342), so images passed as
  arrays or paths did not look like the ones the weights were trained on (adapters/tv_preprocess.py).
- A CNN in training mode that fails on an input size (torchvision Inception v3 with its auxiliary classifier, which
  runs in training only and needs a 17x17 map) got the model's bare "Output size is too small": the probe forwards
  that find a size it takes ran one image, and a training batch norm refuses one value per channel (the auxiliary
  classifier's 1x1 map), so no size was found to name.
- timm models with gradient checkpointing on (``set_grad_checkpointing(True)``, left on after fine-tuning): ResNet
  and EfficientNet run their stages through ``checkpoint_seq(..., flatten=True)``, which calls the blocks inside a
  stage directly, so the stage modules the Grad-CAM family reads never ran: every method the plan listed was
  refused ("module 'layer4' gave no tensor in the forward", "nothing captured is part of an autograd graph").
  A capture of activations now holds checkpointing off and puts it back (recording/checkpointing.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import torchvision
from PIL import Image

import vitexplain as vx
from cam_oracle import act_grad

# builder, keyword arguments (the 1000 ImageNet classes: the parameter count of torchvision's weights)
TV_PREPROCESS = {
    "inception_v3": dict(init_weights=False),  # resize 342, crop 299, bilinear
    "resnet18": {},  # resize 256, crop 224, bilinear
    "efficientnet_b0": {},  # resize 256, crop 224, bicubic
    "convnext_tiny": {},  # resize 236, crop 224, bilinear
}


@pytest.mark.parametrize("name", list(TV_PREPROCESS))
def test_torchvision_cnn_images_are_preprocessed_as_its_weights_transform_does(name):
    model = getattr(torchvision.models, name)(**TV_PREPROCESS[name]).eval()
    transform = torchvision.models.get_model_weights(name).DEFAULT.transforms()
    image = np.random.default_rng(3).integers(0, 255, (310, 420, 3), dtype=np.uint8)  # resampled: not square
    x = vx.Explainer(model).preprocess([image])[0]
    want = transform(Image.fromarray(image))[None]
    assert x.shape == want.shape, (x.shape, want.shape)
    torch.testing.assert_close(x, want, rtol=0, atol=1e-4)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_a_cnn_in_training_mode_that_refuses_a_size_names_the_size_it_takes():
    torch.manual_seed(0)
    model = torchvision.models.inception_v3(num_classes=5, aux_logits=True, init_weights=False).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match="training mode"):
        with pytest.raises(vx.InputError, match=r"does not take a 96x160 input .*runs on 299x299 images") as info:
            vx.Explainer(model).explain(torch.randn(2, 3, 96, 160), method="gradcam", target=[0, 1])
    assert isinstance(info.value.__cause__, RuntimeError)  # the model's own message is kept
    after = model.state_dict()  # the probes (training mode: batch-norm statistics) left the model as found
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert all(m.training for m in model.modules()) and _hooks(model) == 0
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def _cams(model, layer, x, classes):
    """Hand-written Grad-CAM and LayerCAM of ``layer`` (tests/cam_oracle.py), (B, h, w) each."""
    a, g = act_grad(model, layer, x, classes)
    return {"gradcam": (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0),
            "layercam": (g.clamp(min=0) * a).sum(1).clamp(min=0)}


@pytest.mark.parametrize("name", ["resnet18", "efficientnet_b0"])
def test_a_timm_cnn_with_gradient_checkpointing_on_is_explained_and_left_with_it_on(name):
    from support_table import reinit_heads

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5).eval()
    reinit_heads(model)  # (timm ResNets zero each block's last norm)
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    classes = torch.tensor([1, 3])
    ex = vx.Explainer(model)
    want = _cams(model, ex.adapter.target_layer, x, classes)  # checkpointing off
    model.set_grad_checkpointing(True)
    flags = {n: m.grad_checkpointing for n, m in model.named_modules() if hasattr(m, "grad_checkpointing")}
    assert any(flags.values())
    for method in ex.plan().available:  # every method the plan lists runs
        e = ex.explain(x, method=method, target=None if method == "channel" else classes)  # (channel: any class)
        assert e.maps.shape == (2, 2, 3) and bool(torch.isfinite(e.maps).all()), method
        if method in want:
            assert float(want[method].max()) > 0
            torch.testing.assert_close(e.maps, want[method], rtol=0, atol=1e-5 * float(want[method].max()))
    assert {n: m.grad_checkpointing for n, m in model.named_modules() if hasattr(m, "grad_checkpointing")} == flags
    assert _hooks(model) == 0 and all(p.grad is None for p in model.parameters())
