"""What fuzzing the CNN side found (models, sizes and layers the other CNN tests do not use), each
checked against an independent expectation: the advice of an error is followed and then works, a
map equals its formula on the model's own forward.
"""

from __future__ import annotations

import re

import pytest
import timm
import torch

import vitexplain as vx


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


# timm CNNs with self-attention blocks: each attention module takes only some feature-map sizes (BotNet's
# BottleneckAttn keeps relative positions for one grid, HaloNet's HaloAttn splits the map into fixed blocks,
# LambdaNet's strided LambdaLayer halves it with an average pool the shortcut does not match), and another size
# failed inside the model with a bare AssertionError or a tensor-size RuntimeError that named no size
SELF_ATTENTION = {
    # name: (build, a size it refuses, the size or multiple the error must give)
    "botnet26t built for 64": (lambda: timm.create_model("botnet26t_256", img_size=64, num_classes=5), (96, 64),
                               r"takes 64x64 images only"),
    "halonet26t": (lambda: timm.create_model("halonet26t", num_classes=5), (96, 160),
                   r"multiples of 256: .*e\.g\. to 256x256"),
    "lambda_resnet26t": (lambda: timm.create_model("lambda_resnet26t", num_classes=5), (48, 80),
                         r"multiples of 32: .*e\.g\. to 64x96"),
}


@pytest.mark.parametrize("name", list(SELF_ATTENTION))
def test_a_cnn_with_self_attention_refuses_a_size_it_does_not_take_and_the_size_it_names_works(name):
    build, size, advice = SELF_ATTENTION[name]
    torch.manual_seed(0)
    model = build().eval()
    ex = vx.Explainer(model)
    assert ex.family.name == "cnn" and "gradcam" in ex.methods()
    with pytest.raises(vx.InputError, match=rf"does not take a {size[0]}x{size[1]} input .*self_attn.*{advice}") as info:
        ex.explain(torch.randn(1, 3, *size), method="gradcam")
    assert _hooks(model) == 0 and not model.training
    suggested = tuple(int(s) for s in re.search(r"(\d+)x(\d+) images only|e\.g\. to (\d+)x(\d+)", str(info.value)).groups() if s)
    e = ex.explain(torch.randn(2, 3, *suggested), method="gradcam", target=[1, 3])  # the advice, followed, works
    assert e.maps.shape[0] == 2 and bool(torch.isfinite(e.maps).all())
    assert _hooks(model) == 0
