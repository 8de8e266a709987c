"""Integrated Gradients on a model whose score does not change along the straight path.

AIMv2 embeds each patch with a convolution and then RMS-normalises the patch's token; with the
convolution's bias at zero (Hugging Face's init, and any bias-free patch embedding) every token is
unchanged when its own pixels are scaled by a > 0. From the zero baseline the straight path
``a * x`` then leaves the score constant for a in (0, 1] but within about sqrt(eps) of 0 (RMSNorm's eps):
the whole change y(x) - y(0) happens before IG's first integration point, and by Euler's theorem
each patch's sum of ``x * dy/dx(a x)`` is ~0. Such maps are float rounding noise (a batch of 2 differed from each image
alone by 6.8e-4 of the maps' scale: noise of two different float32 kernels; in float64 they
agree). The oracle here is plain float64 autograd, no vitexplain code: it shows that the per-patch
sums vanish while the score changes, and vitexplain must refuse that baseline, not return noise.
From a non-zero baseline the path is not flat: IG is then the Gauss-Legendre oracle's, and a
batch equals its images alone to float32 rounding (float64: exactly).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.errors import UnsupportedMethodError

transformers = pytest.importorskip("transformers")

SIZE, PATCH = 32, 8
GRID = (SIZE // PATCH, SIZE // PATCH)


@pytest.fixture(scope="module", params=[True, False], ids=["pool_head", "mean"])
def aimv2(request) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Aimv2VisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=SIZE,
        patch_size=PATCH, use_head=request.param,
    )
    model = transformers.Aimv2VisionModel(config).eval()
    assert not bool(model.embeddings.patch_embed.bias.any())  # the init's zero bias: the case under test
    return model


def _embedding(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(pixel_values=x)
    return out.pooler_output if out.pooler_output is not None else out.last_hidden_state.mean(dim=1)


def _score(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _embedding(model, x).norm(dim=-1)  # what vx.targets.norm() scores


def _ig_oracle(model: torch.nn.Module, image: torch.Tensor, baseline: float, steps: int) -> torch.Tensor:
    """(gh, gw) IG per patch by Gauss-Legendre quadrature on [0, 1] (captum's default rule)."""
    nodes, weights = np.polynomial.legendre.leggauss(steps)
    base = torch.full_like(image, baseline)
    total = torch.zeros_like(image)
    for a, w in zip(((nodes + 1) / 2).tolist(), (weights / 2).tolist()):
        xa = (base + a * (image - base))[None].requires_grad_(True)
        (g,) = torch.autograd.grad(_score(model, xa)[0], xa)
        total += w * g[0]
    attr = ((image - base) * total).sum(0)
    return attr.reshape(GRID[0], PATCH, GRID[1], PATCH).sum(dim=(1, 3))


def test_zero_baseline_path_is_flat_so_ig_is_refused(aimv2):
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    m64 = copy.deepcopy(aimv2).double()
    with torch.no_grad():
        change = _score(m64, x.double()) - _score(m64, torch.zeros_like(x).double())
    for i in range(2):
        per_patch = _ig_oracle(m64, x[i].double(), 0.0, steps=3)
        # the score changes, but IG's per-patch sums are ~0 (only RMSNorm's eps keeps them off 0; a path
        # that is not flat gives sums that add up to about the change, completeness)
        assert float(per_patch.abs().sum()) < 0.05 * abs(float(change[i]))
    with pytest.raises(UnsupportedMethodError, match="baseline"):
        vx.Explainer(aimv2).explain(x, method="integrated_gradients", target=vx.targets.norm(), steps=3)


def test_non_zero_baseline_matches_the_oracle_and_a_batch_equals_its_images_alone(aimv2):
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    opts = dict(method="integrated_gradients", target=vx.targets.norm(), steps=3, baseline=0.5)
    ex = vx.Explainer(aimv2)
    together = ex.explain(x, **opts).maps
    alone = torch.cat([ex.explain(x[i : i + 1], **opts).maps for i in range(2)])
    m64 = copy.deepcopy(aimv2).double()
    ex64 = vx.Explainer(m64)
    together64 = ex64.explain(x.double(), **opts).maps
    alone64 = torch.cat([ex64.explain(x[i : i + 1].double(), **opts).maps for i in range(2)])
    scale = float(alone64.abs().max())
    # float64: the batch is its images alone (the maps come back as float32: equal after rounding)
    assert float((together64 - alone64).abs().max()) <= 1e-7 * scale
    oracle = torch.stack([_ig_oracle(m64, x[i].double(), 0.5, steps=3) for i in range(2)]).float()
    torch.testing.assert_close(alone64, oracle, atol=1e-6 * scale, rtol=1e-6)
    # float32: each of batch and alone is off the float64 maps by rounding only (measured <= 4e-7 of the
    # scale); the bound is 10x that, far below the 6.8e-4 of a flat path's noise
    for maps in (together, alone):
        assert float((maps - alone64).abs().max()) <= 4e-6 * scale
