"""Tiny random-init vision-language models with their processors, and an eager-attention oracle.

Offline: the tokenizer is a word-level ``PreTrainedTokenizerFast`` built here (the family's special
tokens added), the image processors are the families' own classes with tiny sizes. Shared by
``tests/test_vlm*.py`` and the support matrix (``tests/support_table.py``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

WORDS = "a the red green blue circle square triangle on left right top bottom what is color shape there and of".split()


def tokenizer(special: tuple[str, ...] = ("<image>",), bos: bool = False) -> Any:
    """A word-level fast tokenizer: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3, the special tokens, WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for word in list(special) + WORDS:
        vocab.setdefault(word, len(vocab))
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def reinit_small(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give (near-)zero weights (projectors, gates, heads that start at zero) random values, in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 1 and p.numel() > 1 and bool(p.abs().max() < 1e-6):
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
                elif "gate" in name:
                    p.fill_(1.0)
    return model


def _text(**extra: Any) -> dict[str, Any]:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, head_dim=8, **extra)


#: a tiny vision tower (32 px, 8 px patches) of the Q-Former families
_V = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)


def llava(vip: bool = False) -> tuple[nn.Module, Any]:
    """LLaVA: CLIP vision tower (32 px crop, 8 px patches: 4 x 4 tokens), Llama LM with GQA; ``vip``: ViP-LLaVA (its
    projector over two tower layers)."""
    import transformers

    tok = tokenizer(("<image>",))
    image = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = transformers.LlavaProcessor(image_processor=image, tokenizer=tok, patch_size=8,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           image_size=32, patch_size=8)
    text = dict(model_type="llama", vocab_size=len(tok), **_text())
    image_id = tok.convert_tokens_to_ids("<image>")
    if vip:
        cfg = transformers.VipLlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                          vision_feature_layer=(-1, 1))
    else:
        cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_id,
                                       vision_feature_select_strategy="default", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = (transformers.VipLlavaForConditionalGeneration if vip else transformers.LlavaForConditionalGeneration)(cfg)
    return reinit_small(model.eval()), proc


#: name -> builder of (model, processor)
BUILDERS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {"llava": lambda: llava()}


