"""What a capture learns about a model and keeps for the next (recording/discovery.py), and Hugging Face
SDPA calls recorded from their arguments (recording/direct.py): records always equal full interception's.

The oracle is full interception (``rec._full_interception = True``), compared by ``check`` of
test_capture_narrowing.py (names, kinds, steps, top-level calls, shapes, probabilities to 1e-6).
"""

from __future__ import annotations

import functools
import gc
import types
import weakref

import pytest
import torch
from torch import nn

import vitexplain as vx
import vlm_helpers as helpers
from test_capture_narrowing import _capture, _generate, _key, check
from vitexplain.recording import direct, discovery

transformers = pytest.importorskip("transformers")
sdpa_module = pytest.importorskip("transformers.integrations.sdpa_attention")
from transformers.modeling_utils import AttentionInterface  # noqa: E402


def _llava():
    torch.manual_seed(0)
    model, proc = helpers.BUILDERS["llava"]()
    oracle = helpers.ORACLE["llava"]
    inputs = dict(proc(images=helpers.images(5)[:2], text=[oracle["prompt"]("what is")] * 2, return_tensors="pt", padding=True))
    return model.eval(), _generate(model, inputs, suppress_tokens=oracle["placeholders"](model))


def _after_a_change(model: nn.Module, run):
    """A capture of a model that a capture learned (no ``forget``; changed since, or not): equal to full interception."""
    full, _ = _capture(model, run, full=True)
    rec, _ = _capture(model, run, full=False)
    assert [_key(r) for r in rec.records] == [_key(r) for r in full.records]
    for r, s in zip(rec.records, full.records):
        torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)
    return rec


def _checked(model: nn.Module) -> dict:
    """The checks made for the attention classes of ``model`` (kind -> whether records from arguments held)."""
    classes = {type(m) for m in model.modules()}
    return {kind: ok for kind, ok in direct._CHECKED.items() if kind[1] in classes}


def test_a_later_capture_starts_narrowed_and_records_sdpa_calls_from_their_arguments():
    model, run = _llava()
    check(model, run)  # a discovering capture, then one that starts narrowed: both equal full interception
    checked = _checked(model)
    assert checked and all(checked.values())  # every kind of call this transformers makes was checked and held
    for _ in range(2):  # (the second starts from the decisions the first made from the learned entry)
        again = _after_a_change(model, run)
        assert again._narrowing.narrowed and not again._narrowing.gated_types
    assert discovery.recall(model, discovery.fingerprint(model)) is not None


def test_another_attention_implementation_is_discovered_again():
    """Switching the model to eager attention (softmax outside the interface) between captures: the
    learned entry no longer holds, the next capture discovers the model and gates its attention classes."""
    model, run = _llava()
    check(model, run)
    model.set_attn_implementation("eager")
    rec = _after_a_change(model, run)
    assert rec._narrowing.gated_types  # eager softmax is issued by the attention modules themselves
    assert all(r.source == "eager" for r in rec.records)


def test_a_changed_forward_is_discovered_again():
    """A layer's attention given its own forward (same modules, same names) after a capture learned the
    model: it now also issues a softmax outside the interface, which the next capture records."""
    model, run = _llava()
    check(model, run)
    attn = model.model.language_model.layers[1].self_attn

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out, weights = type(self).forward(self, hidden_states, *args, **kwargs)
        scores = hidden_states @ hidden_states.transpose(-1, -2) / hidden_states.shape[-1] ** 0.5
        return out + 0 * torch.softmax(scores.unsqueeze(1), dim=-1).sum(), weights

    attn.forward = types.MethodType(forward, attn)
    rec = _after_a_change(model, run)
    assert any(r.name.endswith("layers.1.self_attn") and r.source == "eager" for r in rec.records)


def test_what_a_capture_learned_does_not_keep_the_model_alive_nor_survives_a_forward_that_raised():
    model, run = _llava()
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"), vx.capture(model):
        handle = model.model.language_model.layers[0].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
        try:
            run()
        finally:
            handle.remove()
    key = discovery.fingerprint(model)
    assert discovery.recall(model, key) is None  # nothing learned from a forward that raised
    with torch.no_grad(), vx.capture(model):
        run()
    assert discovery.recall(model, key) is not None
    alive = weakref.ref(model)
    del model, run
    gc.collect()
    assert alive() is None


