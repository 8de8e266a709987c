"""Narrowed interception (vitexplain/recording/narrowing.py) records what full interception records.

Oracle: the same capture with interception everywhere for the whole scope (the recorder's private
``_full_interception`` flag, which is how every capture worked before narrowing). For every kind of
model that runs several forwards in one scope (``generate`` of VLMs, encoder-decoder captioners,
BART, GIT, nn.Transformer loops, timm models with eager attention), both captures must give the same
records (name, kind, step, forward_index, shapes, probabilities to 1e-6), the outputs must be
bitwise those of the model run without a capture, and the model, its config, transformers'
attention registry, the torch function mode stack and the MHA fast-path flag must be as found.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitexplain as vx
import vlm_helpers as helpers
from vitexplain.recording import discovery
from support_table import _blip, _git, _torch_decoder_captioner, _vision_encoder_decoder

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")
from transformers.modeling_utils import AttentionInterface  # noqa: E402

NEW = 3


# -- helpers -----------------------------------------------------------------------------------
def _state(model: nn.Module) -> dict:
    """Everything of the model and the process that a capture may touch and must restore."""
    configs = {n: m.config.to_dict() for n, m in model.named_modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")}
    return dict(
        hooks={n: (list(m._forward_pre_hooks), list(m._forward_hooks), list(m._forward_hooks_always_called))
               for n, m in model.named_modules()},
        training={n: m.training for n, m in model.named_modules()},
        configs=configs,
        attn={n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")},
        registry={k: id(v) for k, v in AttentionInterface._global_mapping.items()},
        stack=torch._C._len_torch_function_stack(),
        fastpath=torch.backends.mha.get_fastpath_enabled(),
    )


def _key(r) -> tuple:
    return (r.name, r.kind, r.step, r.forward_index, tuple(r.q_shape), tuple(r.k_shape), r.source)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _capture(model: nn.Module, run, full: bool):
    rec = vx.capture(model)
    rec._full_interception = full
    with torch.no_grad(), rec:
        out = run()
    return rec, out


def check(model: nn.Module, run, *, narrows: bool = True, mha: bool = False):
    """Run ``run`` plain, fully intercepted and narrowed; compare; return the narrowed recorder.

    The narrowed capture discovers the model (``narrows``: whether it narrowed after the first
    forward); a second one starts narrowed from what the first learned (recording/discovery.py) and
    must record the same.

    ``mha``: the model has nn.MultiheadAttention, whose fast path every capture turns off (it hides
    the attention), so the plain run is made without it too.
    """
    model.eval()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath and not mha)
    try:
        with torch.no_grad():
            run()  # transformers installs its own output-capturing hooks on the first call
            plain = run()
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    before = _state(model)
    discovery.forget(model)
    full, out_full = _capture(model, run, full=True)
    assert not full._narrowing.narrowed
    rec, out = _capture(model, run, full=False)
    again, out_again = _capture(model, run, full=False)
    assert _state(model) == before
    assert _same(out, plain) and _same(out_full, plain) and _same(out_again, plain)  # bitwise: no computation changed
    assert rec._narrowing.narrowed == narrows
    assert again._narrowing.narrowed != (type(model) in again._narrowing._issuer_types)  # from its first call
    for narrowed in (rec, again):
        assert [_key(r) for r in narrowed.records] == [_key(r) for r in full.records]
        for r, s in zip(narrowed.records, full.records):
            torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)
    return rec


def _generate(model: nn.Module, inputs: dict, **extra):
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **extra)
    return lambda: model.generate(**inputs, **options)


# -- generate ------------------------------------------------------------------------------------
def test_shapes_vlm_generate():
    model = vx.zoo.load("shapes-vlm")
    proc = model.vx_processor
    size = proc.image_processor.crop_size["height"]
    images = list(vx.data.shapes(2, seed=3, size=size).images)
    prompt = "<image> " + " ".join(proc.tokenizer.convert_ids_to_tokens([5, 6, 7]))
    inputs = proc(images=images, text=[prompt, prompt + " " + prompt.split()[-1]], return_tensors="pt", padding=True)
    rec = check(model, _generate(model, dict(inputs), pad_token_id=0))
    assert not rec._narrowing.gated_types  # every attention call came through transformers' interface


# BLIP-2, InstructBLIP and Kosmos-2: generate never calls the model itself (it calls its towers and
# its LM's generate), so the capture never narrows; their records are still compared.
VLMS = {name: name not in ("blip2", "instructblip", "kosmos2") for name in helpers.BUILDERS}


@pytest.mark.parametrize("name", sorted(VLMS))
def test_vlm_generate(name):
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS[name]()
    oracle = helpers.ORACLE[name]
    texts = [oracle["prompt"]("what is"), oracle["prompt"]("what color is the shape")]
    images = helpers.images(5)
    nested = oracle.get("nested")  # processors that take a list of images per prompt
    inputs = proc(images=[[i] for i in images] if nested else images, text=texts, return_tensors="pt", padding=True)
    check(model, _generate(model, dict(inputs), suppress_tokens=oracle["placeholders"](model)), narrows=VLMS[name])


def test_mllama_generate_cross_attention_from_the_cache():
    from test_capture_decoding import mllama

    torch.manual_seed(0)
    model, inputs = mllama()
    rec = check(model, _generate(model, inputs))
    assert {r.kind for r in rec.records if "cross_attn" in r.name} == {"cross"}


def test_encoder_decoder_generate_runs_its_encoder_outside_the_forward():
    torch.manual_seed(0)
    model = _vision_encoder_decoder()
    rec = check(model, _generate(model, dict(pixel_values=torch.randn(2, 3, 32, 32))))
    assert {r.forward_index for r in rec.records if r.name.startswith("encoder.")} == {0}
    assert {r.kind for r in rec.records if "crossattention" in r.name} == {"cross"}


# BLIP's generate calls its vision model and its text decoder's generate, never the model itself: no narrowing
@pytest.mark.parametrize("build, extra, narrows", [(_blip, {}, False), (_git, dict(bos_token_id=1, pad_token_id=0), True)],
                         ids=["blip", "git"])
def test_hf_captioner_generate(build, extra, narrows):
    torch.manual_seed(0)
    model = build()
    check(model, _generate(model, dict(pixel_values=torch.randn(2, 3, 32, 32)), **extra), narrows=narrows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bart_generate(attn):
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration._from_config(config, attn_implementation=attn)
    rec = check(model, _generate(model, dict(input_ids=torch.randint(4, 40, (2, 6)))))
    assert bool(rec._narrowing.gated_types) == (attn == "eager")  # eager softmax: the mode stays on inside those modules


def test_t5_generate_with_position_bias():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    check(model, _generate(model, dict(input_ids=torch.randint(4, 40, (2, 6)))))


def test_torch_decoder_captioner_generate():
    """nn.TransformerDecoder over a timm ViT: nn.MultiheadAttention and SDPA, a greedy loop of forwards."""
    torch.manual_seed(0)
    model = _torch_decoder_captioner()
    x = torch.randn(2, 3, 32, 32)
    rec = check(model, lambda: model.generate(x, 4), mha=True)
    assert rec._narrowing.gated_types


def test_nn_transformer_loop():
    torch.manual_seed(0)
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=32, batch_first=True)
    src = torch.randn(2, 5, 16)

    def run():
        tgt, outs = torch.zeros(2, 1, 16), []
        for _ in range(3):
            out = model(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(tgt.shape[1]))
            outs.append(out)
            tgt = torch.cat([tgt, out[:, -1:]], dim=1)
        return outs

    check(model, run, mha=True)


def test_timm_eager_attention_several_forwards():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    xs = [torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)]
    check(model, lambda: [model(x) for x in xs])


# -- paths the first forward did not take -----------------------------------------------------------
def _attend(t: torch.Tensor) -> torch.Tensor:
    """(B, N, 3 * 2 * 4) -> eager attention with the softmax in a helper (the module's forward names no softmax)."""
    q, k, v = t.unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
    return (torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v).transpose(1, 2).flatten(2)


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class Helper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _attend(self.qkv(x))


class Branches(nn.Module):
    """Step 0 runs ``first`` only; later steps run a sibling of the same class and a module never run before."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Fused()
        self.late = nn.ModuleList([Fused(), Fused()])
        self.tower = nn.Sequential(nn.Linear(8, 8), Helper())
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        x = self.first(x)
        if step >= 1:
            x = self.late[step % 2](x)
        if step >= 2:
            x = self.tower(x)
        return self.mlp(x)


def test_attention_on_a_path_the_first_forward_did_not_take_is_recorded():
    torch.manual_seed(0)
    model = Branches()
    x = torch.randn(2, 5, 8)
    rec = check(model, lambda: [model(x, step) for step in range(4)])
    names = [r.name for r in rec.records]
    assert names.count("late.1") == 2 and names.count("late.0") == 1  # same class as an issuer
    assert names.count("tower.1") == 2  # did not run in the first forward


def test_lrp_rules_inside_the_capture_keep_the_mode_at_the_bottom():
    """A torch function mode entered inside the capture (LRP's rules) stays above the capture's: no narrowing."""
    from timm.models.vision_transformer import VisionTransformer

    from vitexplain.methods.lrp_rules import LRPRules

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)

    def run():
        with LRPRules("cp"):
            return [model(x), model(x)]

    check(model, run, narrows=False)


def test_calls_from_another_thread_pass_through():
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["llava"]()
    oracle = helpers.ORACLE["llava"]
    inputs = dict(proc(images=helpers.images(5)[:1], text=[oracle["prompt"]("what is")], return_tensors="pt"))
    run = _generate(model, inputs, suppress_tokens=oracle["placeholders"](model))
    with torch.no_grad():
        plain = run()
    elsewhere: list = []
    with torch.no_grad(), vx.capture(model) as rec:
        run()
        seen = len(rec.records)
        thread = threading.Thread(target=lambda: elsewhere.append(run()))
        thread.start()
        thread.join()
        assert len(rec.records) == seen  # the other thread's attention is not this capture's
        assert rec._narrowing.narrowed
    assert torch.equal(elsewhere[0], plain)


@pytest.mark.parametrize("at", [0, 2], ids=["first forward", "after narrowing"])
def test_everything_is_restored_after_an_exception(at):
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["llava"]()
    oracle = helpers.ORACLE["llava"]
    inputs = dict(proc(images=helpers.images(5)[:1], text=[oracle["prompt"]("what is")], return_tensors="pt"))
    with torch.no_grad():
        model(**inputs)
    before = _state(model)
    layer = model.model.language_model.layers[1]
    calls = [0]

    def fail(module, args):
        calls[0] += 1
        if calls[0] > at:
            raise RuntimeError("boom")

    handle = layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), vx.capture(model) as rec:
            for _ in range(4):
                model(**inputs)
    finally:
        handle.remove()
    assert rec._narrowing.narrowed == (at > 0)
    assert _state(model) == before


# -- one forward: layers after the first of their class run narrowed -----------------------------
class Layer(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.attn = Fused()
        self.mlp = nn.Linear(8, 8)
        self.extra = Helper() if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        if self.extra is not None:
            x = x + self.extra(x)
        return self.mlp(x)


class Layers(nn.Module):
    """Three layers of one class; the last holds a module unlike anything in the first."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(False), Layer(False), Layer(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _single(build, size):
    def case():
        torch.manual_seed(0)
        model = build()
        x = torch.randn(2, 5, 8) if size is None else torch.randn(2, 3, *size)
        return model, x
    return case


SINGLE = {
    "layers unlike the first": _single(Layers, None),
    "timm ViT": _single(lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, num_classes=5), (32, 32)),
    "timm Swin": _single(lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=56, depths=(2, 2), num_heads=(2, 4),
                                                   embed_dim=16, num_classes=5), (56, 56)),
    "zoo shapes-hier (Hiera)": lambda: (vx.zoo.load("shapes-hier"), torch.randn(2, 3, 64, 64)),
    "HF ViT (sdpa)": _single(lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)), (32, 32)),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_forward_records_equal_full_interception(name):
    model, x = SINGLE[name]()
    def run():
        out = model(x)
        return getattr(out, "logits", out)

    check(model, run, narrows=False)
    if name == "layers unlike the first":
        discovery.forget(model)
        rec = _capture(model, lambda: model(x), full=False)[0]
        assert rec._narrowing.gated_types == {Fused}  # layers 1 and 2 ran with the mode inside their attention only
        names = [r.name for r in rec.records]
        assert names == ["layers.0.attn", "layers.1.attn", "layers.2.attn", "layers.2.extra"]


def _eager_vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5).eval()
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = False
    return model


def test_a_mode_entered_after_narrowing_stays_above_the_capture():
    """LRP's rules entered after the capture narrowed: the capture's mode goes back under them, as with full interception."""
    from vitexplain.methods.lrp_rules import LRPRules

    model, x = _eager_vit(), torch.randn(2, 3, 32, 32)

    def run():
        outs = [model(x), model(x)]
        with LRPRules("cp"):
            outs.append(model(x))
        return outs

    check(model, run)


def test_nested_captures_of_one_model_both_record_everything():
    model, x = _eager_vit(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = _capture(model, lambda: [model(x) for _ in range(3)], full=True)[0]
        with vx.capture(model) as outer:
            model(x)
            with vx.capture(model) as inner:
                for _ in range(3):
                    model(x)
            model(x)
    assert inner._narrowing.narrowed and outer._narrowing.narrowed
    assert [_key(r) for r in inner.records] == [_key(r) for r in expected.records]
    assert [(r.name, r.step) for r in outer.records] == [(f"blocks.{i % 2}.attn", i // 2) for i in range(10)]
