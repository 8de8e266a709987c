"""Integrated Gradients says how well its integral converged (completeness, Sundararajan et al. 2017).

IG's attributions of an image sum to y(x) - y(baseline) when the path integral is exact (Proposition 1
there); captum approximates it with ``steps`` Gauss-Legendre points, and on a sharply nonlinear model with
few points the sum can be far off, so the map means little. The explanation carries, per image, the
signed gap ``delta`` (captum's convergence delta: sum of attributions - (y(x) - y(baseline))), the change
``score_change`` and ``completeness_error`` = |delta| / |y(x) - y(baseline)|, and warns once per call
naming the images over :data:`COMPLETENESS_RTOL`. The oracles: an affine model, where one point is exact
in closed form; a smooth float64 model with many points; and, for a badly converged case, the score
difference computed here with plain model calls against the sum of the returned map.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx
from vitexplain.errors import ConvergenceWarning
from vitexplain.methods.captum_methods import COMPLETENESS_RTOL

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=6)


def _x(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def _change(model: nn.Module, x: torch.Tensor, targets: torch.Tensor, baseline: float) -> torch.Tensor:
    """(B,) y(x) - y(baseline) of the explained classes, by plain forwards."""
    rows = torch.arange(x.shape[0])
    with torch.no_grad():
        return model(x)[rows, targets] - model(torch.full_like(x, baseline))[rows, targets]


def test_affine_model_one_point_is_exact_and_silent():
    """A ViT whose block adds nothing (attention and MLP outputs zeroed: the residual passes the tokens on),
    without final norms and with average pooling, is affine in the pixels: the gradient is the same at every
    point of the path, so IG with one point is exact and the completeness error is rounding."""
    torch.manual_seed(0)
    model = VisionTransformer(**CFG, global_pool="avg").eval()
    model.norm, model.fc_norm = nn.Identity(), nn.Identity()  # (avg pooling: timm norms after pooling)
    with torch.no_grad():
        for lin in (model.blocks[0].attn.proj, model.blocks[0].mlp.fc2):
            lin.weight.zero_()
            lin.bias.zero_()
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        e = vx.Explainer(model).explain(x, method="integrated_gradients", steps=1, baseline=0.3)
    change = _change(model, x, e.targets, 0.3)
    assert float(change.abs().min()) > 1e-3  # (a real change to be complete about)
    torch.testing.assert_close(e.extras["score_change"].float(), change, rtol=1e-5, atol=1e-6)
    assert e.extras["completeness_error"].shape == (3,)
    assert float(e.extras["completeness_error"].max()) < 1e-4, e.extras
    assert float(e.extras["delta"].abs().max()) < 1e-4 * float(change.abs().max())


def test_smooth_float64_model_converges():
    """A float64 ViT (GELU, softmax, LayerNorm: analytic along the path) with 48 Gauss-Legendre points: the
    quadrature has converged (16 points leave ~5e-5), and the reported error says so: what is left is captum's
    quadrature weights, which it casts to float32 (~1e-7 relative here)."""
    torch.manual_seed(1)
    model = VisionTransformer(**{**CFG, "depth": 2}).double().eval()
    x = _x(2).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = vx.Explainer(model).explain(x, method="integrated_gradients", steps=48)
    change = _change(model, x, e.targets, 0.0)
    torch.testing.assert_close(e.extras["score_change"], change, rtol=1e-12, atol=1e-12)
    assert float(e.extras["completeness_error"].max()) < 1e-6, e.extras


def test_two_points_on_a_sharp_model_report_the_gap_and_warn():
    """Sharpened attention and a large head: two points miss the integral. The error reported is the one
    computed here from the map's sum and plain forwards, and one warning names the images over the
    threshold and says to raise ``steps``."""
    torch.manual_seed(1)
    model = VisionTransformer(**{**CFG, "depth": 3}).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(4.0)
        model.head.weight.mul_(8.0)
    x = _x(4)
    with pytest.warns(ConvergenceWarning) as caught:
        e = vx.Explainer(model).explain(x, method="integrated_gradients", steps=2)
    change = _change(model, x, e.targets, 0.0)
    want = (e.maps.flatten(1).sum(1) - change).abs() / change.abs()
    assert float(want.max()) > COMPLETENESS_RTOL  # (the case is badly converged)
    torch.testing.assert_close(e.extras["completeness_error"].float(), want, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(e.extras["delta"].float(), e.maps.flatten(1).sum(1) - change, rtol=1e-3, atol=1e-4)
    ours = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert len(ours) == 1  # once per call, whatever the batch
    bad = [i for i in range(4) if float(want[i]) > COMPLETENESS_RTOL]
    message = str(ours[0].message)
    assert f"image(s) {bad}" in message and "steps" in message, message
    # more points: the same images converge, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fine = vx.Explainer(model).explain(x, method="integrated_gradients", steps=64)
    assert float(fine.extras["completeness_error"].max()) < COMPLETENESS_RTOL


def test_the_cli_writes_each_images_completeness_error_and_warns_once_per_run(tmp_path, capsys):
    """``vitexplain export --method integrated_gradients``: every image's record carries its completeness error
    (the API's, for that image alone), and the warning, whose text names positions in a batch, is said once per
    run (it was once per batch: the CLI says each distinct warning once)."""
    import json

    from batch_helpers import images, run, save_tiny

    ckpt = save_tiny(tmp_path / "ckpt")
    src = images(tmp_path / "in", [f"{i}.png" for i in range(6)])
    out = tmp_path / "out"
    assert run("export", src, "--out", out, "--model", ckpt, "--method", "integrated_gradients", "-j", "0",
               "--batch-size", "2", "--option", "integrated_gradients.steps=2") == 0
    err = capsys.readouterr().err
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    errors = {r["key"]: r["completeness_error"]["integrated_gradients"] for r in records}
    assert len(errors) == 6 and sum(e > COMPLETENESS_RTOL for e in errors.values()) >= 2  # (several batches warn)
    assert all(r["steps"] == {"integrated_gradients": 2} for r in records)  # (the steps asked for, each image)
    assert err.count("ConvergenceWarning") == 1 and "manifest.jsonl" in err
    explainer = vx.Explainer(vx.zoo.load_checkpoint(ckpt))
    for key, value in errors.items():
        e = explainer.explain([str(src / key)], method="integrated_gradients", steps=2)
        assert value == pytest.approx(float(e.extras["completeness_error"][0]), rel=1e-4, abs=1e-6)


def test_the_cli_default_writes_the_steps_each_image_got(tmp_path, capsys):
    """``vitexplain export`` without ``steps`` on the bundled shapes-vit: each record carries the steps the automatic
    default gave that image (the API's, for that image alone) and a completeness error within 5%. The images are
    those of tests/test_ig_auto_steps.py (shapes seed 4; written as PNG they measure the same): images 0 and 3 need
    64 steps (10.3% and 8.5% at 32), the others 32, so each batch of 2 mixes counts; nothing is left to warn about."""
    import json

    from batch_helpers import images, run
    from vitexplain.methods.captum_methods import AUTO_STEPS

    src = images(tmp_path / "in", [f"{i}.png" for i in range(4)], seed=4)
    out = tmp_path / "out"
    assert run("export", src, "--out", out, "--model", "shapes-vit", "--method", "integrated_gradients", "-j", "0",
               "--batch-size", "2") == 0
    assert "ConvergenceWarning" not in capsys.readouterr().err
    records = {r["key"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    explainer = vx.Explainer(vx.zoo.load("shapes-vit"))
    for key, r in records.items():
        e = explainer.explain([str(src / key)], method="integrated_gradients")
        assert r["steps"] == {"integrated_gradients": int(e.extras["steps"][0])}
        assert r["completeness_error"]["integrated_gradients"] <= COMPLETENESS_RTOL
    assert records["0.png"]["steps"]["integrated_gradients"] > AUTO_STEPS[0]
    assert records["3.png"]["steps"]["integrated_gradients"] > AUTO_STEPS[0]