def test_a_model_whose_forward_is_its_own_bound_method_is_not_kept_alive_and_a_new_forward_is_seen():
    """An instance forward bound to the module (``model.forward = types.MethodType(...)``, a hook library's
    partial holding it): what captures keep of the model's walk holds it weakly, so a model dropped by its user
    goes; and replacing the partial by an equal-looking new one (the old one freed) is a change, discovered again."""
    model, run = _llava()
    model.forward = types.MethodType(type(model).forward, model)
    layer = model.model.language_model.layers[0]
    layer.forward = functools.partial(type(layer).forward, layer)
    for _ in range(2):
        with torch.no_grad(), vx.capture(model):
            run()
    assert discovery.recall(model, discovery.fingerprint(model)) is not None
    layer.forward = functools.partial(type(layer).forward, layer)
    assert discovery.recall(model, discovery.fingerprint(model)) is None
    with torch.no_grad(), vx.capture(model):
        run()
    alive = weakref.ref(model)
    del model, run, layer
    gc.collect()
    assert alive() is None


def test_a_transformers_that_prepares_sdpa_arguments_otherwise_is_recorded_through_the_mode(monkeypatch):
    """An ``sdpa_attention_forward`` that passes SDPA other arguments than the ones computed from its own
    (here: half the scale) fails the first check of each kind of call: those go through the mode."""
    original = sdpa_module.sdpa_attention_forward

    def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scaling = (query.shape[-1] ** -0.5 if scaling is None else scaling) / 2
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)

    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward", sdpa_attention_forward)
    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", sdpa_attention_forward)
    model, run = _llava()
    check(model, run)
    checked = {kind: ok for kind, ok in direct._CHECKED.items() if kind[0] is sdpa_attention_forward}
    assert checked and not any(checked.values())


@pytest.mark.parametrize("change", ["local override", "global registration"])
def test_a_changed_attention_registry_is_discovered_again(change):
    """The function the model's attention implementation resolves to changed between captures: an entry of
    ``ALL_ATTENTION_FUNCTIONS``'s own mapping (even with transformers' own function: the modules then call it
    without the interface's tap) or a function registered in place of the global one. The learned entry no
    longer holds; the next capture records every call, as full interception does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, run = _llava()
    check(model, run)
    original = AttentionInterface._global_mapping["sdpa"]

    def wrapper(*args, **kwargs):  # not transformers' own: never tapped
        return original(*args, **kwargs)

    try:
        if change == "local override":
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        else:
            AttentionInterface.register("sdpa", wrapper)
        rec = _after_a_change(model, run)
        assert len(rec.records) > 0
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)
        AttentionInterface._global_mapping["sdpa"] = original


def test_records_read_between_calls_keep_call_order():
    """Records made from call arguments are made into record objects when read (direct.py's drafts):
    reading them between two generates of one scope, and interleaving records the mode made (the first
    call of a kind never seen, checked through the mode), keeps the records in call order, numbered as
    one capture of both generates with full interception numbers them."""
    model, run = _llava()
    check(model, run)
    full = vx.capture(model)
    full._full_interception = True
    with torch.no_grad(), full:
        run()
        run()
    direct._CHECKED.clear()  # (every first call of a kind goes through the mode again, between drafts)
    with torch.no_grad(), vx.capture(model) as rec:
        run()
        first = [_key(r) for r in rec.records]
        run()
    assert first and [_key(r) for r in rec.records][: len(first)] == first
    assert [r.index for r in rec.records] == list(range(len(rec.records)))
    assert [_key(r) for r in rec.records] == [_key(r) for r in full.records]
    for r, s in zip(rec.records, full.records):
        torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)


def _pending(rec) -> int:
    """How many of a capture's unread records are a lane's pending calls (direct.py), before they are read."""
    return sum(not isinstance(draft[-1], dict) for draft in rec._book.drafts)


def test_later_captures_record_through_lanes_and_equal_full_interception():
    """From the third capture of a model on, every Hugging Face SDPA call whose shape a checked call had
    takes its module's lane (its arguments kept, the record made when read): records equal full interception."""
    model, run = _llava()
    check(model, run)
    full, _ = _capture(model, run, full=True)
    with torch.no_grad(), vx.capture(model) as rec:
        run()
    lanes = _pending(rec)
    assert lanes > 0  # (a padded batch of 2: its decode steps and both towers' layers)
    assert [_key(r) for r in rec.records] == [_key(r) for r in full.records]
    for r, s in zip(rec.records, full.records):
        torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)
    name = next(n for n, m in model.named_modules() if n.endswith("language_model.layers.0.self_attn"))
    with torch.no_grad(), vx.capture(model, attention={name: lambda module, inputs, output: None}) as declared:
        run()
    # a capture that declares an extractor does not take the model's lanes (its issuers differ): the declared
    # module's calls are the extractor's (None: no record), every other record as full interception's
    assert [_key(r) for r in declared.records] == [_key(r) for r in full.records if r.name != name]


def test_a_lane_call_of_a_kind_no_longer_checked_is_refused_when_read():
    """A lane's record is made from its arguments when read; if the plan it then gives is not a kind checked
    equal to the mode's record, the record is refused, not made unchecked."""
    model, run = _llava()
    check(model, run)
    with torch.no_grad(), vx.capture(model) as rec:
        run()
    assert _pending(rec) > 0
    saved = dict(direct._CHECKED)
    direct._CHECKED.clear()
    try:
        with pytest.raises(vx.CaptureError, match="cannot be trusted"):
            rec.records
    finally:
        direct._CHECKED.update(saved)


