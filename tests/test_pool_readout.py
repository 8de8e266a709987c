"""Attention-pooling heads (SigLIP's MAP, AIMv2's): the pooling query's attention row is the readout.

Such a head reads no class token and no mean: a learned query attends over the final tokens and its
output is that attention's weighted sum of them (then a projection and an MLP). So the attention
methods start from that row v, as recorded in the explained forward (docs/methods.md, "Readout"):
raw = v A_L, rollout = v A_hat_L ... A_hat_1, Chefer's generic = v' (R - I) with v' the pooling row's
``mean_h(clamp(dy/dA * A, 0))`` (the identity's share removed, as for average pooling: docs/methods.md).
Each is checked against a float64 oracle built here from an eager copy's softmax outputs and their
gradients.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitexplain as vx
from hier_oracle import taped_attention

SIZE, PATCH, TARGET = 32, 8, 1
N = (SIZE // PATCH) ** 2


def _rownorm(m: torch.Tensor) -> torch.Tensor:
    s = m.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, m / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(m))


def _oracle(tape: list[tuple[torch.Tensor, torch.Tensor]], method: str) -> torch.Tensor:
    """(B, N) map of ``method`` from the blocks' and the pooling head's (A, dy/dA), float64."""
    *blocks, (pool, pool_grad) = tape
    eye = torch.eye(blocks[0][0].shape[-1], dtype=torch.float64)
    if method == "raw":
        v = pool.mean(dim=1)[:, 0]
        return torch.einsum("bn,bnm->bm", v, blocks[-1][0].mean(dim=1))
    if method == "rollout":
        v, r = pool.mean(dim=1)[:, 0], eye
        for a, _ in blocks:
            r = _rownorm(0.5 * a.mean(dim=1) + 0.5 * eye) @ r
        return torch.einsum("bn,bnm->bm", v, r)
    if method == "grad_rollout":
        v, r = _rownorm((pool * pool_grad).mean(dim=1).clamp(min=0))[:, 0], eye
        for a, g in blocks:
            r = _rownorm(0.5 * (a * g).mean(dim=1).clamp(min=0) + 0.5 * eye) @ r
        return torch.einsum("bn,bnm->bm", v, r - eye)
    if method == "generic":
        v, r = (pool * pool_grad).clamp(min=0).mean(dim=1)[:, 0], eye.expand(pool.shape[0], -1, -1)
        for a, g in blocks:
            r = r + (a * g).clamp(min=0).mean(dim=1) @ r
        return torch.einsum("bn,bnm->bm", v, r - eye)
    raise AssertionError(method)


@pytest.fixture(scope="module")
def map_vit():
    torch.manual_seed(3)
    model = VisionTransformer(img_size=SIZE, patch_size=PATCH, embed_dim=32, depth=3, num_heads=2, num_classes=5,
                              class_token=False, global_pool="map").eval()
    with torch.no_grad():  # peaked attention (a random init attends almost uniformly), the pooling query's too
        model.attn_pool.latent.mul_(8.0)
        for block in model.blocks:
            block.attn.qkv.weight.normal_(std=0.4)
    return model


def test_the_layout_says_the_pooling_head_reads_out(map_vit):
    assert vx.Explainer(map_vit).adapter.layout((SIZE, SIZE)).readout == "pool"


@pytest.mark.parametrize("method", ["raw", "rollout", "grad_rollout", "generic"])
def test_timm_map_head_maps_equal_the_oracle(map_vit, method):
    x = torch.randn(3, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    tape = taped_attention(map_vit, x, TARGET)
    assert [a.shape[-2] for a, _ in tape] == [N, N, N, 1]  # three blocks, then the pooling query
    want = _oracle(tape, method).reshape(3, SIZE // PATCH, SIZE // PATCH)
    target = TARGET if method in ("grad_rollout", "generic") else None  # (raw and rollout read no class)
    got = vx.Explainer(map_vit).explain(x, method=method, target=target).maps
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # the pooling row matters: the tokens' mean as the readout (what was used before) gives another map
    mean_readout = _oracle([*tape[:-1], (torch.full_like(tape[-1][0], 1 / N), tape[-1][1])], method)
    if method in ("raw", "rollout"):
        assert not torch.allclose(want.flatten(1), mean_readout, atol=1e-3 * float(want.abs().max()))


def test_a_head_returning_its_latent_queries_unpooled_is_refused():
    model = VisionTransformer(img_size=SIZE, patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              class_token=False, global_pool="map").eval()
    model.attn_pool.pool = ""
    ex = vx.Explainer(model)
    assert "rollout" not in ex.methods() and "cdam" in ex.methods()
    with pytest.raises(vx.UnsupportedMethodError, match="latent queries"):
        ex.explain(torch.randn(1, 3, SIZE, SIZE), method="rollout")


def _hf_towers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    common = dict(image_size=SIZE, patch_size=PATCH, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2)
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common)).eval()
    aimv2 = transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(**common, use_head=True)).eval()
    with torch.no_grad():
        siglip.head.probe.mul_(8.0)
        aimv2.head.cls_token.normal_(std=2.0)  # (zeros at init: the query would attend uniformly)
    return {"siglip": siglip, "aimv2": aimv2}


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, H, 1, E) queries over (B, H, N, E) keys with an explicit softmax (which the tape sees)."""
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v


