"""vx.viz.attention_matrix / record_matrix / caption_matrix / head_grid: geometry, labels, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vitexplain as vx
from vitexplain.viz.colormaps import colormap_lut

timm = pytest.importorskip("timm")
from timm.models.deit import VisionTransformerDistilled  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402


def hot_square(fig: np.ndarray, colormap: str = "viridis") -> tuple[int, int, int, int]:
    """Bounding box (y0, x0, y1, x1) of the top colour of the map, left of the colour bar."""
    top = colormap_lut(colormap)[255]
    ys, xs = np.nonzero((fig == top).all(-1))
    left = xs < xs.max() - 20  # the colour bar is the right-most run of that colour
    return ys[left].min(), xs[left].min(), ys[left].max() + 1, xs[left].max() + 1


@pytest.mark.parametrize("shape", [(3, 4), (64, 64), (100, 7)])
def test_cells_sit_where_their_entries_are(shape):
    rows, cols = shape
    w = torch.zeros(rows, cols)
    w[1, 2] = 1.0
    fig = vx.viz.attention_matrix(w, cell=6)
    assert fig.dtype == np.uint8 and fig.ndim == 3 and fig.shape[2] == 3
    y0, x0, y1, x1 = hot_square(fig)
    assert (y1 - y0, x1 - x0) == (6, 6)  # exactly one cell
    w2 = torch.zeros(rows, cols)
    w2[0, 3] = 1.0  # one row up, one column right
    y0b, x0b, _, _ = hot_square(vx.viz.attention_matrix(w2, cell=6))
    assert (y0 - y0b, x0b - x0) == (6, 6)


def test_every_label_fits_up_to_64_and_thins_beyond():
    labels = [f"token{i}" for i in range(64)]
    fig64 = vx.viz.attention_matrix(torch.rand(64, 64), labels, labels, "64 x 64")
    # default cells are at least as tall as a label, so the 64 row labels need >= 64 * 13 px
    assert fig64.shape[0] > 64 * 13
    big = vx.viz.attention_matrix(torch.rand(300, 300))
    assert max(big.shape[:2]) < 1400  # cells shrink beyond 64 (labels are thinned, not piled up)
    with pytest.raises(ValueError, match="3 row labels for 4"):
        vx.viz.attention_matrix(torch.rand(4, 2), ["a", "b", "c"], ["x", "y"])
    with pytest.raises(ValueError, match="2-D"):
        vx.viz.attention_matrix(torch.rand(2, 3, 4))


def test_token_labels_name_prefix_tokens_and_patches():
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, reg_tokens=2)
    layout = vx.token_layout(vit, (32, 32))
    labels = vx.viz.token_labels(layout)
    assert labels[:4] == ["[CLS]", "reg0", "reg1", "(0,0)"] and labels[-1] == "(3,3)" and len(labels) == 19
    deit = VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    assert vx.viz.token_labels(vx.token_layout(deit, (32, 32)), distilled=True)[:3] == ["[CLS]", "[DIST]", "(0,0)"]
    assert vx.viz.token_labels(layout, 5) == ["0", "1", "2", "3", "4"]  # not this layout's tokens


def test_record_caption_and_head_grid_figures():
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad(), vx.capture(vit) as rec:
        vit(x)
    record = rec.records[-1]
    layout = rec.layout
    fig = vx.viz.record_matrix(record, index=1, head=1, layout=layout)
    labels = vx.viz.token_labels(layout)
    expected = vx.viz.attention_matrix(record.probs()[1, 1], labels, labels, "blocks.1.attn (self, head 1)")
    np.testing.assert_array_equal(fig, expected)
    mean = vx.viz.record_matrix(record, layout=layout)
    np.testing.assert_array_equal(
        mean, vx.viz.attention_matrix(record.probs()[0].mean(0), labels, labels, "blocks.1.attn (self, heads mean)")
    )
    with pytest.raises(vx.UsageError, match="2 heads"):
        vx.viz.record_matrix(record, head=5)
    grid = vx.viz.head_grid(rec.records, layout, tile=32)
    assert grid.shape[0] > 2 * 32 and grid.shape[1] > 2 * 32  # 2 layers x 2 heads of 32 px tiles
    with pytest.raises(ValueError, match="none of the"):
        vx.viz.head_grid(rec.records, vx.token_layout(vit, (64, 64)))

    from vitexplain.explainer import CaptionExplanation

    maps = torch.rand(1, 3, 2, 2)
    e = CaptionExplanation(maps, [["red", "circle"]], torch.zeros(1, 3), ["red circle"], "cross", {}, (16, 16))
    np.testing.assert_array_equal(
        vx.viz.caption_matrix(e),
        vx.viz.attention_matrix(maps[0, :2].reshape(2, 4), ["red", "circle"], ["(0,0)", "(0,1)", "(1,0)", "(1,1)"], "cross: red circle"),
    )