def test_lanes_under_inference_mode_record_as_under_no_grad():
    """Keys made under torch.inference_mode keep no version counter (reading it raises): the lanes treat them as
    fresh, as the checked path does, and the records equal a no_grad capture's."""
    model, run = _llava()
    check(model, run)
    with torch.no_grad(), vx.capture(model) as reference:
        run()
    for _ in range(2):  # (the second takes the lanes the first made)
        with torch.inference_mode(), vx.capture(model) as rec:
            run()
        assert _pending(rec) > 0
        assert [_key(r) for r in rec.records] == [_key(r) for r in reference.records]
        for r, s in zip(rec.records, reference.records):
            torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)


def _as_named_modules(model) -> tuple:
    """What discovery's survey must read of ``model``, from ``named_modules()`` itself (the oracle)."""
    named = list(model.named_modules())
    by_type: dict = {}
    for _, m in named:
        by_type.setdefault(type(m), []).append(id(m))
    return [(n, id(m)) for n, m in named], {id(m): n for n, m in named}, {k: v for k, v in by_type.items()}


def _surveyed(model) -> tuple:
    from vitexplain.recording.discovery import survey

    s = survey(model)
    return ([(n, id(m)) for n, m in s.modules.items()], s.names,
            {k: [id(m) for m in v] for k, v in s.by_type.items()})


def test_the_survey_walks_the_modules_as_named_modules_does():
    """discovery's own walk (a stack, no generator per level) gives named_modules' modules, names, order and
    classes, with a module shared by two parents once (at its first place) and None children skipped; and so
    does every later survey, which reuses the names of the last one only while the walk is the same: after a
    module inserted into a ModuleList (which writes its _modules directly), one deleted, one replaced, one moved."""
    from torch import nn

    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.ModuleDict({"b": shared, "c": nn.Sequential(nn.Tanh())}))
    model.add_module("gone", None)
    model[1]["c"].add_module("inner", nn.Sequential(shared, nn.GELU()))
    model.add_module("blocks", nn.ModuleList([nn.Identity(), nn.Tanh()]))
    expected = _as_named_modules(model)
    assert len(expected[0]) == 12 and expected[0][2][0] == "0.0"  # (the shared Linear once, where it is met first)
    assert _surveyed(model) == expected
    assert _surveyed(model) == expected  # (the second reuses the first's names)
    changes = [
        lambda: model.blocks.insert(0, nn.GELU()),  # (ModuleList.insert renumbers its _modules in place)
        lambda: delattr(model[1]["c"], "inner"),
        lambda: setattr(model[0], "1", nn.SiLU()),
        lambda: model.blocks.append(model[1]["c"]),  # (met first under 1.c: not again under blocks)
        lambda: model._modules.move_to_end("0") if hasattr(model._modules, "move_to_end") else
        model._modules.update({"0": model._modules.pop("0")}),
        lambda: model.blocks.pop(0),
    ]
    for change in changes:
        change()
        expected = _as_named_modules(model)
        assert _surveyed(model) == expected
        assert _surveyed(model) == expected

def test_calls_outside_the_models_forward_take_lanes_too():
    """shapes-vlm's ``generate`` encodes its images before its first forward (the vision tower called outside the
    model's own forward, whose top-level call is found by walking the frames): once a capture has checked them,
    those calls take their module's lane as the language model's do, and every record still equals full
    interception."""
    model = vx.zoo.load("shapes-vlm")
    proc = model.vx_processor
    size = proc.image_processor.crop_size["height"]
    images = list(vx.data.shapes(2, seed=5, size=size).images)
    prompt = "<image> " + " ".join(proc.tokenizer.convert_ids_to_tokens([5, 6, 7]))
    inputs = dict(proc(images=images, text=[prompt, prompt], return_tensors="pt", padding=True))
    run = _generate(model, inputs, pad_token_id=0)
    check(model, run)
    for _ in range(2):  # (the first of these checks the tower's calls, as the capture that discovered it did not)
        with torch.no_grad(), vx.capture(model) as rec:
            run()
    tower = [d for d in rec._book.drafts if ".vision_tower." in f".{d[0]}."]
    assert tower and all(not isinstance(d[-1], dict) for d in tower)  # (each a lane's pending call)
    full, _ = _capture(model, run, full=True)
    assert [_key(r) for r in rec.records] == [_key(r) for r in full.records]
    for r, s in zip(rec.records, full.records):
        torch.testing.assert_close(r.probs(), s.probs(), atol=1e-6, rtol=0)
    assert len({r.forward_index for r in rec.records if ".vision_tower." in f".{r.name}."}) == 1