def _siglip_head(self, query, key, value, *args, **kwargs):
    """nn.MultiheadAttention (SigLIP's head, batch first) written out: its softmax runs inside torch's
    functional MHA, which a torch function mode sees as one call."""
    b, n, d = key.shape
    h = self.num_heads
    wq, wk, wv = self.in_proj_weight.chunk(3)
    bq, bk, bv = self.in_proj_bias.chunk(3)
    split = lambda t: t.reshape(b, -1, h, d // h).transpose(1, 2)  # noqa: E731
    out = _attend(split(query @ wq.T + bq), split(key @ wk.T + bk), split(value @ wv.T + bv))
    return self.out_proj(out.transpose(1, 2).reshape(b, -1, d)), None


def _aimv2_head(self, hidden):
    """AIMv2's head with an explicit softmax (its own forward calls SDPA)."""
    b, n, d = hidden.shape
    h = self.num_heads
    split = lambda t: t.reshape(b, -1, h, d // h).transpose(1, 2)  # noqa: E731
    out = _attend(split(self.cls_token.expand(b, -1, -1)), split(self.k_proj(hidden)), split(self.v_proj(hidden)))
    return self.output_proj(out.transpose(1, 2).reshape(b, 1, d).mean(dim=1))


@pytest.mark.parametrize("name", ["siglip", "aimv2"])
def test_hf_pooling_heads_read_out_their_query_row(name):
    model = _hf_towers()[name]
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(6))
    ex = vx.Explainer(model)
    assert ex.adapter.layout((SIZE, SIZE)).readout == "pool"

    def pooled_norm(m, images):
        return m(pixel_values=images).pooler_output.norm(dim=-1)

    oracle = copy.deepcopy(model)  # (the explained model is left as it is)
    if name == "siglip":
        oracle.head.attention.forward = types.MethodType(_siglip_head, oracle.head.attention)
    else:
        oracle.head.forward = types.MethodType(_aimv2_head, oracle.head)
    with torch.no_grad():
        torch.testing.assert_close(pooled_norm(oracle, x), pooled_norm(model, x))  # the written-out head is the head
    tape = taped_attention(oracle, x, pooled_norm)
    # (B, H, n, N); Hugging Face's eager attention takes its softmax in float32
    tape = [(a.reshape(2, -1, *a.shape[-2:]).double(), g.reshape(2, -1, *g.shape[-2:]).double()) for a, g in tape]
    assert [a.shape[-2] for a, _ in tape] == [N, N, 1]
    for method in ("rollout", "generic"):
        want = _oracle(tape, method).reshape(2, SIZE // PATCH, SIZE // PATCH)
        got = ex.explain(x, method=method, target=vx.targets.norm()).maps
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
