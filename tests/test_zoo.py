"""Tests of the bundled zoo: offline loading, structure, accuracy floors, training scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import vitexplain as vx
from vitexplain.data import SHAPES, shapes
from vitexplain.zoo import evaluate as zoo_eval
from vitexplain.zoo.hub import WEIGHTS_DIR

FLOOR_SEED = zoo_eval.EVAL_SEED + 1  # fresh: training uses seeds < 9_000
NAMES = ["shapes-vit", "shapes-cnn", "shapes-captioner", "shapes-sat"]
CAPTIONERS = ("shapes-captioner", "shapes-sat")


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {name: vx.zoo.load(name) for name in NAMES}


@pytest.fixture(scope="module")
def floor_batch():
    return shapes(200, seed=FLOOR_SEED)


class _SDPASpy(TorchFunctionMode):
    """Records the q/k/v shapes and flags of every SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append({"q": tuple(q.shape), "k": tuple(k.shape), "is_causal": kwargs.get("is_causal", False)})
        return func(*args, **kwargs)


def test_names_and_unknown() -> None:
    assert vx.zoo.names() == NAMES
    with pytest.raises(KeyError) as err:
        vx.zoo.load("shapes-nope")
    for name in NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", NAMES)
def test_load_offline_eval_mode_with_preprocessing(name: str, models) -> None:
    from timm.data import resolve_data_config

    model = models[name]
    assert not model.training
    assert all(not m.training for m in model.modules())
    assert model.zoo_name == name
    cfg = model.pretrained_cfg
    for key in ("input_size", "mean", "std", "interpolation", "crop_pct", "label_names", "num_classes"):
        assert key in cfg
    assert cfg["input_size"] == (3, 64, 64) and cfg["crop_pct"] == 1.0
    assert tuple(cfg["mean"]) == vx.data.MEAN and tuple(cfg["std"]) == vx.data.STD
    data = resolve_data_config(model=model)
    assert data["input_size"] == (3, 64, 64) and tuple(data["mean"]) == vx.data.MEAN
    if name not in CAPTIONERS:
        assert cfg["label_names"] == list(SHAPES) and cfg["num_classes"] == len(SHAPES)
    size = (WEIGHTS_DIR / f"{name}.safetensors").stat().st_size
    assert size <= 5 * 2**20
    info = vx.zoo.info(name)
    assert info["num_params"] == sum(p.numel() for p in model.parameters())
    assert info["training"]["cpu_time_s"] > 0 and "eval" in info["metrics"]


def test_vit_is_a_plain_timm_vit(models) -> None:
    from timm.models.vision_transformer import VisionTransformer

    vit = models["shapes-vit"]
    assert type(vit) is VisionTransformer
    assert vit.patch_embed.patch_size == (8, 8) and vit.patch_embed.grid_size == (8, 8)
    assert vit.num_prefix_tokens == 1 and vit.global_pool == "token"
    assert all(blk.attn.fused_attn for blk in vit.blocks)
    x = shapes(2, seed=FLOOR_SEED).tensor
    with _SDPASpy() as spy, torch.no_grad():
        out = vit(x)
    assert out.shape == (2, len(SHAPES))
    assert len(spy.calls) == len(vit.blocks) and spy.calls[0]["q"][2] == 65


def test_cnn_has_timm_channel_and_spatial_gates(models) -> None:
    from timm.layers.cbam import CbamModule
    from timm.layers.eca import EcaModule
    from timm.layers.squeeze_excite import SEModule

    cnn = models["shapes-cnn"]
    kinds = {type(m) for m in cnn.modules()}
    assert CbamModule in kinds and (EcaModule in kinds or SEModule in kinds)
    deepest = [m for m in cnn.layer4.modules() if isinstance(m, CbamModule)]
    assert deepest, "the deepest stage must carry CBAM"
    maps = []
    hook = deepest[-1].spatial.gate.register_forward_hook(lambda m, i, o: maps.append(o))
    try:
        with torch.no_grad():
            cnn(shapes(2, seed=FLOOR_SEED).tensor)
    finally:
        hook.remove()
    assert maps[0].shape[-2] >= 8 and maps[0].shape[-1] >= 8


def test_captioner_attention_contract(models) -> None:
    from timm.models.vision_transformer import VisionTransformer

    from vitexplain.zoo.captioner import CrossAttention, SelfAttention

    cap = models["shapes-captioner"]
    assert isinstance(cap.encoder, VisionTransformer) and cap.encoder.num_prefix_tokens == 1
    cross = [m for m in cap.modules() if isinstance(m, CrossAttention)]
    selfs = [m for m in cap.modules() if isinstance(m, SelfAttention)]
    assert cross and selfs
    assert all(m.is_cross_attention for m in cross) and not any(m.is_cross_attention for m in selfs)
    got_memory = []
    hooks = [m.register_forward_pre_hook(lambda mod, a, kw: got_memory.append("memory" in kw), with_kwargs=True)
             for m in cross]
    x = shapes(3, seed=FLOOR_SEED).tensor
    try:
        with _SDPASpy() as spy, torch.no_grad():
            ids, caps = cap.generate(x)
    finally:
        for h in hooks:
            h.remove()
    assert got_memory and all(got_memory)
    n_enc = len(cap.encoder.blocks)
    dec_calls = spy.calls[n_enc:]
    assert all(c["q"][2] == 1 for c in dec_calls), "each generation step issues queries of length 1"
    assert all(len(c["q"]) == 4 for c in spy.calls)
    assert any(c["k"][2] == 65 for c in dec_calls), "cross-attention covers all 1 + 64 encoder tokens"
    assert ids.dtype == torch.long and ids.shape[0] == 3 and len(caps) == 3


