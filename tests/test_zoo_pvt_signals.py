"""The value-path token labels of the zoo's PVTv2 (``shapes-hier --arch pvt``;
``vitexplain/zoo/pvt_signals.py``): each key's per-key logits are the head's reading of that key's
value, written by hand here from the model's weights and its last stage's input, and training with
them leaves no hook behind."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import vitexplain as vx
from vitexplain.zoo.models import PVT_CONFIG, build
from vitexplain.zoo.pvt_signals import PvtValueLabels, last_stage_blocks, pvt_blocks
from vitexplain.zoo.token_labels import patch_targets


def _pvt() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build(PVT_CONFIG).eval()
    with torch.no_grad():  # non-trivial norm scales and value biases, so that each term is checked
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
            if hasattr(m, "kv"):
                m.kv.bias.normal_(0.0, 0.1)
    return model


def test_per_key_logits_are_the_head_reading_each_key_value() -> None:
    model = _pvt()
    assert pvt_blocks(model) == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert last_stage_blocks(model) == [2, 3]
    labels = PvtValueLabels(model)
    x = vx.data.shapes(2, seed=21_000).tensor
    try:
        with torch.no_grad():
            model(x)
            got = [labels.per_key_logits(k) for k in range(2)]
    finally:
        labels.remove()
    assert not any(m._forward_hooks for m in model.modules())
    stage = model.stages[2]
    with torch.no_grad():
        h = model.stages[1](model.stages[0](model.patch_embed(x)))  # (B, C, 8, 8)
        t0 = stage.downsample(h).flatten(1, 2)  # (B, 16, C): the last stage's input, row-major
        t1 = stage.blocks[0](t0, (4, 4))
        for blk, tokens, z in zip(stage.blocks, (t0, t1), got):
            d = blk.attn.proj.in_features
            v = blk.norm1(tokens) @ blk.attn.kv.weight[d:].T + blk.attn.kv.bias[d:]  # the values
            o = v @ blk.attn.proj.weight.T  # what each key adds to a token that attends to it
            want = ((o - o.mean(-1, keepdim=True)) * stage.norm.weight) @ model.head.weight.T
            assert z.shape == (2, 16, 5) and torch.allclose(z, want, atol=1e-5)


def test_labels_ask_each_key_for_its_own_region_classes() -> None:
    """The loss is binary cross-entropy of the per-key logits against the coverage on the key grid,
    the positive term weighted by the negative-to-positive ratio."""
    model = _pvt()
    labels = PvtValueLabels(model, blocks=[3])
    batch = vx.data.shapes(3, seed=21_001)
    try:
        with torch.no_grad():
            model(batch.tensor)
            seen: list[int] = []

            def coverage(g: int) -> torch.Tensor:
                seen.append(g)
                return patch_targets(batch, 64 // g)[0]

            loss = labels(coverage)
            z = labels.per_key_logits(0)
    finally:
        labels.remove()
    assert seen == [4]
    cover = patch_targets(batch, 16)[0][:, :-1].flatten(2).transpose(1, 2)
    w = (1 - cover).sum() / cover.sum()
    want = -(w * cover * F.logsigmoid(z) + (1 - cover) * F.logsigmoid(-z)).mean()
    assert torch.allclose(loss, want, atol=1e-6)


def test_blocks_outside_the_last_stage_are_refused() -> None:
    model = _pvt()
    with pytest.raises(vx.UsageError, match="last stage"):
        PvtValueLabels(model, blocks=[1])
    assert not any(m._forward_hooks for m in model.modules())


def test_a_stage_with_value_labels_trains_records_them_and_removes_its_hooks(tmp_path) -> None:
    from vitexplain.zoo import train as zoo_train

    assert zoo_train.main(["shapes-hier", "--arch", "pvt", "--out", str(tmp_path), "--steps", "2", "--batch-size", "4",
                           "--value-weight", "2", "--value-blocks", "3", "--val-images", "0",
                           "--final-eval-images", "0"]) == 0
    training = json.loads((tmp_path / "shapes-hier.json").read_text())["training"]
    assert training["value_weight"] == 2.0 and training["value_blocks"] == [3]
    assert "--arch pvt --batch-size 4 --value-weight 2 --value-blocks 3" in training["command"]
    model = vx.zoo.load_checkpoint(str(tmp_path / "shapes-hier.json"))
    assert not any(m._forward_hooks for m in model.modules())
