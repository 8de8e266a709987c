"""The value-path token labels of the zoo's Hiera (``vitexplain/zoo/hiera_signals.py``): each key's
per-key logits sit on the key's own grid cell, the labels are written by hand here from the model's
weights and its stage outputs in spatial order, and training with them leaves no hook behind."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import vitexplain as vx
from vitexplain.zoo.hiera_signals import HieraValueLabels, head_width_blocks
from vitexplain.zoo.models import HIERA_CONFIG, build


def _hiera() -> torch.nn.Module:
    torch.manual_seed(0)
    return build(HIERA_CONFIG).eval()


def test_per_key_logits_are_the_head_reading_each_key_value_on_its_grid_cell() -> None:
    model = _hiera()
    assert head_width_blocks(model) == [2, 3]
    labels = HieraValueLabels(model, blocks=[1, 2, 3])
    x = vx.data.shapes(2, seed=21_000).tensor
    try:
        with torch.no_grad():
            _, stages = model.forward_features(x, return_intermediates=True)  # (B, h, w, C), spatial order
            got = {b: labels.per_key_logits(k)[:, :, :, 0] for k, b in enumerate(labels.blocks)}
    finally:
        labels.remove()
    assert not any(blk.norm1._forward_hooks for blk in model.blocks)
    head = model.head

    def readout(o: torch.Tensor) -> torch.Tensor:  # the head's linearised reading of a change o: (..., classes)
        return F.linear((o - o.mean(-1, keepdim=True)) * head.norm.weight, head.fc.weight)

    def value_out(b: int, tokens: torch.Tensor) -> torch.Tensor:
        blk = model.blocks[b]
        d = blk.attn.dim_out
        v = tokens @ blk.attn.qkv.weight[2 * d:].T + blk.attn.qkv.bias[2 * d:]
        return v @ blk.attn.proj.weight.T

    # block 2's keys are stage 1's 8 x 8 tokens; block 1's are stage 0's 16 x 16 tokens, carried
    # to the head's width by block 2's widening projection
    want2 = readout(value_out(2, model.blocks[2].norm1(stages[1])))
    assert got[2].shape == (2, 8, 8, 5) and torch.allclose(got[2], want2, atol=1e-5)
    o1 = value_out(1, model.blocks[1].norm1(stages[0]))
    blk2 = model.blocks[2]
    want1 = readout(((o1 - o1.mean(-1, keepdim=True)) * blk2.norm1.weight) @ blk2.proj.weight.T)
    assert got[1].shape == (2, 16, 16, 5) and torch.allclose(got[1], want1, atol=1e-5)
    # block 3's keys are the 4 x 4 tokens after block 2, whose spatial order is that of stage 2
    after2 = model.blocks[2](model.blocks[1](model.blocks[0](model.unroll(model._pos_embed(model.patch_embed(x))))))
    want3 = readout(value_out(3, model.blocks[3].norm1(model.reroll(after2, 3))))
    assert got[3].shape == (2, 4, 4, 5) and torch.allclose(got[3], want3, atol=1e-5)


def test_a_stage_with_value_labels_trains_records_them_and_removes_its_hooks(tmp_path) -> None:
    from vitexplain.zoo import train as zoo_train

    assert zoo_train.main(["shapes-hier", "--arch", "hiera", "--out", str(tmp_path), "--steps", "2", "--batch-size",
                           "4", "--value-weight", "2", "--value-per-head", "1", "--val-images", "0",
                           "--final-eval-images", "0"]) == 0
    training = json.loads((tmp_path / "shapes-hier.json").read_text())["training"]
    assert training["value_weight"] == 2.0 and training["value_blocks"] == [2, 3] and training["value_per_head"]
    assert "--value-weight 2 --value-per-head 1" in training["command"]
    model = vx.zoo.load_checkpoint(str(tmp_path / "shapes-hier.json"))
    assert not any(m._forward_hooks for m in model.modules())