def test_sat_attends_once_per_step_with_its_additive_attention(models) -> None:
    from vitexplain.zoo.sat import AdditiveAttention, GridEncoder

    sat = models["shapes-sat"]
    assert isinstance(sat.encoder, GridEncoder) and isinstance(sat.attention, AdditiveAttention)
    x = shapes(3, seed=FLOOR_SEED).tensor
    alphas = []
    hook = sat.attention.register_forward_hook(lambda m, a, o: alphas.append(o[1]))
    try:
        with torch.no_grad():
            ids, caps = sat.generate(x)
            bos = torch.full((3, 1), sat.vocab.bos_id, dtype=torch.long)
            logits = sat(x, torch.cat([bos, ids[:, :-1]], dim=1))
    finally:
        hook.remove()
    steps = ids.shape[1]
    assert len(alphas) == 2 * steps and all(a.shape == (3, 256) for a in alphas)  # one query per step, 16 x 16 grid
    torch.testing.assert_close(torch.stack(alphas[:steps]), torch.stack(alphas[steps:]))  # generation == teacher forcing
    torch.testing.assert_close(torch.stack(alphas).sum(-1), torch.ones(2 * steps, 3))
    for i, c in enumerate(caps):
        n = len(c.split()) + 1
        assert torch.equal(logits.argmax(-1)[i, :n], ids[i, :n])


def test_captioner_cache_matches_teacher_forcing(models) -> None:
    cap = models["shapes-captioner"]
    x = shapes(4, seed=FLOOR_SEED + 5).tensor
    with torch.no_grad():
        ids, caps = cap.generate(x)
        bos = torch.full((4, 1), cap.vocab.bos_id, dtype=torch.long)
        logits = cap(x, torch.cat([bos, ids[:, :-1]], dim=1))
    steps = logits.argmax(-1)
    for i, c in enumerate(caps):
        n = len(c.split()) + 1  # words + <eos>
        assert torch.equal(steps[i, :n], ids[i, :n])
    tok = cap.tokenize(["red circle and blue star"])
    assert cap.decode(tok[:, 1:]) == ["red circle and blue star"]


def test_classifier_floors(models, floor_batch) -> None:
    for name in ("shapes-vit", "shapes-cnn"):
        with torch.no_grad():
            pred = (models[name](floor_batch.tensor) > 0).float()
        ok = pred == floor_batch.labels
        label_acc = float(ok.float().mean())
        exact_acc = float(ok.all(dim=1).float().mean())
        assert label_acc >= 0.97, (name, label_acc)
        assert exact_acc >= 0.90, (name, exact_acc)


@pytest.mark.parametrize(
    "name, floor",
    # shapes-sat: caption accuracy 0.998 on 1,000 held-out images (its JSON); 0.998 - 3 SE at 200 images
    [("shapes-captioner", 0.90), ("shapes-sat", 0.98)],
)
def test_captioner_floor(models, floor_batch, name, floor) -> None:
    with torch.no_grad():
        _, caps = models[name].generate(floor_batch.tensor)
    acc = sum(a == b for a, b in zip(caps, floor_batch.captions)) / len(caps)
    assert acc >= floor, (name, acc)


def test_training_scripts_run_and_reload(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from vitexplain.zoo import train as zoo_train

    for name in NAMES:
        path = zoo_train.train(name, tmp_path, steps=2, batch_size=4, val_images=0,
                               final_eval_images=0, log=lambda *a: None)
        assert path == tmp_path / f"{name}.json"
        model = vx.zoo.load(name, weights_dir=tmp_path)  # the same code path as the bundled models
        assert not model.training and model.zoo_name == name
        cfg = json.loads(path.read_text())
        assert cfg["training"]["steps"] == 2 and cfg["training"]["seed"] == 0
    # deterministic given the seed, and the command line works
    first = load_file(str(tmp_path / "shapes-vit.safetensors"))
    assert zoo_train.main(["shapes-vit", "--out", str(tmp_path / "again"), "--steps", "2", "--batch-size", "4",
                           "--val-images", "0", "--final-eval-images", "0", "--log-every", "1"]) == 0
    again = load_file(str(tmp_path / "again" / "shapes-vit.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    with pytest.raises(ValueError):
        zoo_train.train("shapes-vit", tmp_path, seed=zoo_eval.EVAL_SEED, steps=1)


def test_training_schedule_resumes_stages(tmp_path: Path, monkeypatch) -> None:
    from vitexplain.zoo import train as zoo_train

    recipe = dict(zoo_train.RECIPES["shapes-vit"], steps=1, batch_size=2,
                  then=[{"steps": 1, "batch_size": 2, "lr": 1e-4, "seed_offset": 1}])
    monkeypatch.setitem(zoo_train.RECIPES, "shapes-vit", recipe)
    path = zoo_train.train_schedule("shapes-vit", tmp_path, val_images=0, final_eval_images=0,
                                    log=lambda *a: None)
    cfg = json.loads(path.read_text())
    assert cfg["training"]["seed"] == 1 and cfg["training"]["previous"]["seed"] == 0
    assert cfg["training"]["images_seen_total"] == 4
    assert not vx.zoo.load("shapes-vit", weights_dir=tmp_path).training
