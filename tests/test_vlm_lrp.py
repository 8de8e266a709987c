"""AttnLRP and CP-LRP per answer word of vision-language models (LLaVA, ViP-LLaVA, Video-LLaVA, PaliGemma, Gemma 3,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-NeXT, LLaVA-NeXT-Video, LLaVA-OneVision, Idefics3, SmolVLM, InternVL,
Qianfan-OCR, Mistral 3, LightOnOCR, Pixtral-12B's layout, mllama): a hand-written oracle, the model left as found,
padded batches, and the refusal of families not checked.

The oracle applies the rules by hand on an eager float64 copy (forward hooks on that copy only, nothing of
vitexplain's): q / k / v projections' gradients x 1/4, 1/4, 1/2 by ``y * s + (y * (1 - s)).detach()`` (CP-LRP: q
and k detached), LayerNorm / RMSNorm with the standard deviation detached, activations ``x * (f(x) / x).detach()``
(the identity rule), and the gated MLP's ``act(gate) * up`` with each factor's gradient halved (the uniform rule);
then ``x * dlogit/dx`` at the pixels, summed over channels and per 8 x 8 cell of the 32 x 32 processed image (Qwen:
per 4 consecutive patch rows, a 2 x 2 merge block, the order test_qwen2_vl_patch_rows_are_merge_blocks checks;
LLaVA-NeXT / OneVision: per 4 x 4 px patch of each 16 px piece, then which patches each token sums read from the
model's own ``pack_image_features`` on patch codes, see :func:`_anyres_sums`; Idefics3 / SmolVLM: the same patches,
each token's read from the model's own ``pixel_shuffle`` of patch codes, :func:`_shuffle_sums`; InternVL, Qianfan-OCR:
the same on their (P, C, H, W) pieces; Mistral 3, LightOnOCR, Pixtral: per patch of the resized image, each token's
patches read from the model's own ``patch_merger``, :func:`_merged_tokens`; mllama: per 4 x 4 px patch of each real
tile, tile after tile).
"""

from __future__ import annotations

from copy import deepcopy as copy_module

import pytest
import torch
from torch import nn

import vitexplain as vx
import vlm_helpers as helpers

PROMPT, CAPTION = "what color is the shape", "a red circle on left"


def _half(y: torch.Tensor, share: float) -> torch.Tensor:
    """``y`` whose gradient is multiplied by ``share``."""
    return y * share + (y * (1 - share)).detach()


def _hand_rules(model: nn.Module, variant: str) -> list:
    """Forward hooks on an eager copy that apply the rules by hand; returns the handles."""
    handles = []

    def scale(share):
        def hook(module, inputs, output):
            return output.detach() if share == 0 else _half(output, share)
        return hook

    def layer_norm(module, inputs, output):
        x = inputs[0]
        mean = x.mean(-1, keepdim=True)
        std = (x.var(-1, unbiased=False, keepdim=True) + module.eps).sqrt()
        return ((x - mean) / std.detach() * module.weight + module.bias).contiguous()  # (the layout F.layer_norm gives)

    def rms_norm(module, inputs, output):
        x = inputs[0]
        if hasattr(module, "variance_epsilon"):  # Llama: x / rms * w
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon).detach() * module.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps).detach() * (1 + module.weight)  # Gemma

    def identity(gated):
        def hook(module, inputs, output):
            x = inputs[0]
            out = x * (output / x).detach()
            return _half(out, 0.5) if gated else out
        return hook

    qk = 0.0 if variant == "cp" else 0.25
    v = 1.0 if variant == "cp" else 0.5

    def fused_qkv(module, inputs, output):  # Qwen2-VL's tower: one linear gives q, k, v (thirds of the last dim)
        d = output.shape[-1] // 3
        share = torch.tensor([qk] * (2 * d) + [v] * d, dtype=output.dtype)
        return output * share + (output * (1 - share)).detach()

    gated = {name.rsplit(".", 1)[0] for name, _ in model.named_modules() if name.endswith(".up_proj")}  # gated MLPs
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "qkv":
            handles.append(module.register_forward_hook(fused_qkv))
        elif leaf in ("q_proj", "k_proj"):
            handles.append(module.register_forward_hook(scale(qk)))
        elif leaf == "v_proj" and v != 1.0:
            handles.append(module.register_forward_hook(scale(v)))
        elif leaf == "up_proj":
            handles.append(module.register_forward_hook(scale(0.5)))
        elif isinstance(module, nn.LayerNorm):
            handles.append(module.register_forward_hook(layer_norm))
        elif type(module).__name__.endswith("RMSNorm"):
            handles.append(module.register_forward_hook(rms_norm))
        elif leaf in ("activation_fn", "act_fn", "act") or isinstance(module, nn.GELU):
            handles.append(module.register_forward_hook(identity(gated=name.rsplit(".", 1)[0] in gated)))
    return handles