def eager_copy(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` with eager attention everywhere (the oracle's model)."""
    other = copy.deepcopy(model)
    other.set_attn_implementation("eager")
    return other


def images(seed: int, sizes: tuple[tuple[int, int], ...] = ((40, 52), (30, 30))) -> list[np.ndarray]:
    """Random uint8 RGB images of the given (H, W) sizes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def isolated_tokens(model: nn.Module) -> nn.Module:
    """A copy whose vision tower attention adds nothing (its output projections zeroed): each image
    token then depends only on its own pixels (the footprint probe's model)."""
    other = copy.deepcopy(model)
    vision = next((m for n, m in other.named_modules()
                   if n.endswith(("vision_tower", "image_tower", "vision_model", "visual", "vision_encoder"))), None)
    if vision is None:
        if not any(n.endswith("vision_embed_tokens") for n, _ in other.named_modules()):
            raise LookupError(f"found no vision tower in {type(model).__name__} to switch its attention off")
        return other  # no vision tower (Fuyu: each patch projected straight in): nothing mixes the patches
    with torch.no_grad():
        for name, module in vision.named_modules():
            if name.endswith(("self_attn.out_proj", "self_attn.o_proj", "attn.proj", "attention.output.dense",
                              "attention.o_proj", "attention.projection_layer", "self_attn.projection_layer")):  # (Pixtral's, InternVL's, Janus')
                linear = getattr(module, "linear", module)  # (Gemma 4 wraps its projections' Linear)
                linear.weight.zero_()
                if linear.bias is not None:
                    linear.bias.zero_()
    return other


def _llava_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels).pooler_output[0]


def _positions_from_mask(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0)


#: per family, what the oracle needs: the prompt as the processor wants it, the teacher-forced extras,
#: the image token id, and the probe's per-token features of one image
ORACLE: dict[str, dict[str, Any]] = {
    "llava": dict(prompt=lambda p: "<image>" + p, extend=_positions_from_mask,
                  image_token=lambda m: m.config.image_token_id, features=_llava_features,
                  placeholders=lambda m: [m.config.image_token_id]),
}


def paligemma() -> tuple[nn.Module, Any]:
    """PaliGemma: SigLIP (32 px, 8 px patches: 4 x 4 tokens), Gemma LM with GQA, prefix-LM mask."""
    import transformers

    tok = tokenizer(("<image>",))
    image = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    image.image_seq_length = 16
    proc = transformers.PaliGemmaProcessor(image_processor=image, tokenizer=tok)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=32)
    cfg = transformers.PaliGemmaConfig(vision_config=vision, text_config=dict(model_type="gemma", vocab_size=len(tok), **_text()),
                                       image_token_id=tok.convert_tokens_to_ids("<image>"), projection_dim=32)
    cfg.text_config.num_image_tokens = 16
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.PaliGemmaForConditionalGeneration(cfg).eval()), proc


def gemma3() -> tuple[nn.Module, Any]:
    """Gemma 3: SigLIP (32 px, 4 px patches: 8 x 8) average-pooled to 4 x 4 tokens, sliding-window layers."""
    import transformers

    specials = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
    tok = tokenizer(specials)
    tok.boi_token, tok.image_token, tok.eoi_token = specials
    tok.boi_token_id, tok.image_token_id, tok.eoi_token_id = tok.convert_tokens_to_ids(list(specials))
    image = transformers.Gemma3ImageProcessor(size={"height": 32, "width": 32})
    proc = transformers.Gemma3Processor(image_processor=image, tokenizer=tok, image_seq_length=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=4)
    text = dict(model_type="gemma3_text", vocab_size=len(tok), sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], **_text())
    cfg = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16,
                                    image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                                    eoi_token_id=tok.eoi_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.Gemma3ForConditionalGeneration(cfg).eval()), proc


def paligemma2() -> tuple[nn.Module, Any]:
    """PaliGemma 2: as :func:`paligemma` with a Gemma 2 LM (logit soft-capping, sliding window): eager attention,
    the only one Gemma 2 has (its softmax is recorded)."""
    import transformers

    model, proc = paligemma()
    text = dict(model_type="gemma2", vocab_size=model.config.text_config.vocab_size, sliding_window=8,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_text())
    cfg = transformers.PaliGemmaConfig(vision_config=model.config.vision_config.to_dict(), text_config=text,
                                       image_token_id=model.config.image_token_id, projection_dim=32)
    cfg.text_config.num_image_tokens = 16
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return reinit_small(transformers.PaliGemmaForConditionalGeneration(cfg).eval()), proc


#: Gemma 3 pan-and-scan settings of the tests (crops of at least 8 px, so that the tiny images are cut)
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}


def gemma3_pan_and_scan() -> tuple[nn.Module, Any]:
    """Gemma 3 whose processor cuts images with an aspect ratio >= 1.2 into crops (pan-and-scan) by default:
    the whole image's 16 tokens, then 16 per crop."""
    import transformers

    model, proc = gemma3()

    class PanAndScanProcessor(transformers.Gemma3Processor):
        images_kwargs = {**transformers.Gemma3Processor.images_kwargs, **PAN_AND_SCAN}

    return model, PanAndScanProcessor(image_processor=proc.image_processor, tokenizer=proc.tokenizer, image_seq_length=16)


BUILDERS.update(paligemma=paligemma, gemma3=gemma3, paligemma2=paligemma2, gemma3_pan_and_scan=gemma3_pan_and_scan)


def _pooled_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixels)
    out = getattr(out, "pooler_output", out)
    return out[0]


def _crop_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """Every image token of one image with pan-and-scan: the whole image's, then each crop's."""
    settings = {**proc.images_kwargs, **PAN_AND_SCAN}  # (the image processor alone has no defaults for them)
    settings = {k: v for k, v in settings.items() if k.startswith("pan_and_scan") or k == "do_pan_and_scan"}
    pixels = proc.image_processor(images=[image], return_tensors="pt", **settings)["pixel_values"]
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixels)
    return getattr(out, "pooler_output", out).flatten(0, 1)


def _paligemma_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    kwargs["position_ids"] = (kwargs["attention_mask"].cumsum(-1) - 1).clamp(min=0) + 1  # 1-indexed
    kwargs["token_type_ids"] = torch.cat([batch["token_type_ids"], torch.ones_like(ids)], 1)  # answer = causal suffix


def _gemma3_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    _positions_from_mask(kwargs, batch, ids)
    kwargs["token_type_ids"] = torch.cat([batch["token_type_ids"], torch.zeros_like(ids)], 1)  # answer = text


ORACLE.update(
    paligemma2=dict(prompt=lambda p: "<image>" + p, extend=_paligemma_extend, image_token=lambda m: m.config.image_token_id,
                    features=_pooled_features, placeholders=lambda m: [m.config.image_token_id]),
    paligemma=dict(prompt=lambda p: "<image>" + p, extend=_paligemma_extend, image_token=lambda m: m.config.image_token_id,
                   features=_pooled_features, placeholders=lambda m: [m.config.image_token_id]),
    gemma3=dict(nested=True, prompt=lambda p: "<start_of_image>" + p, extend=_gemma3_extend, image_token=lambda m: m.config.image_token_id,
                features=_pooled_features, placeholders=lambda m: [m.config.image_token_id]),
    gemma3_pan_and_scan=dict(nested=True, prompt=lambda p: "<start_of_image>" + p, extend=_gemma3_extend,
                             image_token=lambda m: m.config.image_token_id, features=_crop_features,
                             placeholders=lambda m: [m.config.image_token_id]),
)


QWEN_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def _qwen(kind: str) -> tuple[nn.Module, Any]:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: 4 px patches merged 2 x 2, dynamic resolution (<= 32 x 32 px), M-RoPE."""
    import transformers

    tok = tokenizer(QWEN_SPECIALS)
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(list(QWEN_SPECIALS))))
    pixels = dict(size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32}, patch_size=4, merge_size=2, temporal_patch_size=2)
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    text = dict(vocab_size=len(tok), rope_parameters=rope, **_text())
    video = transformers.Qwen2VLVideoProcessor(**pixels)
    if kind == "qwen2_vl":
        image = transformers.Qwen2VLImageProcessor(**pixels)
        proc = transformers.Qwen2VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2)
        cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, **ids)
        cls = transformers.Qwen2VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        image = transformers.Qwen2VLImageProcessor(**pixels)
        proc = transformers.Qwen2_5_VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)
        vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
        cfg = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, **ids)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif kind in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5: Qwen3-VL's tower (no deepstack), a hybrid LM: linear attention, then full
        image = transformers.Qwen2VLImageProcessor(**pixels)
        proc = transformers.Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)
        vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, num_position_embeddings=16)
        text = dict(text, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    rope_parameters=dict(rope, mrope_interleaved=True, partial_rotary_factor=0.5),
                    bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # (its defaults: Qwen's vocabulary)
        if kind == "qwen3_5_moe":
            text.pop("intermediate_size")  # (its MLPs are experts and a shared expert)
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
            cfg = transformers.Qwen3_5MoeConfig(vision_config=vision, text_config=text, **ids)
            cls = transformers.Qwen3_5MoeForConditionalGeneration
        else:
            cfg = transformers.Qwen3_5Config(vision_config=vision, text_config=text, **ids)
            cls = transformers.Qwen3_5ForConditionalGeneration
    else:  # Qwen3-VL, and Qwen3-VL-MoE (its language model's MLPs are experts)
        image = transformers.Qwen2VLImageProcessor(**pixels)
        proc = transformers.Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=video)
        vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0])
        text = dict(text, rope_parameters=dict(rope, mrope_interleaved=True))
        if kind == "qwen3_vl_moe":
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
            cfg = transformers.Qwen3VLMoeConfig(vision_config=vision, text_config=text, **ids)
            cls = transformers.Qwen3VLMoeForConditionalGeneration
        else:
            cfg = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, **ids)
            cls = transformers.Qwen3VLForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(cls(cfg).eval()), proc


BUILDERS.update(qwen2_vl=lambda: _qwen("qwen2_vl"), qwen2_5_vl=lambda: _qwen("qwen2_5_vl"), qwen3_vl=lambda: _qwen("qwen3_vl"),
                qwen3_vl_moe=lambda: _qwen("qwen3_vl_moe"), qwen3_5=lambda: _qwen("qwen3_5"),
                qwen3_5_moe=lambda: _qwen("qwen3_5_moe"))


def _qwen_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    batch = proc.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return out.pooler_output[0]


def _qwen_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    kwargs["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(ids)], 1)


_QWEN_ORACLE = dict(prompt=lambda p: "<|vision_start|><|image_pad|><|vision_end|>" + p, extend=_qwen_extend,
                    image_token=lambda m: m.config.image_token_id, features=_qwen_features,
                    placeholders=lambda m: [m.config.image_token_id])
ORACLE.update(qwen2_vl=_QWEN_ORACLE, qwen2_5_vl=_QWEN_ORACLE, qwen3_vl=_QWEN_ORACLE, qwen3_vl_moe=_QWEN_ORACLE,
              # (the linear-attention layers have no attention: cross_generic is refused, the oracle averages the others)
              qwen3_5=dict(_QWEN_ORACLE, methods=("cross", "cross_grad")),
              qwen3_5_moe=dict(_QWEN_ORACLE, methods=("cross", "cross_grad")))


IDEFICS_SPECIALS = ("<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>") + tuple(
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))


def _idefics(kind: str) -> tuple[nn.Module, Any]:
    """Idefics3 / SmolVLM: 16 px tiles of 4 px patches, pixel shuffle 2 (2 x 2 tokens per tile), tiles + a global image."""
    import transformers

    tok = tokenizer(IDEFICS_SPECIALS)
    sizes = dict(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
    text = dict(model_type="llama", vocab_size=len(tok), **_text())
    image_id = tok.convert_tokens_to_ids("<image>")
    if kind == "idefics3":
        proc = transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessor(**sizes), tokenizer=tok,
                                              image_seq_len=4)
        cfg = transformers.Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, image_token_id=image_id)
        cls = transformers.Idefics3ForConditionalGeneration
    else:
        video = transformers.SmolVLMVideoProcessor(**sizes)
        proc = transformers.SmolVLMProcessor(image_processor=transformers.SmolVLMImageProcessor(**sizes), tokenizer=tok,
                                             video_processor=video, image_seq_len=4)
        cfg = transformers.SmolVLMConfig(vision_config=vision, text_config=text, scale_factor=2, image_token_id=image_id)
        cls = transformers.SmolVLMForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(cls(cfg).eval()), proc


BUILDERS.update(idefics3=lambda: _idefics("idefics3"), smolvlm=lambda: _idefics("smolvlm"))


def _idefics_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    batch = proc.image_processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], pixel_attention_mask=batch.get("pixel_attention_mask"))
    out = getattr(out, "pooler_output", out)
    out = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    return out.reshape(-1, out.shape[-1])


_IDEFICS_ORACLE = dict(nested=True, prompt=lambda p: "<image>" + p, extend=_positions_from_mask,
                       image_token=lambda m: m.config.image_token_id, features=_idefics_features,
                       placeholders=lambda m: [m.config.image_token_id])
ORACLE.update(idefics3=_IDEFICS_ORACLE, smolvlm=_IDEFICS_ORACLE)




def llava_next() -> tuple[nn.Module, Any]:
    """LLaVA-NeXT: 16 px tiles of 4 px patches (4 x 4 tokens each), pinpoints 16x32, 32x16, 32x32, a thumbnail, newlines."""
    import transformers

    tok = tokenizer(("<image>",))
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    image = transformers.LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                                 image_grid_pinpoints=pinpoints)
    proc = transformers.LlavaNextProcessor(image_processor=image, tokenizer=tok, patch_size=4,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           image_size=16, patch_size=4)
    cfg = transformers.LlavaNextConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
                                       image_token_id=tok.convert_tokens_to_ids("<image>"), image_grid_pinpoints=pinpoints,
                                       vision_feature_select_strategy="default", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.LlavaNextForConditionalGeneration(cfg).eval()), proc


def _llava_next_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The packed image features without the newline tokens (rows equal to the model's image_newline)."""
    batch = proc.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"])
    features = out.pooler_output[0]
    newline = model.model.image_newline.to(features.dtype)
    return features[~(features == newline).all(-1)]


def _llava_next_pixel_tokens(model: nn.Module, batch: Any) -> list[torch.Tensor]:
    """Per image, which of its image tokens are not newlines (their features differ from image_newline)."""
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"])
    newline = model.model.image_newline
    return [~(f == newline.to(f.dtype)).all(-1) for f in out.pooler_output]


BUILDERS["llava_next"] = llava_next
ORACLE["llava_next"] = dict(prompt=lambda p: "<image>" + p, extend=_positions_from_mask,
                            image_token=lambda m: m.config.image_token_id, features=_llava_next_features,
                            pixel_tokens=_llava_next_pixel_tokens,
                            placeholders=lambda m: [m.config.image_token_id])


def llava_next_video() -> tuple[nn.Module, Any]:
    """LLaVA-NeXT-Video explaining images: :func:`llava_next`'s tiles, thumbnail and newlines (its image path is
    LLaVA-NeXT's; videos have a token of their own, ``<video>``), with its own processor and model classes."""
    import transformers

    tok = tokenizer(("<image>", "<video>"))
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    image = transformers.LlavaNextImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                                 image_grid_pinpoints=pinpoints)
    video = transformers.LlavaNextVideoVideoProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    proc = transformers.LlavaNextVideoProcessor(video_processor=video, image_processor=image, tokenizer=tok, patch_size=4,
                                                vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           image_size=16, patch_size=4)
    cfg = transformers.LlavaNextVideoConfig(
        vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
        image_token_id=tok.convert_tokens_to_ids("<image>"), video_token_id=tok.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints, vision_feature_select_strategy="default", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.LlavaNextVideoForConditionalGeneration(cfg).eval()), proc


BUILDERS["llava_next_video"] = llava_next_video
ORACLE["llava_next_video"] = ORACLE["llava_next"]


def onevision() -> tuple[nn.Module, Any]:
    """LLaVA-OneVision: as :func:`llava_next` with SigLIP (no class token) and ``anyres_max_1``, so the stitched grid is
    interpolated down."""
    import transformers

    tok = tokenizer(("<image>", "<video>"))
    pinpoints = [[16, 32], [32, 16], [32, 32]]
    image = transformers.LlavaOnevisionImageProcessor(size={"height": 16, "width": 16}, image_grid_pinpoints=pinpoints)
    video = transformers.LlavaOnevisionVideoProcessor(size={"height": 16, "width": 16})
    proc = transformers.LlavaOnevisionProcessor(image_processor=image, tokenizer=tok, video_processor=video,
                                                num_image_tokens=16, vision_feature_select_strategy="full",
                                                vision_aspect_ratio="anyres_max_1")
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4)
    cfg = transformers.LlavaOnevisionConfig(vision_config=vision, text_config=dict(model_type="qwen2", vocab_size=len(tok), **_text()),
                                            image_token_id=tok.convert_tokens_to_ids("<image>"),
                                            video_token_id=tok.convert_tokens_to_ids("<video>"), image_grid_pinpoints=pinpoints,
                                            vision_feature_select_strategy="full", vision_feature_layer=-1,
                                            vision_aspect_ratio="anyres_max_1")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.LlavaOnevisionForConditionalGeneration(cfg).eval()), proc


BUILDERS["onevision"] = onevision
ORACLE["onevision"] = dict(ORACLE["llava_next"])


def _qformer(kind: str) -> tuple[nn.Module, Any]:
    """BLIP-2 / InstructBLIP: a 32 px ViT (8 px patches: 4 x 4), a 2-layer Q-Former with 4 queries, an OPT LM."""
    import transformers

    tok = tokenizer(("<image>",))
    image = transformers.BlipImageProcessor(size={"height": 32, "width": 32})
    qformer = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, encoder_hidden_size=32,
                   vocab_size=len(tok), cross_attention_frequency=1)
    text = dict(model_type="opt", hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=len(tok),
                word_embed_proj_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common = dict(vision_config=_V, qformer_config=qformer, text_config=text, num_query_tokens=4,
                  image_token_index=tok.convert_tokens_to_ids("<image>"))
    if kind == "blip2":
        proc = transformers.Blip2Processor(image_processor=image, tokenizer=tok, num_query_tokens=4)
        cfg, cls = transformers.Blip2Config(**common), transformers.Blip2ForConditionalGeneration
    else:
        proc = transformers.InstructBlipProcessor(image_processor=image, tokenizer=tok, qformer_tokenizer=tokenizer(("<image>",)),
                                                  num_query_tokens=4)
        cfg, cls = transformers.InstructBlipConfig(**common), transformers.InstructBlipForConditionalGeneration
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(cls(cfg).eval()), proc


def _qformer_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The vision tower's patch tokens (the class token dropped): what the Q-Former's cross-attention reads."""
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model.vision_model(pixel_values=pixels).last_hidden_state[0, 1:]


def _qformer_transport(model: nn.Module) -> tuple[list, list]:
    """Forward hooks on an eager model's Q-Former cross-attention modules that keep the weights each returns
    (its ``output_attentions`` does not reach the Q-Former); the oracle averages them over layers and heads."""
    store: list = []
    handles = [m.register_forward_hook(lambda module, args, out: store.append(out[1]))
               for n, m in model.named_modules() if n.startswith("qformer.") and n.endswith("crossattention.attention")]
    return store, handles


BUILDERS.update(blip2=lambda: _qformer("blip2"), instructblip=lambda: _qformer("instructblip"))
_QFORMER_ORACLE = dict(prompt=lambda p: p, extend=_positions_from_mask, image_token=lambda m: m.config.image_token_id,
                       features=_qformer_features, placeholders=lambda m: [m.config.image_token_id],
                       lm_attentions=lambda out: out.language_model_outputs.attentions, transport=_qformer_transport)
ORACLE.update(blip2=_QFORMER_ORACLE, instructblip=_QFORMER_ORACLE)



def kosmos2() -> tuple[nn.Module, Any]:
    """Kosmos-2: a 32 px CLIP tower (8 px patches: 4 x 4), 64 latent queries over [class, patches, latents]."""
    import transformers

    tok = tokenizer(())
    image = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = transformers.Kosmos2Processor(image_processor=image, tokenizer=tok, num_patch_index_tokens=16)
    text = dict(embed_dim=32, ffn_dim=64, layers=2, attention_heads=2, vocab_size=len(tok) + 64, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)  # (+64: the processor writes ids 4..67 at the image positions)
    cfg = transformers.Kosmos2Config(vision_config=_V, text_config=text, latent_query_num=64)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = reinit_small(transformers.Kosmos2ForConditionalGeneration(cfg).eval())
    with torch.no_grad():  # random latent queries (norm ~ 4) would attend only to themselves: give the patches weight
        model.image_to_text_projection.dense.weight.mul_(30.0)
    return model, proc


def _kosmos_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    kwargs["image_embeds_position_mask"] = torch.cat([batch["image_embeds_position_mask"], torch.zeros_like(ids)], 1)


def _kosmos_transport(model: nn.Module) -> tuple[list, list]:
    store: list = []
    module = model.image_to_text_projection.x_attn
    return store, [module.register_forward_hook(lambda m, args, out: store.append(out[1]))]


BUILDERS["kosmos2"] = kosmos2
ORACLE["kosmos2"] = dict(prompt=lambda p: p, extend=_kosmos_extend, image_token=None,
                         columns=lambda batch: [row.nonzero()[:, 0] for row in batch["image_embeds_position_mask"].bool()],
                         features=_qformer_features, placeholders=lambda m: [m.config.text_config.pad_token_id],
                         transport=_kosmos_transport, patches=16)


def mllama() -> tuple[nn.Module, Any]:
    """mllama (Llama 3.2 Vision): 16 px tiles of 4 px patches (4 x 4 tokens + a class token each), at most 4 tiles;
    4 LM layers, 1 and 3 cross-attention layers (GQA), the others self-attention. Its zero-initialised tanh gates
    (cross-attention, tile and position embeddings) are set to 1 so that the image reaches the logits."""
    import transformers

    tok = tokenizer(("<|image|>", "<|python_tag|>"))
    image = transformers.MllamaImageProcessor(size={"height": 16, "width": 16}, max_image_tiles=4)
    proc = transformers.MllamaProcessor(image_processor=image, tokenizer=tok)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=16, patch_size=4, max_num_tiles=4, vision_output_dim=64, intermediate_layers_indices=[0])
    text = dict(_text(), cross_attention_layers=[1, 3], num_hidden_layers=4, vocab_size=len(tok), bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    text.pop("head_dim")
    cfg = transformers.MllamaConfig(vision_config=vision, text_config=text,
                                    image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = reinit_small(transformers.MllamaForConditionalGeneration(cfg).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate", "_gate")) and p.numel() == 1 and float(p.abs()) < 1e-6:
                p.fill_(1.0)
    return model, proc


def _mllama_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The vision tokens of the image's real tiles, class tokens dropped: (tiles * patches, D)."""
    batch = proc.image_processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        out = model.model.vision_model(pixel_values=batch["pixel_values"], aspect_ratio_ids=batch["aspect_ratio_ids"],
                                       aspect_ratio_mask=batch["aspect_ratio_mask"]).last_hidden_state[0, 0]
    tiles = int(batch["aspect_ratio_mask"][0, 0].sum())
    return out[:tiles, 1:].reshape(-1, out.shape[-1])


def _mllama_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    _positions_from_mask(kwargs, batch, ids)
    mask = batch["cross_attention_mask"]  # each answer position reads what the last prompt position reads
    kwargs["cross_attention_mask"] = torch.cat([mask, mask[:, -1:].expand(-1, ids.shape[1], -1, -1)], 1)


BUILDERS["mllama"] = mllama
ORACLE["mllama"] = dict(nested=True, prompt=lambda p: p if "<|image|>" in p else "<|image|>" + p, extend=_mllama_extend,
                        image_token=lambda m: m.config.image_token_id,  # (the one <|image|> position: no vision token there)
                        features=_mllama_features, placeholders=lambda m: [m.config.image_token_id])


def _sdpa_built(model_class: Any, cfg: Any, proc: Any) -> tuple[nn.Module, Any]:
    """``model_class(cfg)`` with SDPA attention, seeded, its (near-)zero weights given values (:func:`reinit_small`)."""
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(model_class(cfg).eval()), proc


def _token_oracle(base: dict[str, Any], attribute: str) -> dict[str, Any]:
    """The oracle ``base`` with the image token id read from ``model.config.<attribute>``."""
    return dict(base, image_token=lambda m: getattr(m.config, attribute),
                placeholders=lambda m: [getattr(m.config, attribute)])


def _pixtral_parts(patch: int, merge: int) -> tuple[Any, Any, Any]:
    """(tokenizer, processor, vision config) of a tiny Pixtral tower: longest edge 32 px, ``patch`` px patches, the
    processor's ``merge`` x ``merge`` blocks per token, rows ended by [IMG_BREAK] / [IMG_END]."""
    import transformers

    tok = tokenizer(("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    image = transformers.PixtralImageProcessor(size={"longest_edge": 32}, patch_size=patch)
    proc = transformers.PixtralProcessor(image_processor=image, tokenizer=tok, patch_size=patch, spatial_merge_size=merge,
                                         image_token="[IMG]", image_break_token="[IMG_BREAK]", image_end_token="[IMG_END]")
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              image_size=32, patch_size=patch, head_dim=16)
    return tok, proc, vision


def mistral3() -> tuple[nn.Module, Any]:
    """Mistral 3: a Pixtral tower (longest edge 32 px, 4 px patches, 2 x 2 merger: a token per 8 px block, rows
    ended by [IMG_BREAK] / [IMG_END]), a Mistral LM with GQA."""
    import transformers

    tok, proc, vision = _pixtral_parts(patch=4, merge=2)
    cfg = transformers.Mistral3Config(vision_config=vision, text_config=dict(model_type="mistral", vocab_size=len(tok), **_text()),
                                      image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                                      vision_feature_layer=-1)
    return _sdpa_built(transformers.Mistral3ForConditionalGeneration, cfg, proc)


def _merged_features(token: str) -> Callable[[nn.Module, Any, np.ndarray], torch.Tensor]:
    """The probe's per-token features of one image of a Pixtral-tower family (Mistral 3, LightOnOCR) whose prompt
    holds ``token``: the processor resizes to its merged blocks and gives the image sizes the tower reads."""

    def features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
        batch = proc(images=[image], text=[token], return_tensors="pt")
        with torch.no_grad():
            return model.get_image_features(pixel_values=batch["pixel_values"],
                                            image_sizes=batch["image_sizes"]).pooler_output[0]

    return features


BUILDERS["mistral3"] = mistral3
ORACLE["mistral3"] = dict(prompt=lambda p: "[IMG]" + p, extend=_positions_from_mask,
                          image_token=lambda m: m.config.image_token_index, features=_merged_features("[IMG]"),
                          placeholders=lambda m: [m.config.image_token_index])


def internvl() -> tuple[nn.Module, Any]:
    """InternVL: 16 px tiles of 4 px patches (4 x 4, pixel-shuffled by 0.5: 2 x 2 tokens each), up to 4 tiles plus
    a thumbnail (GotOcr2's tiling), a Qwen2 LM with GQA."""
    import transformers

    tok = tokenizer(("<img>", "</img>", "<IMG_CONTEXT>", "<video>"))
    # (InternVL's processor reads these from its tokenizer, as the checkpoints' own tokenizers carry them)
    tok.start_image_token, tok.end_image_token, tok.context_image_token, tok.video_token = (
        "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    tok.start_image_token_id, tok.end_image_token_id, tok.context_image_token_id = (
        tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
    image = transformers.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1,
                                               max_patches=4)
    proc = transformers.InternVLProcessor(image_processor=image, tokenizer=tok,
                                          video_processor=transformers.InternVLVideoProcessor(), image_seq_length=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[16, 16],
                  patch_size=[4, 4])
    cfg = transformers.InternVLConfig(vision_config=vision, text_config=dict(model_type="qwen2", vocab_size=len(tok), **_text()),
                                      image_token_id=tok.context_image_token_id, downsample_ratio=0.5, vision_feature_layer=-1)
    return _sdpa_built(transformers.InternVLForConditionalGeneration, cfg, proc)


def _tiled_features(token: str) -> Callable[[nn.Module, Any, np.ndarray], torch.Tensor]:
    """The probe's per-token features of one image of a tiled family whose prompt holds ``token``: (tiles, then the
    thumbnail, each tile's tokens in order, D)."""

    def features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
        batch = proc(images=[image], text=[token], return_tensors="pt")
        with torch.no_grad():
            out = model.get_image_features(pixel_values=batch["pixel_values"]).pooler_output
        return out.reshape(-1, out.shape[-1])

    return features


BUILDERS["internvl"] = internvl
ORACLE["internvl"] = dict(prompt=lambda p: "<IMG_CONTEXT>" + p, extend=_positions_from_mask,
                          image_token=lambda m: m.config.image_token_id, features=_tiled_features("<IMG_CONTEXT>"),
                          placeholders=lambda m: [m.config.image_token_id])


GLM_SPECIALS = ("<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>", "<|end_of_video|>")


def glm4v(kind: str = "glm4v") -> tuple[nn.Module, Any]:
    """GLM-4.1V (``kind`` "glm4v"), GLM-4.5V ("glm4v_moe": experts in its LM), GLM-4.6V ("glm46v") and GLM-OCR
    ("glm_ocr", with GLM-4.6V's processor): Qwen2-VL's geometry (4 px patches merged 2 x 2, dynamic resolution
    <= 32 x 32 px), M-RoPE, a GLM-4 LM."""
    import transformers

    tok = tokenizer(GLM_SPECIALS)
    tok.image_token = "<|image|>"  # (GLM's processor reads it from its tokenizer)
    pixels = dict(size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32}, patch_size=4, merge_size=2, temporal_patch_size=2)
    processor = transformers.Glm46VProcessor if kind in ("glm46v", "glm_ocr") else transformers.Glm4vProcessor
    proc = processor(image_processor=transformers.Glm4vImageProcessor(**pixels), tokenizer=tok,
                     video_processor=transformers.Glm4vVideoProcessor(**pixels))
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  spatial_merge_size=2, image_size=32)
    ids = dict(zip(("image_start_token_id", "image_token_id", "image_end_token_id", "video_token_id",
                    "video_start_token_id", "video_end_token_id"), tok.convert_tokens_to_ids(list(GLM_SPECIALS))))
    text = dict(vocab_size=len(tok), rope_parameters=rope, **_text())
    if kind == "glm4v_moe":
        text.update(moe_intermediate_size=32, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
                    first_k_dense_replace=1)
    config, model = {"glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration"),
                     "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration"),
                     "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration"),
                     "glm_ocr": ("GlmOcrConfig", "GlmOcrForConditionalGeneration")}[kind]
    cfg = getattr(transformers, config)(vision_config=vision, text_config=text, **ids)
    return _sdpa_built(getattr(transformers, model), cfg, proc)


BUILDERS.update(glm4v=glm4v, glm4v_moe=lambda: glm4v("glm4v_moe"), glm46v=lambda: glm4v("glm46v"),
                glm_ocr=lambda: glm4v("glm_ocr"))
ORACLE["glm4v"] = ORACLE["glm4v_moe"] = ORACLE["glm46v"] = ORACLE["glm_ocr"] = dict(
    _QWEN_ORACLE, prompt=lambda p: "<|begin_of_image|><|image|><|end_of_image|>" + p)


AYA_SPECIALS = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL",
                "TILE_1", "TILE_2", "TILE_3", "TILE_4")


def aya_vision() -> tuple[nn.Module, Any]:
    """Aya Vision: 16 px tiles of 4 px patches (SigLIP, 4 x 4, pixel-shuffled by 2: 2 x 2 tokens each), up to 4 tiles
    plus the global image (GotOcr2's tiling), a Cohere2 LM with GQA."""
    import transformers

    tok = tokenizer(AYA_SPECIALS)
    image = transformers.GotOcr2ImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1,
                                               max_patches=4)
    proc = transformers.AyaVisionProcessor(image_processor=image, tokenizer=tok, patch_size=4, img_size=16, downsample_factor=2)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4)
    cfg = transformers.AyaVisionConfig(vision_config=vision, text_config=dict(model_type="cohere2", vocab_size=len(tok), **_text()),
                                       downsample_factor=2, image_token_index=tok.convert_tokens_to_ids("<|IMG_PATCH|>"),
                                       vision_feature_select_strategy="full")
    return _sdpa_built(transformers.AyaVisionForConditionalGeneration, cfg, proc)


BUILDERS["aya_vision"] = aya_vision
ORACLE["aya_vision"] = dict(prompt=lambda p: "<image>" + p, extend=_positions_from_mask,
                            image_token=lambda m: m.config.image_token_index, features=_tiled_features("<image>"),
                            placeholders=lambda m: [m.config.image_token_index])


def pixtral() -> tuple[nn.Module, Any]:
    """Pixtral-12B's layout: LLaVA with a Pixtral tower (longest edge 32 px, 8 px patches, no merger, [IMG_BREAK] rows)."""
    import transformers

    tok, proc, vision = _pixtral_parts(patch=8, merge=1)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=dict(model_type="mistral", vocab_size=len(tok), **_text()),
                                   image_token_id=tok.convert_tokens_to_ids("[IMG]"), vision_feature_select_strategy="full",
                                   vision_feature_layer=-1)
    return _sdpa_built(transformers.LlavaForConditionalGeneration, cfg, proc)


BUILDERS["pixtral"] = pixtral
ORACLE["pixtral"] = _token_oracle(ORACLE["mistral3"], "image_token_id")


COHERE_SPECIALS = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_LINE_BREAK|>")


def cohere2_vision() -> tuple[nn.Module, Any]:
    """Command A Vision: Aya Vision's tiles plus the global image (Cohere2Vision's own canvas search, up to 4 tiles of 16 px,
    SigLIP 4 px patches pixel-shuffled by 2: 2 x 2 tokens per tile, each tile ended by a line break), a Cohere2 LM."""
    import transformers

    tok = tokenizer(COHERE_SPECIALS)
    # (Command A Vision's processor reads these from its tokenizer, as the checkpoint's own tokenizer carries them)
    tok.boi_token, tok.eoi_token, tok.image_token, tok.img_line_break_token = (
        "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<image>", "<|IMG_LINE_BREAK|>")
    tok.image_token_id = tok.convert_tokens_to_ids("<image>")
    image = transformers.Cohere2VisionImageProcessor(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1,
                                                     max_patches=4, patch_size=2)
    proc = transformers.Cohere2VisionProcessor(image_processor=image, tokenizer=tok)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4)
    cfg = transformers.Cohere2VisionConfig(vision_config=vision, text_config=dict(model_type="cohere2", vocab_size=len(tok), **_text()),
                                           downsample_factor=2, image_token_id=tok.image_token_id, alignment_intermediate_size=64)
    return _sdpa_built(transformers.Cohere2VisionForConditionalGeneration, cfg, proc)


BUILDERS["cohere2_vision"] = cohere2_vision
ORACLE["cohere2_vision"] = _token_oracle(ORACLE["aya_vision"], "image_token_id")


BUILDERS["vipllava"] = lambda: llava(vip=True)
ORACLE["vipllava"] = _token_oracle(ORACLE["llava"], "image_token_index")


def video_llava() -> tuple[nn.Module, Any]:
    """Video-LLaVA explaining images: :func:`llava`'s tower and crop as its image tower (pixels as
    ``pixel_values_images``), and a ``<video>`` token of its own."""
    import transformers

    tok = tokenizer(("<image>", "<video>"))
    image = transformers.VideoLlavaImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    video = transformers.VideoLlavaVideoProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc = transformers.VideoLlavaProcessor(image_processor=image, video_processor=video, tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                           image_size=32, patch_size=8)
    cfg = transformers.VideoLlavaConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
                                        image_token_id=tok.convert_tokens_to_ids("<image>"),
                                        video_token_id=tok.convert_tokens_to_ids("<video>"),
                                        vision_feature_select_strategy="default", vision_feature_layer=-1)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.VideoLlavaForConditionalGeneration(cfg).eval()), proc


def _video_llava_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    out = proc.image_processor(images=[image], return_tensors="pt")
    pixels = out["pixel_values_images"] if "pixel_values_images" in out else out["pixel_values"]  # (5.23 renames it)
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels).pooler_output[0]


BUILDERS["video_llava"] = video_llava
ORACLE["video_llava"] = dict(ORACLE["llava"], features=_video_llava_features)


def gemma4(moe: bool = False) -> tuple[nn.Module, Any]:
    """Gemma 4: 4 px patches pooled 2 x 2 (a token per 8 px block), at most 70 tokens (aspect ratio kept, no crop),
    bidirectional image blocks (``use_bidirectional_attention="vision"``), sliding-window and full-attention layers;
    ``moe``: experts beside the MLPs, keys as values (``attention_k_eq_v``) and a last layer reusing an earlier one's
    keys and values (``num_kv_shared_layers``), as its larger checkpoints."""
    import transformers

    specials = ("<|image>", "<|image|>", "<image|>")
    audio = ("<|audio>", "<|audio|>", "<audio|>")  # (its processor checks them even without audio)
    tok = tokenizer(specials + audio)
    tok.boi_token, tok.image_token, tok.eoi_token = specials
    tok.boi_token_id, tok.image_token_id, tok.eoi_token_id = tok.convert_tokens_to_ids(list(specials))
    tok.boa_token, tok.audio_token, tok.eoa_token = audio
    tok.audio_token_id = tok.convert_tokens_to_ids(audio[1])
    pooling = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    proc = transformers.Gemma4Processor(
        image_processor=transformers.Gemma4ImageProcessor(**pooling), tokenizer=tok, image_seq_length=70,
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(), video_processor=transformers.Gemma4VideoProcessor(**pooling))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    text = dict(_text(), vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size_per_layer_input=8,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention="vision",
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if moe:
        text.update(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
                    num_kv_shared_layers=1, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                    attention_k_eq_v=True)
    cfg = transformers.Gemma4Config(vision_config=vision, text_config=text, audio_config=None, image_token_id=tok.image_token_id,
                                    boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.Gemma4ForConditionalGeneration(cfg).eval()), proc


def _gemma4_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    batch = proc.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"])
    return out.pooler_output[0]


def _gemma4_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    _positions_from_mask(kwargs, batch, ids)
    kwargs["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(ids)], 1)  # answer = text


BUILDERS.update(gemma4=gemma4, gemma4_moe=lambda: gemma4(moe=True))
_GEMMA4_ORACLE = dict(nested=True, prompt=lambda p: "<|image|>" + p, extend=_gemma4_extend,
                      image_token=lambda m: m.config.image_token_id, features=_gemma4_features,
                      placeholders=lambda m: [m.config.image_token_id])
ORACLE.update(gemma4=_GEMMA4_ORACLE, gemma4_moe=_GEMMA4_ORACLE)


LFM2_SPECIALS = ("<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>") + tuple(
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5))


def lfm2_vl() -> tuple[nn.Module, Any]:
    """LFM2-VL: a SigLIP2 NaFlex tower (4 px patches) unshuffled 2 x 2 (a token per 8 px block); an image of more than
    16 tokens' pixels (x 2) is cut into 2 to 4 tiles of 16 px plus a thumbnail; an LFM2 LM of convolution and attention
    layers."""
    import transformers

    tok = tokenizer(LFM2_SPECIALS)
    image = transformers.Lfm2VlImageProcessor(encoder_patch_size=4, downsample_factor=2, tile_size=16, min_image_tokens=4,
                                              max_image_tokens=16, min_tiles=2, max_tiles=4)
    proc = transformers.Lfm2VlProcessor(image_processor=image, tokenizer=tok)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=4, num_patches=64)
    text = dict(_text(), vocab_size=len(tok), num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text.pop("head_dim")
    cfg = transformers.Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                                    projector_hidden_size=32, downsample_factor=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return reinit_small(transformers.Lfm2VlForConditionalGeneration(cfg).eval()), proc


def _lfm2_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """Every image token of one image: its tiles' (row-major), then the thumbnail's (or the one piece's)."""
    batch = proc.image_processor(images=[[image]], return_tensors="pt")
    with torch.no_grad():
        out = model.get_image_features(pixel_values=batch["pixel_values"], spatial_shapes=batch["spatial_shapes"],
                                       pixel_attention_mask=batch["pixel_attention_mask"])
    return torch.cat(list(out.pooler_output))


BUILDERS.update(lfm2_vl=lfm2_vl)
ORACLE.update(lfm2_vl=dict(nested=True, prompt=lambda p: "<image>" + p, extend=_positions_from_mask,
                           image_token=lambda m: m.config.image_token_id, features=_lfm2_features,
                           placeholders=lambda m: [m.config.image_token_id], methods=("cross", "cross_grad")))


JANUS_SPECIALS = ("<image_placeholder>", "<begin_of_image>", "<end_of_image>")


def janus() -> tuple[nn.Module, Any]:
    """Janus / Janus-Pro: the image letterboxed into a 32 px square (longer side 32 px, centred, padded), 8 px patches
    (4 x 4 tokens, no class token), a Llama LM with GQA; a tiny VQ-VAE (the image-generation part, unused here)."""
    import transformers

    tok = tokenizer(JANUS_SPECIALS)
    tok.image_token, tok.boi_token, tok.eoi_token = JANUS_SPECIALS  # (Janus' processor reads them from its tokenizer)
    image = transformers.JanusImageProcessor(size={"height": 32, "width": 32}, min_size=4)
    proc = transformers.JanusProcessor(image_processor=image, tokenizer=tok, num_image_tokens=16)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32,
                  mlp_ratio=2.0, num_image_tokens=16)
    vq = dict(embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
              num_res_blocks=1, projection_dim=32, image_token_embed_dim=32)
    cfg = transformers.JanusConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
                                   vq_config=vq, image_token_id=tok.convert_tokens_to_ids(JANUS_SPECIALS[0]))
    return _sdpa_built(transformers.JanusForConditionalGeneration, cfg, proc)


def _inner_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The image tokens of one image from the inner model's ``get_image_features`` (Janus, DeepSeek-VL: the outer one
    has none)."""
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model.model.get_image_features(pixel_values=pixels).pooler_output[0]


BUILDERS["janus"] = janus
ORACLE["janus"] = dict(prompt=lambda p: "<image_placeholder>" + p, extend=_positions_from_mask,
                       image_token=lambda m: m.config.image_token_id, features=_inner_features,
                       placeholders=lambda m: [m.config.image_token_id])


def deepseek_vl() -> tuple[nn.Module, Any]:
    """DeepSeek-VL: Janus' letterboxed 32 px square (longer side 32 px, centred, padded), a SigLIP tower of 8 px patches
    (4 x 4 tokens), a two-layer aligner, a Llama LM with GQA."""
    import transformers

    tok = tokenizer(JANUS_SPECIALS[:1])
    tok.image_token = JANUS_SPECIALS[0]  # (its processor reads it from its tokenizer)
    image = transformers.DeepseekVLImageProcessor(size={"height": 32, "width": 32}, min_size=4)
    proc = transformers.DeepseekVLProcessor(image_processor=image, tokenizer=tok, num_image_tokens=16)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.DeepseekVLConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
                                        image_token_id=tok.convert_tokens_to_ids(JANUS_SPECIALS[0]))
    return _sdpa_built(transformers.DeepseekVLForConditionalGeneration, cfg, proc)


BUILDERS["deepseek_vl"] = deepseek_vl
ORACLE["deepseek_vl"] = ORACLE["janus"]


PLM_SPECIALS = ("<|image|>", "<|video|>")


def perception_lm(**image_kwargs: Any) -> tuple[nn.Module, Any]:
    """PerceptionLM: a thumbnail then up to 4 tiles of 16 px (the processor's canvas search), a timm Perception Encoder of
    4 px patches (its class token dropped), average-pooled 2 x 2 (2 x 2 tokens per piece), a Llama LM with GQA."""
    import transformers

    tok = tokenizer(PLM_SPECIALS)
    tok.image_token, tok.video_token = PLM_SPECIALS  # (its processor reads them from its tokenizer)
    tok.image_token_id, tok.video_token_id = tok.convert_tokens_to_ids(list(PLM_SPECIALS))
    image = transformers.PerceptionLMImageProcessor(**{"tile_size": 16, "max_num_tiles": 4, **image_kwargs})
    proc = transformers.PerceptionLMProcessor(image_processor=image, tokenizer=tok, patch_size=4, pooling_ratio=2,
                                              video_processor=transformers.PerceptionLMVideoProcessor())
    vision = dict(model_type="timm_wrapper", architecture="vit_pe_core_large_patch14_336", num_classes=0,
                  model_args=dict(embed_dim=32, depth=2, num_heads=2, img_size=16, patch_size=4, mlp_ratio=2.0))
    cfg = transformers.PerceptionLMConfig(vision_config=vision, text_config=dict(model_type="llama", vocab_size=len(tok), **_text()),
                                          image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                                          projector_pooling_ratio=2, vision_use_cls_token=True)
    return _sdpa_built(transformers.PerceptionLMForConditionalGeneration, cfg, proc)


def _pieces_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """Every image token of one image from the inner model's ``get_image_features``: its pieces' tokens in order."""
    pixels = proc.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixels).pooler_output
    return out.reshape(-1, out.shape[-1])


BUILDERS["perception_lm"] = perception_lm
ORACLE["perception_lm"] = dict(prompt=lambda p: "<|image|>" + p, extend=_positions_from_mask,
                               image_token=lambda m: m.config.image_token_id, features=_pieces_features,
                               placeholders=lambda m: [m.config.image_token_id])


MOLMO2_SPECIALS = ("<|image|>", "<|video|>", "<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>",
                   "<im_end>", "<frame_end>", "<im_low>")


def molmo2() -> tuple[nn.Module, Any]:
    """Molmo2: a 56 px low-resolution view and up to 4 overlapping 56 px crops (1-patch margins) of a canvas, 8 px patches
    attention-pooled 2 x 2 (7 patches a side: padded to 8), a Qwen3-style LM with GQA. Its processor resizes without
    antialiasing, so a view downscaled by more than 2 skips pixels: 56 px keeps the probe's images above that."""
    import transformers

    tok = tokenizer(MOLMO2_SPECIALS)
    tok.image_token, tok.video_token = MOLMO2_SPECIALS[:2]  # (its processor reads them from its tokenizer)
    image = transformers.Molmo2ImageProcessor(size={"height": 56, "width": 56}, patch_size=8, max_crops=4,
                                              overlap_margins=[1, 1], pooling_size=[2, 2])
    proc = transformers.Molmo2Processor(image_processor=image, tokenizer=tok, video_processor=transformers.Molmo2VideoProcessor())
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16, image_size=[56, 56], patch_size=8, initializer_range=0.1)
    adapter = dict(vision_feature_layer=[-1], hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                   intermediate_size=64, text_hidden_size=32, initializer_range=0.1)  # (0.02: image features of ~1e-9)
    ids = dict(zip(("image_patch_id", "image_start_token_id", "low_res_image_start_token_id", "image_end_token_id",
                    "frame_start_token_id", "frame_end_token_id"),
                   tok.convert_tokens_to_ids(["<im_patch>", "<im_start>", "<low_res_im_start>", "<im_end>", "<frame_start>",
                                              "<frame_end>"])))
    cfg = transformers.Molmo2Config(vision_config=vision, adapter_config=adapter,
                                    text_config=dict(_text(), vocab_size=len(tok), additional_vocab_size=0), **ids)
    return _sdpa_built(transformers.Molmo2ForConditionalGeneration, cfg, proc)


def _molmo2_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """Every image token of one image: the low-resolution view's, then the canvas'."""
    batch = proc.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        return model.model.get_image_features(pixel_values=batch["pixel_values"], image_token_pooling=batch["image_token_pooling"],
                                              image_grids=batch["image_grids"]).pooler_output[0]


def _mm_types_extend(kwargs: dict, batch: Any, ids: torch.Tensor) -> None:
    _positions_from_mask(kwargs, batch, ids)
    kwargs["mm_token_type_ids"] = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(ids)], 1)  # answer = text


BUILDERS["molmo2"] = molmo2
ORACLE["molmo2"] = dict(prompt=lambda p: "<|image|>" + p, extend=_mm_types_extend, image_token=lambda m: m.config.image_token_id,
                        features=_molmo2_features, placeholders=lambda m: [m.config.image_token_id])


MINICPMV_SPECIALS = ("<image_pad>", "<video_pad>", "<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>", "0")


def minicpmv4_6(mode: str = "16x", version: str = "4_6") -> tuple[nn.Module, Any]:
    """MiniCPM-V 4.6: 4 px patches merged 4 x 4 (``mode`` "16x": the window merger, then the merger) or 2 x 2 ("4x"); an
    image of more than 32 x 32 px is also cut into up to 4 slices; a Qwen3.5 LM of linear-attention and attention layers.
    ``version`` "4_7": MiniCPM-V 4.7, the same with canvas M-RoPE positions from ``mm_token_type_ids``."""
    import transformers

    tok = tokenizer(MINICPMV_SPECIALS)
    # (its processor reads these from its tokenizer)
    for name, token in zip(("image_token", "video_token", "image_start_token", "image_end_token", "slice_start_token",
                            "slice_end_token", "image_id_start_token", "image_id_end_token"), MINICPMV_SPECIALS):
        setattr(tok, name, token)
    tok.image_token_id, tok.video_token_id = tok.convert_tokens_to_ids(list(MINICPMV_SPECIALS[:2]))
    pixels = dict(scale_resolution=32, patch_size=4, max_slice_nums=4, downsample_mode=mode)
    proc = getattr(transformers, f"MiniCPMV{version}Processor")(
        image_processor=transformers.MiniCPMV4_6ImageProcessor(**pixels), tokenizer=tok,
        video_processor=transformers.MiniCPMV4_6VideoProcessor(**pixels))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4,
                  insert_layer_id=0)
    text = dict(_text(), vocab_size=len(tok), num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # (its defaults: Qwen's vocabulary)
    extra = {}
    if version == "4_7":  # its markers, where the canvas positions are pinned
        ids = tok.convert_tokens_to_ids(["<image>", "</image>", "<slice>", "</slice>"])
        extra = dict(zip(("image_start_id", "image_end_id", "slice_start_id", "slice_end_id"), ids), newline_id=tok.unk_token_id)
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0,
                                   "mrope_interleaved": True, "partial_rotary_factor": 0.5}
    cfg = getattr(transformers, f"MiniCPMV{version}Config")(
        vision_config=vision, text_config=text, image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
        insert_layer_id=0, image_size=32, downsample_mode=mode, **extra)
    return _sdpa_built(getattr(transformers, f"MiniCPMV{version}ForConditionalGeneration"), cfg, proc)


def _minicpmv_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """Every image token of one image: the source piece's, then each slice's."""
    batch = proc.image_processor(images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=batch["pixel_values"], target_sizes=batch["target_sizes"])
    return torch.cat(list(out.pooler_output))


BUILDERS.update(minicpmv4_6=minicpmv4_6, minicpmv4_6_4x=lambda: minicpmv4_6("4x"),
                minicpmv4_7=lambda: minicpmv4_6(version="4_7"))
ORACLE["minicpmv4_6"] = ORACLE["minicpmv4_6_4x"] = dict(
    prompt=lambda p: "<image_pad>" + p, extend=_positions_from_mask, image_token=lambda m: m.config.image_token_id,
    features=_minicpmv_features, placeholders=lambda m: [m.config.image_token_id], methods=("cross", "cross_grad"))


def idefics2(split: bool = True) -> tuple[nn.Module, Any]:
    """Idefics2: pieces resized between 16 and 32 px (``split``: the four quadrants, then the whole image), padded to the
    batch's largest, 8 px patches (a SigLIP-like tower), a perceiver resampler of 4 latents per piece over the piece's
    patches (2 layers, GQA), a Mistral LM."""
    import transformers

    tok = tokenizer(("<image>", "<fake_token_around_image>", "<end_of_utterance>"))
    tok.image_token, tok.image_boundary_token = "<image>", "<fake_token_around_image>"  # (its processor reads them)
    tok.image_token_id = tok.convert_tokens_to_ids("<image>")
    image = transformers.Idefics2ImageProcessor(size={"shortest_edge": 16, "longest_edge": 32}, do_image_splitting=split)

    class Idefics2ArrayProcessor(transformers.Idefics2Processor):
        """Idefics2's processor, taking the checks' uint8 arrays as PIL images (it loads only PIL images and URLs)."""

        def __call__(self, images=None, text=None, **kwargs):
            from PIL import Image

            def pil(x):
                return [pil(i) for i in x] if isinstance(x, (list, tuple)) else Image.fromarray(x) if isinstance(x, np.ndarray) else x

            return super().__call__(images=pil(images), text=text, **kwargs)

    proc = Idefics2ArrayProcessor(image_processor=image, tokenizer=tok, image_seq_len=4)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    perceiver = dict(hidden_size=32, resampler_n_latents=4, resampler_depth=2, resampler_n_heads=4, resampler_head_dim=8,
                     num_key_value_heads=2)
    cfg = transformers.Idefics2Config(vision_config=vision, perceiver_config=perceiver,
                                      text_config=dict(model_type="mistral", vocab_size=len(tok), **_text()),
                                      image_token_id=tok.image_token_id)
    model, proc = _sdpa_built(transformers.Idefics2ForConditionalGeneration, cfg, proc)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # latents start equal (ones) and the connector's weights at 0.02: the image would barely count
        for name, p in model.model.connector.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) / math.sqrt(p.shape[-1]))
    return model, proc


def _idefics2_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The vision tower's patch tokens of every piece of one image, in order: what the resampler reads."""
    batch = proc.image_processor(images=[[image]], return_tensors="pt")
    pixels, mask = batch["pixel_values"][0], batch["pixel_attention_mask"][0].bool()  # (pieces, 3, H, W), (pieces, H, W)
    patch = model.config.vision_config.patch_size
    patches = mask.unfold(1, patch, patch).unfold(2, patch, patch).flatten(-2).all(-1)
    with torch.no_grad():
        out = model.model.vision_model(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
    return out.reshape(-1, out.shape[-1])


def _perceiver_transport(model: nn.Module) -> tuple[list, list]:
    """Forward hooks on an eager model's resampler attention modules that keep the weights each returns."""
    store: list = []
    handles = [m.register_forward_hook(lambda module, args, out: store.append(out[1]))
               for n, m in model.named_modules() if n.endswith("perceiver_resampler.layers.0.self_attn")
               or (".perceiver_resampler.layers." in n and n.endswith("self_attn"))]
    return store, handles


BUILDERS.update(idefics2=idefics2, idefics2_whole=lambda: idefics2(split=False))
ORACLE["idefics2"] = ORACLE["idefics2_whole"] = dict(
    nested=True, prompt=lambda p: "<image>" + p, extend=_positions_from_mask, image_token=lambda m: m.config.image_token_id,
    features=_idefics2_features, placeholders=lambda m: [m.config.image_token_id], transport=_perceiver_transport,
    pieces=True)


def fuyu() -> tuple[nn.Module, Any]:
    """Fuyu: images shrunk to fit 48 x 64 px (padded there), 8 px patches projected straight into a Persimmon LM, a
    ``|NEWLINE|`` token after each row. Its processor strips the first token of the encoded image tokens (the
    ``▁`` its SentencePiece tokenizer puts in front): the tokenizer here prepends one too."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\u2581": 4, "|SPEAKER|": 5, "|NEWLINE|": 6, "<0x04>": 7}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    inner.pre_tokenizer = pre_tokenizers.Split(Regex(r"\|SPEAKER\||\|NEWLINE\||<0x04>|\u2581"), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    image = transformers.FuyuImageProcessor(size={"height": 48, "width": 64}, patch_size={"height": 8, "width": 8})
    proc = transformers.FuyuProcessor(image_processor=image, tokenizer=tok)
    text = dict(model_type="persimmon", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512)
    cfg = transformers.FuyuConfig(text_config=text, patch_size=8, image_token_id=vocab["|SPEAKER|"], pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2)
    return _sdpa_built(transformers.FuyuForCausalLM, cfg, proc)


def _fuyu_features(model: nn.Module, proc: Any, image: np.ndarray) -> torch.Tensor:
    """The image tokens of one image: its patches through ``vision_embed_tokens``."""
    patches = proc(images=[image], text=[""], return_tensors="pt")["image_patches"]
    with torch.no_grad():
        return model.model.get_image_features(patches).last_hidden_state


BUILDERS["fuyu"] = fuyu
ORACLE["fuyu"] = dict(prompt=lambda p: p, extend=_positions_from_mask, image_token=lambda m: m.config.image_token_id,
                      features=_fuyu_features, placeholders=lambda m: [m.config.image_token_id])
ORACLE["minicpmv4_7"] = dict(ORACLE["minicpmv4_6"], extend=_qwen_extend)  # (the model computes its canvas positions)


LIGHTON_SPECIALS = ("<|image_pad|>", "<|vision_pad|>", "<|vision_end|>")


def lighton_ocr() -> tuple[nn.Module, Any]:
    """LightOnOCR: Mistral 3's Pixtral tower (longest edge 32 px, 4 px patches) and 2 x 2 patch merger, no row-break
    tokens, a Qwen3 LM."""
    import transformers

    tok = tokenizer(LIGHTON_SPECIALS)
    # (its processor reads these from its tokenizer)
    tok.image_token, tok.image_break_token, tok.image_end_token = LIGHTON_SPECIALS
    tok.image_token_id, tok.image_break_token_id, tok.image_end_token_id = tok.convert_tokens_to_ids(list(LIGHTON_SPECIALS))
    image = transformers.PixtralImageProcessor(size={"longest_edge": 32}, patch_size=8)  # (the merged block)
    proc = transformers.LightOnOcrProcessor(image_processor=image, tokenizer=tok, patch_size=4, spatial_merge_size=2)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=32, patch_size=4, head_dim=16)
    cfg = transformers.LightOnOcrConfig(vision_config=vision, text_config=dict(model_type="qwen3", vocab_size=len(tok), **_text()),
                                        spatial_merge_size=2, image_token_id=tok.image_token_id)
    return _sdpa_built(transformers.LightOnOcrForConditionalGeneration, cfg, proc)


BUILDERS["lighton_ocr"] = lighton_ocr
ORACLE["lighton_ocr"] = dict(ORACLE["mistral3"], prompt=lambda p: "<|image_pad|>" + p, image_token=lambda m: m.config.image_token_id,
                             placeholders=lambda m: [m.config.image_token_id], features=_merged_features("<|image_pad|>"))



def qianfan_ocr() -> tuple[nn.Module, Any]:
    """Qianfan-OCR: :func:`internvl`'s tiles, tower and pixel shuffle, its processor expanding an ``<image>`` placeholder."""
    import transformers

    model, proc = internvl()
    tok = tokenizer(("<img>", "</img>", "<IMG_CONTEXT>", "<image>"))
    # (its processor reads these from its tokenizer, as the checkpoint's own tokenizer carries them)
    tok.start_image_token, tok.end_image_token, tok.context_image_token = "<img>", "</img>", "<IMG_CONTEXT>"
    tok.start_image_token_id, tok.end_image_token_id, tok.context_image_token_id = (
        tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
    proc = transformers.QianfanOCRProcessor(image_processor=proc.image_processor, tokenizer=tok, image_seq_length=4)
    cfg = transformers.QianfanOCRConfig(vision_config=model.config.vision_config.to_dict(),
                                        text_config=dict(model_type="qwen2", vocab_size=len(tok), **_text()),
                                        image_token_id=tok.context_image_token_id, downsample_ratio=0.5, vision_feature_layer=-1)
    return _sdpa_built(transformers.QianfanOCRForConditionalGeneration, cfg, proc)


BUILDERS["qianfan_ocr"] = qianfan_ocr
ORACLE["qianfan_ocr"] = dict(ORACLE["internvl"], prompt=lambda p: "<image>" + p, features=_tiled_features("<image>"))


def exaone4_5() -> tuple[nn.Module, Any]:
    """EXAONE 4.5: Qwen2.5-VL's tower (4 px patches merged 2 x 2, window attention, dynamic resolution <= 32 x 32 px) and
    processor, an EXAONE 4 LM with 1-D positions."""
    import transformers

    tok = tokenizer(QWEN_SPECIALS)
    pixels = dict(size={"shortest_edge": 8 * 8, "longest_edge": 32 * 32}, patch_size=4, merge_size=2, temporal_patch_size=2)
    proc = transformers.Exaone4_5_Processor(image_processor=transformers.Qwen2VLImageProcessor(**pixels), tokenizer=tok,
                                            video_processor=transformers.Qwen2VLVideoProcessor(**pixels))
    vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=2,
                  patch_size=4, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
    cfg = transformers.Exaone4_5_Config(vision_config=vision, text_config=dict(model_type="exaone4", vocab_size=len(tok), **_text()),
                                        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                                        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"))
    return _sdpa_built(transformers.Exaone4_5_ForConditionalGeneration, cfg, proc)


BUILDERS["exaone4_5"] = exaone4_5
ORACLE["exaone4_5"] = dict(_QWEN_ORACLE, prompt=lambda p: "<|image_pad|>" + p, extend=_positions_from_mask)
