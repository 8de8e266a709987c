"""``shapes-vlm``: a standard Hugging Face LLaVA trained on the shapes data, and its processor.

The model is a plain :class:`transformers.LlavaForConditionalGeneration` (nothing custom, so it
runs every transformers code path a real LLaVA runs, SDPA included):

* a tiny CLIP vision tower (64 px, patch 8 -> class token + 8 x 8 patch tokens; LLaVA-1.5's
  layout: the class token is dropped, ``vision_feature_select_strategy="default"``, and the last
  layer's tokens are used, ``vision_feature_layer=-1``), of the shape of ``shapes-vit``'s trunk
  (training starts from it, :mod:`vitexplain.zoo.train_vlm`); ``vision_type="siglip"`` in
  ``model_args`` builds a SigLIP tower instead (no class token, ``"full"`` strategy);
* LLaVA's two-layer MLP projector;
* a tiny Llama causal language model (grouped-query attention, RoPE).

Its processor is a :class:`transformers.LlavaProcessor` built offline (:func:`build_processor`):
a word-level tokenizer (``tokenizers``'s ``WordLevel`` over the shapes vocabulary: colours,
shapes, "and", the prompt words) and a ``CLIPImageProcessor`` (resize, centre crop, normalise) with the shapes normalisation
(``vx.data.MEAN/STD``). Nothing is downloaded and no tokenizer file is stored: the vocabulary is in
the checkpoint's JSON and the processor is rebuilt from it.

A prompt holds one ``<image>`` placeholder (the processor expands it to the 64 image tokens),
e.g. :data:`PROMPT` ``"<image> describe the image"``; the model answers with the caption,
``"red circle and blue star"``, then ``</s>``.

Usage::

    model = vx.zoo.load("shapes-vlm")           # LlavaForConditionalGeneration, eval, SDPA
    proc = vx.zoo.processor("shapes-vlm")       # also model.vx_processor
    inputs = proc(images=list(batch.images), text=[PROMPT] * len(batch), return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from ..data.drawing import COLORS, SHAPES
from ..data.synthetic import MEAN, STD, shapes
from ..errors import UsageError

__all__ = [
    "PROMPT",
    "PROMPTS",
    "SPECIALS",
    "IMAGE_TOKEN",
    "vlm_words",
    "require_transformers",
    "build_tokenizer",
    "build_processor",
    "build_llava",
    "VLM_ARGS",
    "caption_accuracy",
]

PAD, BOS, EOS, UNK, IMAGE_TOKEN = "<pad>", "<s>", "</s>", "<unk>", "<image>"
#: Special tokens, in id order (ids 0..4).
SPECIALS: tuple[str, ...] = (PAD, BOS, EOS, UNK, IMAGE_TOKEN)
#: The default prompt: the image, then the instruction.
PROMPT = f"{IMAGE_TOKEN} describe the image"
#: Prompts seen in training (all answered with the caption).
PROMPTS: tuple[str, ...] = (PROMPT, f"{IMAGE_TOKEN} what is in the image ?")


def vlm_words() -> list[str]:
    """Ordinary words of the vocabulary: caption words (colours, shapes, "and"), then prompt words."""
    words = [*COLORS, *SHAPES, "and"]
    for prompt in PROMPTS:
        for w in prompt.split():
            if w not in words and w not in SPECIALS:
                words.append(w)
    return words


#: Architecture of shapes-vlm (the ``model_args`` of its zoo config). The vision tower is a CLIP
#: encoder (LLaVA-1.5's layout: class token + 64 patch tokens, the class token dropped by the
#: ``"default"`` feature strategy) of the same shape as ``shapes-vit``'s trunk, which training
#: starts it from.
VLM_ARGS: dict[str, Any] = {
    "words": vlm_words(),
    "img_size": 64,
    "patch_size": 8,
    "vision_type": "clip",
    "vision": {"hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 4, "num_attention_heads": 4,
               "layer_norm_eps": 1e-6},
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
}


def _has_class_token(args: dict[str, Any]) -> bool:
    return args.get("vision_type", "clip") == "clip"


def require_transformers() -> Any:
    """Import transformers, or raise :class:`UsageError` saying how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise UsageError(
            "shapes-vlm is a Hugging Face LLaVA model and needs the `transformers` and `tokenizers` "
            "packages: pip install 'transformers>=5' tokenizers"
        ) from err
    major = int(str(transformers.__version__).split(".")[0])
    if major < 5:
        raise UsageError(f"shapes-vlm's checkpoint uses the module names of transformers 5 (installed: "
                         f"{transformers.__version__}): pip install -U 'transformers>=5'")
    return transformers