def _anyres_sums(model: nn.Module, sizes: torch.Tensor) -> torch.Tensor:
    """(n, P * g * g) 0 / 1: which patches (of the P pieces: the thumbnail, then the tiles; g x g patches each,
    row-major) each pixel-bearing token of a LLaVA-NeXT / OneVision image sums, read from the model's own packing of patch codes
    (``pack_image_features`` on features that are each patch's index + 1, the newline a 0). OneVision's interpolated
    grid: each patch of the grid packed without interpolation goes to the coarse cell that holds its centre."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config, inner = model.config, model.model
    g = config.vision_config.image_size // config.vision_config.patch_size
    pieces = image_size_to_num_patches(sizes[0].tolist(), config.image_grid_pinpoints, config.vision_config.image_size)
    codes = torch.arange(1, pieces * g * g + 1, dtype=torch.float64).reshape(pieces, g * g, 1)
    newline = torch.zeros(1, dtype=torch.float64)

    def pack(aspect):
        if aspect is None:
            return inner.pack_image_features([codes], sizes, "default", image_newline=newline)[0][0][:, 0]
        return inner.pack_image_features([codes], sizes, image_newline=newline, vision_aspect_ratio=aspect)[0][0][:, 0]

    onevision = hasattr(config, "vision_aspect_ratio")
    full = pack("anyres_max_100000" if onevision else None)  # every kept patch its own token, rows ended by a 0
    coarse = pack(config.vision_aspect_ratio) if onevision else full
    rows_u = int((full[g * g:] == 0).sum())
    kept = full[g * g:].reshape(rows_u, -1)[:, :-1]  # (H_u, W_u) patch codes
    gh = int((coarse[g * g:] == 0).sum())
    gw = coarse[g * g:].numel() // gh - 1
    sums = torch.zeros(g * g + gh * gw, pieces * g * g, dtype=torch.float64)
    for k in range(g * g):
        sums[k, int(full[k]) - 1] = 1
    h_u, w_u = kept.shape
    for i in range(h_u):
        for j in range(w_u):
            token = g * g + int((i + 0.5) * gh / h_u) * gw + int((j + 0.5) * gw / w_u)
            sums[token, int(kept[i, j]) - 1] = 1
    return sums


def _shuffle_sums(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """(n, P * g * g) 0 / 1: which patches (of the P pieces of (1, P, C, H, W) ``pixels``, g x g patches each,
    row-major) each token of an Idefics3 / SmolVLM / InternVL image sums, read from the model's own ``pixel_shuffle``
    of patch codes (each patch's index + 1), over the pieces the model keeps (not all zero), in their order."""
    config = model.config
    size, patch = config.vision_config.image_size, config.vision_config.patch_size  # (InternVL: [h, w] lists)
    g = (size[0] if isinstance(size, list) else size) // (patch[0] if isinstance(patch, list) else patch)
    real = int((pixels[0] != 0).flatten(1).any(dim=1).sum())
    codes = torch.arange(1, real * g * g + 1, dtype=torch.float64).reshape(real, g * g, 1)
    if hasattr(config, "downsample_ratio"):  # InternVL's shuffle of (P, g, g, D) features
        shuffled = model.model.pixel_shuffle(codes.reshape(real, g, g, 1), config.downsample_ratio)
        shuffled = shuffled.reshape(-1, round(1 / config.downsample_ratio ** 2))
    else:
        shuffled = model.model.connector.pixel_shuffle(codes, config.scale_factor).reshape(-1, config.scale_factor ** 2)
    sums = torch.zeros(shuffled.shape[0], pixels.shape[1] * g * g, dtype=torch.float64)
    for token, held in enumerate(shuffled.long()):
        sums[token, held - 1] = 1
    return sums


def _merged_tokens(model: nn.Module, pixels: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """(n,) relevance of the tokens of a Pixtral-tower image from (H, W) pixel relevance of the padded batch: the
    resized ``sizes[0]`` pixels summed per patch, each token's patches read from the model's own ``patch_merger`` of patch codes
    (each patch's index + 1; Pixtral-12B's layout has no merger: a token per patch, row-major)."""
    p = model.config.vision_config.patch_size
    rh, rw = (int(v) for v in sizes[0])
    patches = pixels[:rh, :rw].reshape(rh // p, p, rw // p, p).sum(dim=(1, 3)).flatten()
    merger = next((m for n, m in model.named_modules() if n.endswith("patch_merger")), None)
    if merger is None:
        return patches
    unfold = copy_module(merger)
    unfold.merging_layer = nn.Identity()  # (the merger's unfold alone: each token's patches' codes)
    codes = torch.arange(1, patches.numel() + 1, dtype=torch.float64)[:, None]
    held = unfold(codes, sizes).long() - 1  # (n, merge ** 2) the patches of each token
    return patches[held].sum(dim=1)


def hand_lrp(model: nn.Module, proc, image, prompt: str, caption: str, variant: str) -> torch.Tensor:
    """(T, 16) relevance of the 4 x 4 image tokens (8 x 8 pixel cells of the 32 x 32 processed image) for each caption
    word, by the hand rules in float64. The teacher-forced inputs are the adapter's (checked on their own by the
    eager-attention oracle of tests/vlm_checks.py); the rules and the pooling are written here."""
    copy = helpers.eager_copy(model).double()
    handles = _hand_rules(copy, variant)
    try:
        adapter = vx.Explainer(model, processor=proc).adapter
        inputs = adapter.prepare([image], [prompt])
        answer = torch.tensor([adapter.encode_answer(caption)])
        kwargs = adapter.teacher_inputs(inputs, answer)
        key = next(k for k in ("pixel_values", "pixel_values_images") if k in kwargs)
        x = kwargs[key].double().requires_grad_(True)
        kwargs[key] = x
        logits = copy(**kwargs, use_cache=False).logits
        start = inputs["input_ids"].shape[1]
        out = []
        for t in range(answer.shape[1]):
            (grad,) = torch.autograd.grad(logits[0, start - 1 + t, answer[0, t]], x, retain_graph=True)
            if x.dim() == 6:  # mllama: (1, 1, max tiles, C, 16, 16), the real tiles first; 4 x 4 patches of 4 px each
                tiles = int(kwargs["aspect_ratio_mask"].sum())
                pixels = (x * grad).sum(dim=3)[0, 0, :tiles]  # (tiles, 16, 16)
                out.append(pixels.reshape(tiles, 4, 4, 4, 4).sum(dim=(2, 4)).flatten())  # tile-major, row-major patches
                continue
            if x.dim() == 5 or hasattr(copy.config, "downsample_ratio"):
                # LLaVA-NeXT / OneVision / Idefics3: (1, P, C, 16, 16), InternVL: (P, C, 16, 16): 4 x 4 patches each
                if "image_sizes" in kwargs:
                    sums = _anyres_sums(copy, kwargs["image_sizes"])
                else:
                    sums = _shuffle_sums(copy, x.detach().reshape(1, -1, *x.shape[-3:]))
                pieces = (x * grad).sum(dim=-3).reshape(-1, 16, 16)  # (P, 16, 16) channels summed
                patches = pieces.reshape(-1, 4, 4, 4, 4).sum(dim=(2, 4)).flatten()[: sums.shape[1]]
                out.append(sums @ patches)
                continue
            if "image_sizes" in kwargs:  # Mistral 3, LightOnOCR, Pixtral: (1, C, H, W) resized pixels, patches merged
                out.append(_merged_tokens(copy, (x * grad).sum(dim=1)[0], kwargs["image_sizes"]))
                continue
            if x.dim() == 2:  # Qwen2-VL: (patches, channels x frames x pixels), 2 x 2 merge blocks of 4 rows each
                out.append((x * grad).sum(dim=1).reshape(-1, 4).sum(dim=1))
                continue
            pixels = (x * grad).sum(dim=1)  # (P, 32, 32): the image (Gemma 3 pan-and-scan: then its crops)
            out.append(pixels.reshape(-1, 4, 8, 4, 8).sum(dim=(2, 4)).flatten())
        return torch.stack(out).detach()
    finally:
        for handle in handles:
            handle.remove()


FAMILIES = ["llava", "vipllava", "video_llava", "paligemma", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_next",
            "llava_next_video", "onevision", "idefics3", "smolvlm", "internvl", "qianfan_ocr", "mistral3", "lighton_ocr",
            "pixtral", "mllama"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("method, variant", [("attnlrp", "attnlrp"), ("cp_lrp", "cp")])
def test_per_word_token_relevance_equals_the_hand_written_rules(method, variant, name):
    """vitexplain's per-word token relevance on the fused float32 model equals the hand rules on an eager float64
    copy, for every family offered. Measured worst error 1.5e-6 of the map's largest value (float32 rounding; 8
    families x 6 images x 2 variants); the tiled families (LLaVA-NeXT, -Video, OneVision: 16 images of 4 sizes x 2
    variants each, this oracle) up to 5.0e-6, Idefics3 / SmolVLM / InternVL / Qianfan-OCR up to 5.6e-7, Mistral 3 /
    LightOnOCR / Pixtral up to 2.0e-6, mllama 8.3e-7; bound 3e-5, a 6x margin over the worst,
    while leaving out the halves (the gate product's and v's) changes a map by 2.3x its scale, an epsilon of 1e-10 in
    the RMSNorm rule's ratio (fixed) by 1.3e-4, stitching the tiles column-major or skipping the unpad by >= 0.6, and
    Idefics3's or InternVL's global image put first or their shuffle blocks transposed by >= 0.57, Mistral 3's merged
    grid transposed by >= 0.92, mllama's tiles reversed or patches transposed by >= 0.84."""
    model, proc = helpers.BUILDERS[name]()
    for image in helpers.images(11):
        e = vx.Explainer(model, processor=proc).explain_caption([image], method=method, prompt=PROMPT, caption=CAPTION)
        got = e.token_scores[0].double()
        want = hand_lrp(model, proc, image, PROMPT, CAPTION, variant)
        scale = want.abs().max()
        assert scale > 0
        err = float((got - want).abs().max() / scale)
        assert err < 3e-5, err


@pytest.mark.parametrize("tower, strategy", [("clip", "full"), ("siglip", "default"), ("siglip", "full")])
def test_llava_towers_and_feature_strategies(tower, strategy):
    """LLaVA's other towers and strategies against the same oracle: "full" with CLIP keeps the class token (no pixels:
    it scores 0, the 16 patches follow); "default" with SigLIP drops patch (0, 0) (its pixels are left out: the 15
    tokens are patches 1..15). Bound as above (measured up to 5.6e-7 over 3 images each)."""
    from test_vlm_llava_towers import _llava

    model, proc, _ = _llava(tower, strategy)
    image = helpers.images(12, ((40, 52),))[0]
    got = vx.Explainer(model, processor=proc).explain_caption([image], method="attnlrp", prompt=PROMPT,
                                                              caption=CAPTION).token_scores[0].double()
    want = hand_lrp(model, proc, image, PROMPT, CAPTION, "attnlrp")
    if tower == "clip":  # the class token first, without pixels
        assert got.shape[1] == 17 and got[:, 0].abs().max() == 0
        got = got[:, 1:]
    elif strategy == "default":  # patch (0, 0) dropped
        assert got.shape[1] == 15
        want = want[:, 1:]
    assert float((got - want).abs().max() / want.abs().max()) < 3e-5


def test_eager_attention_gives_the_same_relevance():
    """The same model with eager attention (softmax and two matmuls in Python: the rules' uniform rule on both
    products) gives the fused model's relevance. Measured up to 5.9e-7 of the scale (3 image pairs); bound 1e-4."""
    model, proc = helpers.llava()
    images = helpers.images(4)
    fused = vx.Explainer(model, processor=proc).explain_caption(images, method="attnlrp", prompt=PROMPT, caption=CAPTION)
    eager = vx.Explainer(helpers.eager_copy(model), processor=proc).explain_caption(
        images, method="attnlrp", prompt=PROMPT, caption=CAPTION)
    for got, want in zip(eager.token_scores, fused.token_scores):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("name", ["llava", "paligemma", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_next",
                                  "onevision", "idefics3", "smolvlm", "internvl", "mistral3", "pixtral", "mllama"])
def test_a_padded_batch_equals_each_image_alone(name):
    """Two images of different sizes, prompts and answers of different lengths (left padding, answer padding) give
    each image's maps and token relevance as alone (measured up to 9.3e-7 of the scale, 3 pairs x 15 families; bound
    1e-4); words past an answer's
    end score 0."""
    model, proc = helpers.BUILDERS[name]()
    ex = vx.Explainer(model, processor=proc)
    images = helpers.images(5)
    prompts, captions = ["what is", "what color is the shape"], ["red circle", "a blue square on left"]
    for method in ("attnlrp", "cp_lrp"):
        both = ex.explain_caption(images, method=method, prompt=prompts, caption=captions)
        for b in range(2):
            alone = ex.explain_caption([images[b]], method=method, prompt=prompts[b], caption=captions[b])
            t = alone.token_scores[0].shape[0]
            scale = alone.token_scores[0].abs().max()
            assert float((both.token_scores[b][:t] - alone.token_scores[0]).abs().max() / scale) < 1e-4
            assert both.token_scores[b][t:].abs().sum() == 0
            assert float((both.image_maps[b][:t] - alone.image_maps[0]).abs().max() / scale) < 1e-4


def test_the_model_is_left_as_found_and_other_models_unchanged():
    """After attnlrp: parameters, grads, hooks, training flag and attention implementation as found; another model's
    explanation (a second LLaVA's cross_grad, and this model's own cross_grad) is bit for bit what it was before."""
    model, proc = helpers.llava()
    other, other_proc = helpers.llava(vip=True)
    images = helpers.images(6)

    def others():
        return [vx.Explainer(other, processor=other_proc).explain_caption(images, method="cross_grad", prompt=PROMPT,
                                                                          caption=CAPTION).maps,
                vx.Explainer(model, processor=proc).explain_caption(images, method="cross_grad", prompt=PROMPT,
                                                                    caption=CAPTION).maps]

    before_maps = others()
    hooks = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
             for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    modes = {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules() if hasattr(m, "config")}
    vx.Explainer(model, processor=proc).explain_caption(images, method=["attnlrp", "cp_lrp"], prompt=PROMPT,
                                                        caption=CAPTION)
    assert {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for n, m in model.named_modules()} == hooks
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert {n: getattr(m.config, "_attn_implementation", None) for n, m in model.named_modules()
            if hasattr(m, "config")} == modes
    for got, want in zip(others(), before_maps):
        assert torch.equal(got, want)


def test_a_non_linearity_the_rules_do_not_cover_is_refused():
    """A LLaVA whose language model uses an activation module of the user's own (``x * exp(-x^2)``: a power and an
    exponential of an activation, no rule for them) is refused with a message naming them, not given maps."""
    model, proc = helpers.llava()

    class Wavelet(nn.Module):
        def forward(self, x):
            return x * torch.exp(-x.pow(2))

    for layer in model.model.language_model.layers:
        layer.mlp.act_fn = Wavelet()
    with pytest.raises(vx.UnsupportedModelError, match=r"exp of an activation.*not cover") as refused:
        vx.Explainer(model, processor=proc).explain_caption(helpers.images(7)[:1], method="attnlrp", prompt=PROMPT,
                                                            caption=CAPTION)
    # what it suggests instead is a method of vision-language models (it named the image classifiers' 'generic')
    assert "'cross_generic'" in str(refused.value) and "'generic'" not in str(refused.value)


def test_qwen2_vl_patch_rows_are_merge_blocks():
    """The patch order Qwen2-VL's pooling (and the oracle above) reads: changing the 8 x 8 pixel block of token (r, c)
    of a 32 x 32 image (4 px patches, 2 x 2 merge: 4 x 4 tokens) changes exactly the processor's patch rows
    4 (4 r + c) .. 4 (4 r + c) + 3."""
    import numpy as np

    _, proc = helpers.BUILDERS["qwen2_vl"]()
    image = helpers.images(9, ((32, 32),))[0]
    base = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    assert base.shape[0] == 64
    for r, c in ((0, 1), (2, 3), (3, 0)):
        other = image.copy()
        other[8 * r: 8 * r + 8, 8 * c: 8 * c + 8] = 255 - other[8 * r: 8 * r + 8, 8 * c: 8 * c + 8]
        rows = (proc.image_processor(images=[other], return_tensors="pt")["pixel_values"] != base).any(dim=1)
        token = 4 * r + c
        assert rows.nonzero()[:, 0].tolist() == list(range(4 * token, 4 * token + 4))
    assert np.array_equal(image, helpers.images(9, ((32, 32),))[0])


def test_mllama_text_before_the_image_equals_the_hand_written_rules():
    """mllama with text before ``<|image|>`` (those rows read every tile key, padding tiles included, and pass it on
    through self-attention): the relevance at the image's real tiles still equals the oracle's (measured up to 6.0e-7 of
    the scale over 3 images x 2 variants; bound 3e-5 as above)."""
    model, proc = helpers.BUILDERS["mllama"]()
    prompt = "a the <|image|> what is"
    for image in helpers.images(3, ((40, 52), (20, 64))):
        for method, variant in (("attnlrp", "attnlrp"), ("cp_lrp", "cp")):
            got = vx.Explainer(model, processor=proc).explain_caption([image], method=method, prompt=prompt,
                                                                      caption="red circle").token_scores[0].double()
            want = hand_lrp(model, proc, image, prompt, "red circle", variant)
            assert float((got - want).abs().max() / want.abs().max()) < 3e-5


def test_gemma3_pan_and_scan_crops_equal_the_hand_written_rules():
    """Gemma 3 with pan-and-scan crops: the whole image's 16 tokens, then 16 per crop, each its own 32 x 32 piece of
    pixels, against the same oracle (measured up to 1.5e-6 of the scale over 6 elongated images x 2 variants; bound 3e-5
    as above; putting the whole image's tokens last errs by 1.6); an elongated image does get crops here (> 16 tokens)."""
    model, proc = helpers.BUILDERS["gemma3_pan_and_scan"]()
    for image in helpers.images(8, ((20, 60), (64, 24))):
        for method, variant in (("attnlrp", "attnlrp"), ("cp_lrp", "cp")):
            got = vx.Explainer(model, processor=proc).explain_caption([image], method=method, prompt="what is",
                                                                      caption="red").token_scores[0].double()
            want = hand_lrp(model, proc, image, "what is", "red", variant)
            assert got.shape[1] > 16
            assert float((got - want).abs().max() / want.abs().max()) < 3e-5


@pytest.mark.parametrize("name", ["qwen3_5", "blip2", "paligemma2", "aya_vision", "cohere2_vision"])
def test_families_not_checked_are_refused(name):
    """VLM families whose pixel-to-token pooling has no oracle case are refused with the reason, not given maps."""
    model, proc = helpers.BUILDERS[name]()
    ex = vx.Explainer(model, processor=proc)
    assert "attnlrp" not in ex.methods() and "cp_lrp" not in ex.methods()
    with pytest.raises(vx.VitexplainError, match="(checked against a hand-written oracle on LLaVA|soft-caps its attention|LayerNorm written out)"):
        ex.explain_caption(helpers.images(8)[:1], method="attnlrp", prompt="what is", caption="red")


def test_per_word_pointing_on_shapes_vlm():
    """attnlrp and cp_lrp per word on the bundled shapes-vlm point at the object each colour / shape word names
    (benchmarks/vlm_pointing.py's protocol, written out here). Measured there (200 two-object images of seed 20,000, 800 words):
    attnlrp 0.991 (SE 0.003), cp_lrp 0.994 (SE 0.003). This test draws 60 other images (seed 40,000, 240 words),
    whose own SE at p = 0.991 is 0.006; floor = 0.991 - 3 x 0.006 = 0.973, for both."""
    from vitexplain.data import COLORS, SHAPES

    model = vx.zoo.load("shapes-vlm")
    ex = vx.Explainer(model, processor=vx.zoo.processor(model))
    batch = vx.data.shapes(60, seed=40_000, num_objects=2)
    results = ex.explain_caption(list(batch.images), method=["attnlrp", "cp_lrp"], caption=batch.captions,
                                 prompt="describe the image")
    for r in results:
        hits = []
        for i, caption in enumerate(batch.captions):
            words = caption.split()
            assert r.tokens[i][: len(words)] == words
            for w, (word, obj) in enumerate(zip(words, batch.word_objects[i])):
                if word in set(COLORS) | set(SHAPES):
                    hits.append(bool(vx.metrics.pointing_game(r.maps[i, w][None], batch.masks[i][obj][None])[0]))
        assert len(hits) == 240
        assert sum(hits) / len(hits) >= 0.973, (r.method, sum(hits) / len(hits))


@pytest.mark.parametrize("name", ["llava", "gemma3", "qwen2_vl"])
def test_frozen_weights_give_the_same_relevance(name):
    """Weights with ``requires_grad=False`` (a frozen model, the usual inference setting) give the relevance of the
    trainable one: which products count as products of two activations is read from the graph, not from the weights'
    flags (measured 0 difference; bound 1e-6 of the scale), and the flags are left as they were."""
    model, proc = helpers.BUILDERS[name]()
    ex = vx.Explainer(model, processor=proc)
    images = helpers.images(13)
    want = ex.explain_caption(images, method="attnlrp", prompt=PROMPT, caption=CAPTION).token_scores
    model.requires_grad_(False)
    got = ex.explain_caption(images, method="attnlrp", prompt=PROMPT, caption=CAPTION).token_scores
    assert not any(p.requires_grad for p in model.parameters())
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-6
