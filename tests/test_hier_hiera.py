"""Hiera from Hugging Face (``HieraForImageClassification`` / ``HieraModel``) against a dense
float64 oracle built here, and a stage made of one pooling block (timm and Hugging Face).

The oracle works in the model's *unrolled* token order (as tests/test_hier_more.py does for timm's
Hiera): per layer, token t is slot t // nW of window t % nW (the layer's own reshape), a pooled
query / residual t' is the mean-footprint of positions t' + c N / q_stride (Hiera's max over
chunks), and only the final stage-0 vector is put on the grid through Hugging Face's own
``unroll`` run on token indices. CDAM on a stage whose only block pools is checked against
finite differences, placed on the grid by the model's own ``reroll``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitexplain as vx
from hier_oracle import assert_matches_oracle, carry, hiera_call, taped_attention, token_derivative
from test_hier_more import CLASSES, _reinit

transformers = pytest.importorskip("transformers")
from transformers.models.hiera.modeling_hiera import unroll  # noqa: E402

import support_table as support  # noqa: E402

SIZE = (64, 64)


def hf_hiera(head: bool = True, depths=(1, 2, 2)) -> nn.Module:
    """A tiny random-init Hugging Face Hiera: mask units in stages 0 and 1, global attention in 2,
    HF's default overlapping 7 x 7 stride-4 patch embedding; the head re-initialised."""
    torch.manual_seed(0)
    config = transformers.HieraConfig(
        image_size=list(SIZE), embed_dim=16, num_heads=[1, 2, 4], depths=list(depths), num_query_pool=2,
        masked_unit_size=[4, 4], masked_unit_attention=[True, True, False], mlp_ratio=2.0, num_labels=CLASSES)
    return _reinit(transformers.HieraForImageClassification(config) if head else transformers.HieraModel(config))


def _logit(model, x):
    return model(pixel_values=x).logits[:, 1]