def build_tokenizer(words: Sequence[str]) -> Any:
    """A word-level fast tokenizer over ``SPECIALS + words`` (ids in that order).

    Text is split on whitespace; ``<image>`` is a special token (so the processor's run of
    ``<image><image>...`` splits into single tokens); every sequence starts with ``<s>``.

    Returns:
        A ``transformers`` fast tokenizer (``PreTrainedTokenizerFast``).
    """
    transformers = require_transformers()
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing

    vocab = {w: i for i, w in enumerate([*SPECIALS, *[w for w in words if w not in SPECIALS]])}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                            special_tokens=[(BOS, vocab[BOS])])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left",
    )
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return fast


def build_processor(args: dict[str, Any]) -> Any:
    """The ``LlavaProcessor`` of a shapes-vlm config (offline, deterministic).

    Args:
        args: the ``model_args`` of the config (:data:`VLM_ARGS`).

    Returns:
        ``LlavaProcessor``: images (any size; resized to ``img_size``) -> ``pixel_values``
        (B, 3, 64, 64) normalised with ``vx.data.MEAN/STD``; text with one ``<image>`` -> ids with 64
        image tokens, left-padded.
    """
    transformers = require_transformers()
    size = int(args["img_size"])
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True,
        image_mean=list(MEAN), image_std=list(STD), resample=2, do_convert_rgb=True,
    )
    cls = _has_class_token(args)
    return transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=build_tokenizer(args["words"]),
        patch_size=int(args["patch_size"]), vision_feature_select_strategy="default" if cls else "full",
        image_token=IMAGE_TOKEN, num_additional_image_tokens=int(cls),
    )


def build_llava(args: dict[str, Any], attn_implementation: Optional[str] = "sdpa") -> nn.Module:
    """An untrained ``LlavaForConditionalGeneration`` of a shapes-vlm config.

    Args:
        args: ``model_args`` (:data:`VLM_ARGS`).
        attn_implementation: ``"sdpa"`` (default) or ``"eager"`` (training-time checks only).

    Returns:
        The model (train mode, random init).
    """
    transformers = require_transformers()
    args = copy.deepcopy(args)
    vocab_size = len(SPECIALS) + len([w for w in args["words"] if w not in SPECIALS])
    size, patch = int(args["img_size"]), int(args["patch_size"])
    cls = _has_class_token(args)
    if cls:
        vision = transformers.CLIPVisionConfig(image_size=size, patch_size=patch, hidden_act="gelu", **args["vision"])
    else:
        vision = transformers.SiglipVisionConfig(image_size=size, patch_size=patch, hidden_act="gelu",
                                                 vision_use_head=False, **args["vision"])
    text = transformers.LlamaConfig(
        vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        **args["text"],
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=SPECIALS.index(IMAGE_TOKEN),
        image_seq_length=(size // patch) ** 2, vision_feature_select_strategy="default" if cls else "full",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 1, 2
    model = transformers.LlavaForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = 0, 1, 2
    return model


@torch.no_grad()
def caption_accuracy(model: nn.Module, processor: Any, n: int = 500, seed: int = 10_000) -> dict[str, Any]:
    """Greedy captions from :data:`PROMPT` (through the processor) vs the reference captions.

    Returns:
        ``{"seed", "n", "caption_acc", "word_acc"}`` (exact caption match; reference words reproduced
        in place), like :func:`vitexplain.zoo.evaluate.evaluate` for the other captioners.
    """
    ok = words_ok = words_all = 0
    for s in range(0, n, 100):
        batch = shapes(min(100, n - s), seed=seed, start=s)
        inp = processor(images=list(batch.images), text=[PROMPT] * len(batch), return_tensors="pt").to(model.device)
        out = model.generate(**inp, max_new_tokens=12, do_sample=False)
        hyps = processor.batch_decode(out[:, inp["input_ids"].shape[1]:], skip_special_tokens=True)
        for ref, hyp in zip(batch.captions, hyps):
            ok += int(ref == hyp.strip())
            r, h = ref.split(), hyp.split()
            words_ok += sum(int(a == b) for a, b in zip(r, h))
            words_all += len(r)
    return {"seed": seed, "n": n, "caption_acc": ok / n, "word_acc": words_ok / max(1, words_all)}
