"""Attention a capture sees and cannot record is never dropped silently.

timm's HaloAttn computes its softmax as (B * heads, blocks, block pixels, halo window pixels) over overlapping
key windows: no record holds that layout, so it is not recorded; reading the records then warns
(``vx.UnrecordedAttentionWarning``, naming the modules), and a model whose every attention is such raises
``NoAttentionError`` saying so (before: the records of a mixed model were read as all of its attention, and a pure
HaloNet's error listed what vitexplain captures as if it had no attention at all).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import vitexplain as vx

timm = pytest.importorskip("timm")
from timm.layers.halo_attn import HaloAttn  # noqa: E402


def _halo_names(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, HaloAttn)]


def _tiny(mixed: bool):
    """A tiny timm ByobNet at 64 px with halo attention (2 x 2 blocks of 4 x 4, halo 1) in its second stage, and in its
    third either halo attention too or (``mixed``) BottleneckAttn over the whole 4 x 4 map, as halo2botnet."""
    from timm.models.byobnet import ByobNet, ByoBlockCfg, ByoModelCfg

    last = dict(self_attn_layer="bottleneck", self_attn_kwargs={}) if mixed else {}
    cfg = ByoModelCfg(
        blocks=(ByoBlockCfg(type="bottle", d=1, c=32, s=1, gs=0, br=0.25),
                ByoBlockCfg(type="self_attn", d=5, c=64, s=2, gs=0, br=0.25),
                ByoBlockCfg(type="self_attn", d=1, c=64, s=2, gs=0, br=0.25, **last)),
        stem_chs=16, stem_type="tiered", stem_pool="maxpool", self_attn_layer="halo",
        self_attn_kwargs=dict(block_size=4, halo_size=1, num_heads=2))
    torch.manual_seed(0)
    return ByobNet(cfg, num_classes=3, img_size=64).eval()


def test_a_mixed_model_warns_that_its_halo_attention_is_not_in_the_records():
    model = _tiny(mixed=True)
    x = torch.randn(1, 3, 64, 64)
    for _ in range(2):  # (the second capture starts narrowed from what the first learned)
        with torch.no_grad(), vx.capture(model) as rec:
            model(x)
        with pytest.warns(vx.UnrecordedAttentionWarning) as caught:
            records = rec.records
        assert [type(dict(model.named_modules())[r.name]).__name__ for r in records] == ["BottleneckAttn"]
        message = str(caught[0].message)
        halo = _halo_names(model)
        assert len(halo) == 5 and all(n in message for n in halo[:4]) and "1 more" in message and "HaloAttn" in message
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec.records  # (once per capture)


def test_a_model_whose_only_attention_is_halo_attention_says_so():
    model = _tiny(mixed=False)
    with torch.no_grad(), vx.capture(model) as rec:
        model(torch.randn(1, 3, 64, 64))
    with pytest.raises(vx.NoAttentionError, match="HaloAttn") as error:
        rec.records
    halo = _halo_names(model)
    assert len(halo) == 6 and all(n in str(error.value) for n in halo[:4]) and "2 more" in str(error.value)
