"""Tiny random-init encoder-decoder vision-language models (Florence-2, Pix2Struct) with offline processors,
and their eager-attention oracle (definitions in docs/methods.md, "Vision-language models").

Offline: the word-level tokenizer of ``tests/vlm_helpers.py`` (Florence-2's processor reads
``tokenizer.image_token``: an extra special token, as a BART tokenizer's),
the families' own image processors with tiny sizes. Shared by ``tests/test_vlm_encdec.py`` and the
support matrix (``tests/support_table.py``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import vlm_helpers as helpers


def florence2() -> tuple[nn.Module, Any]:
    """Florence-2: a 2-stage DaViT (7x7 stride 4, 3x3 stride 2: 32 px -> 4 x 4 grid, + 1 pooled token), BART 2+2 layers."""
    import transformers

    words = helpers.tokenizer(("<image>",))  # its image token as a BART tokenizer names it (saved and loaded with it)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    image = transformers.CLIPImageProcessor(size={"height": 32, "width": 32}, do_center_crop=False, image_seq_length=17)
    proc = transformers.Florence2Processor(image_processor=image, tokenizer=tok)
    vision = dict(embed_dim=[16, 32], depths=[1, 1], num_heads=[2, 2], num_groups=[2, 2], patch_size=[7, 3], patch_stride=[4, 2],
                  patch_padding=[3, 1], patch_prenorm=[False, True], window_size=4, projection_dim=32, drop_path_rate=0.0)
    text = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=len(tok), max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, tie_word_embeddings=False)
    cfg = transformers.Florence2Config(vision_config=vision, text_config=text, image_token_id=tok.image_token_id,
                                       tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return helpers.reinit_small(transformers.Florence2ForConditionalGeneration(cfg).eval()), proc


def pix2struct(vqa: bool = False) -> tuple[nn.Module, Any]:
    """Pix2Struct: 8 px patches, at most 24 of them; T5-style decoder 2 layers. ``vqa``: a VQA checkpoint (the
    question rendered above the image: needs :func:`local_font`), 48 patches."""
    import transformers

    tok = helpers.tokenizer(())
    image = transformers.Pix2StructImageProcessor(max_patches=48 if vqa else 24, patch_size={"height": 8, "width": 8},
                                                  is_vqa=vqa)
    proc = transformers.Pix2StructProcessor(image_processor=image, tokenizer=tok)
    vision = dict(hidden_size=32, d_ff=64, num_hidden_layers=2, num_attention_heads=2, d_kv=16, patch_embed_hidden_size=3 * 64)
    text = dict(hidden_size=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=len(tok), pad_token_id=0,
                eos_token_id=2, decoder_start_token_id=0, bos_token_id=1)
    cfg = transformers.Pix2StructConfig(vision_config=vision, text_config=text, is_vqa=vqa)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return helpers.reinit_small(transformers.Pix2StructForConditionalGeneration(cfg).eval()), proc


def local_font(monkeypatch: Any) -> None:
    """Make Pix2Struct's header rendering use matplotlib's DejaVu Sans instead of the font it downloads (offline)."""
    import os

    import matplotlib
    from transformers.models.pix2struct import image_processing_pix2struct as module

    path = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")
    original = module.render_text

    def render_text(text: str, *args: Any, font_bytes: Any = None, font_path: Any = None, **kwargs: Any) -> Any:
        return original(text, *args, font_path=path, **kwargs)

    monkeypatch.setattr(module, "render_text", render_text)


BUILDERS: dict[str, Callable[[], tuple[nn.Module, Any]]] = {"florence2": florence2, "pix2struct": pix2struct,
                                                           "pix2struct_vqa": lambda: pix2struct(vqa=True)}