VECTOR = torch.randn(64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _score(model, x):  # headless: a projection of the mean of the last tokens
    return model(pixel_values=x).last_hidden_state.mean(dim=1) @ VECTOR.to(x.dtype)


def dense_chain(model, x, score):
    """Dense calls in the unrolled order, and the unrolled position of every stage-0 grid token."""
    hiera = getattr(model, "hiera", model)
    taped = iter(taped_attention(model, x, score))
    b = x.shape[0]
    grid = (SIZE[0] // 4, SIZE[1] // 4)
    n = grid[0] * grid[1]
    items = []
    for stage in hiera.encoder.stages:
        for layer in stage.layers:
            attn = layer.attn
            a, g = next(taped)  # (B, heads, nW, n_q, n_k): Hugging Face keeps the window dim, also of size 1
            q = attn.query_stride
            n_out = n // q
            windows = n // (q * attn.window_size) if attn.use_mask_unit_attn else 1
            assert a.shape[:3] == (b, attn.num_heads, windows)
            a, g = a.transpose(1, 2), g.transpose(1, 2)
            items.append(hiera_call(a, g, n, q, windows))
            n = n_out
    u = torch.full((b, n), 1.0 / n, dtype=torch.float64)
    order = unroll(torch.arange(grid[0] * grid[1], dtype=torch.float64).view(1, -1, 1), image_shape=SIZE,
                   patch_stride=model.config.patch_stride, schedule=hiera.unroll_schedule)[0, :, 0].long()
    return items, u, order, grid


@pytest.mark.parametrize("head", [True, False], ids=["classifier", "headless"])
def test_hugging_face_hiera_matches_the_dense_float64_oracle(head):
    model = hf_hiera(head)
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    score = _logit if head else _score
    items, u, order, grid = dense_chain(model, x, score)
    ex = vx.Explainer(model)
    assert ex.family == "hier" and type(ex.adapter).__name__ == "HFHieraAdapter"
    target = 1 if head else (lambda pooled: pooled @ VECTOR.float())
    methods = ["rollout", "generic", "grad_rollout"]
    for method, e in zip(methods, ex.explain(x, method=methods, target=target)):
        unrolled = carry(items, u, method)
        want = torch.zeros_like(unrolled)
        want[:, order] = unrolled  # unrolled position t holds grid token order[t]
        want = want.view(2, *grid)
        assert e.maps.shape == (2, *grid) == (2, *e.layout.grid), method
        assert e.layout.patch_size == (4, 4)
        assert_matches_oracle(e.maps, want, method)


def test_hugging_face_hiera_batch_equals_its_images_one_by_one():
    model = hf_hiera()
    x = torch.randn(3, 3, *SIZE, generator=torch.Generator().manual_seed(2))
    ex = vx.Explainer(model)
    for method, options in (("rollout", {}), ("generic", {}), ("cdam", {}), ("cdam", {"stage": 0}),
                            ("generic", {"stage": 1})):
        together = ex.explain(x, method=method, target=2, **options).maps
        alone = torch.cat([ex.explain(x[i:i + 1], method=method, target=2, **options).maps for i in range(3)])
        assert together.shape[0] == 3
        torch.testing.assert_close(together, alone, atol=1e-5 * float(alone.abs().max()) + 1e-9, rtol=1e-4)


def _timm_hiera_one_block_stage() -> nn.Module:
    from timm.models.hiera import Hiera

    torch.manual_seed(0)
    model = Hiera(img_size=64, embed_dim=16, num_heads=1, num_classes=CLASSES, stages=(1, 1, 2), q_pool=2,
                  mask_unit_size=(4, 4), mask_unit_attn=(True, True, False))
    support.reinit_heads(model)
    return model.eval()


@pytest.mark.parametrize("kind", ["timm", "hf"])
def test_cdam_on_a_stage_of_one_pooling_block_matches_finite_differences(kind):
    """Stage 1 is a single block that pools stage 0's tokens: the tokens on stage 1's grid that
    enter an attention are those of stage 2's pooling block. S_i = d/de y when that block's input
    token i is scaled by (1 + e), put on the grid by the model's own reroll."""
    model = (_timm_hiera_one_block_stage() if kind == "timm" else hf_hiera(depths=(1, 1, 2))).double()
    x = torch.randn(1, 3, *SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam", target=0, stage=1)
    assert e.maps.shape == (1, 8, 8) and e.layout.grid == (8, 8)
    norm = "blocks.2.norm1" if kind == "timm" else "hiera.encoder.stages.2.layers.0.layernorm_before"
    module = model.get_submodule(norm)
    logits = (lambda: model(x)) if kind == "timm" else (lambda: model(pixel_values=x).logits)
    # the model's own reroll of stage-1 tokens (block 1's / stage 1's output order) run on token indices
    reroll = model.reroll if kind == "timm" else model.hiera.encoder.reroll
    where = reroll(torch.arange(64, dtype=torch.float64).view(1, 64, 1), 1)[0, ..., 0]  # (8, 8): unrolled index
    for t in torch.randperm(64, generator=torch.Generator().manual_seed(0))[:12].tolist():
        numeric = token_derivative(module, (t,), lambda: logits()[0, 0])
        (i, j), = (where == t).nonzero().tolist()
        assert abs(float(e.maps[0, i, j]) - numeric) <= 1e-6 + 1e-5 * abs(numeric), (t, numeric)


def test_segformer_for_semantic_segmentation_is_refused_with_the_reason_and_what_to_do():
    """Its decode head reads every stage, which a readout of the last stage cannot describe; the
    encoder it points to is explained."""
    config = transformers.SegformerConfig(image_size=64, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                                          num_attention_heads=[1, 2, 2, 4], decoder_hidden_size=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.SegformerForSemanticSegmentation(config).eval()
    with pytest.raises(vx.UnsupportedModelError, match=r"reads the feature maps of all four stages.*model\.segformer"):
        vx.Explainer(model)
    e = vx.Explainer(model.segformer).explain(torch.randn(1, 3, *SIZE), method="generic", target=vx.targets.norm())
    assert e.maps.shape == (1, 16, 16) == (1, *e.layout.grid)


def test_raw_head_counts_the_heads_of_a_call_that_keeps_windows_where_heads_are():
    """Hugging Face Hiera's calls are (B, heads, windows, n, d), recorded with the windows where a record keeps
    heads: raw's ``head`` option counts the call's heads (1, 2, 2, 4, 4 here), not its windows. head=-1 of the
    last call is its head 3 (oracle: the eager copy's softmax of that head); head 1 of the first call, which
    has one head in 16 mask units, is refused as an option error."""
    model = hf_hiera()
    x = torch.randn(2, 3, *SIZE, generator=torch.Generator().manual_seed(1))
    items, _, _, _ = dense_chain(model, x, _logit)
    ex = vx.Explainer(model)
    last = items[-1]  # global attention over stage 2's 16 tokens (unrolled order), 4 heads
    # the model's own reroll of stage-2 tokens run on token indices: (4, 4), the unrolled index at each cell
    where = model.hiera.encoder.reroll(torch.arange(16, dtype=torch.float64).view(1, 16, 1), 2)[0, ..., 0].long()
    for head, index in ((-1, 3), (1, 1)):
        unrolled = last.probs[:, index].mean(dim=1) @ last.keys  # (B, 16) the head's mean over its queries
        e = ex.explain(x, method="raw", target=1, layer=-1, head=head)
        assert_matches_oracle(e.maps, unrolled[:, where], head)
    with pytest.raises(vx.OptionError, match=r"'head' must be in \[-1, 0\].*1 heads"):
        ex.explain(x, method="raw", layer=0, head=1)
