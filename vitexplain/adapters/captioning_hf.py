"""Adapters for Hugging Face image captioners: ``VisionEncoderDecoderModel`` (e.g. ViT + GPT-2),
``BlipForConditionalGeneration`` and ``GitForCausalLM`` (the caption adapter itself: :mod:`~vitexplain.adapters.captioning`).

GIT has no cross-attention module: its text decoder runs one self-attention over the
sequence [image tokens, text tokens] (image tokens attend to each other, text tokens
causally to the image and the text before them). Its "cross-attention" is the block of that
attention in which text queries read image keys: :class:`GitCaptionAdapter` presents it as
one cross record per decoder call (:class:`TextToImage`), so ``cross`` reads it like any
decoder's; ``cross_generic`` applies Chefer's self-attention rule to the joint sequence
(``joint = True``, see ``methods/caption.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..layout import pair
from ..errors import UnsupportedModelError, UsageError
from .base import Adapter, find_layout_module, register_adapter
from .captioning import greedy_kwargs, CaptionAdapter

__all__ = ["HFCaptionAdapter", "GitCaptionAdapter", "TextToImage"]


def _encoder_layout(encoder: nn.Module, size: tuple[int, int]) -> tuple[Optional[str], bool]:
    """Why no caption method can read the image encoder's tokens (None when one can), and whether its layout is
    windowed (Swin).

    Every caption method maps the decoder's image keys to patches through the encoder's token layout. ViT-MAE's
    encoder has none: on every forward, in eval mode too, it keeps a random ``1 - mask_ratio`` of the patch tokens
    in a random order (``ViTMAEEmbeddings.random_masking``), so which patch a key stands for differs from call to
    call (and between the generation and the teacher-forced forward, whose captions may differ too)."""
    config = getattr(encoder, "config", None)
    name = type(encoder).__name__
    if getattr(config, "model_type", None) == "vit_mae" or hasattr(getattr(encoder, "embeddings", None), "random_masking"):
        ratio = getattr(config, "mask_ratio", None)
        share = "mask_ratio" if ratio is None else f"{ratio:g}"
        return (f"the image encoder ({name}) drops a random {share} of its patch tokens (mask_ratio) and shuffles the "
                "others into a random order on every forward, in eval mode too (ViT-MAE's random masking; with "
                "mask_ratio 0 it still shuffles), so no key of the decoder's cross-attention is known to stand for a "
                "patch and the caption itself changes from run to run; give the decoder a ViT encoder over the same "
                "weights, which runs every patch token in place (ViTModel.from_pretrained(path) reads a ViT-MAE "
                "checkpoint's encoder weights)"), False
    try:
        return None, bool(find_layout_module(encoder, size)[2].windowed)
    except UnsupportedModelError as err:
        return (f"no token layout of the image encoder ({name}) is known, so the decoder's image keys cannot be mapped "
                f"to patches ({err})"), False


def _query_streams(decoder: nn.Module) -> int:
    """How many query streams the decoder runs through its attention per token: ``1 + ngram`` for ProphetNet's
    (the main stream and its n-gram predicting streams), 1 otherwise."""
    for module in decoder.modules():
        ngram = getattr(module, "ngram", None)
        if isinstance(ngram, int) and ngram > 0 and isinstance(getattr(module, "position_embeddings", None), nn.Embedding):
            return 1 + ngram
    return 1


def _token_id(value: Any, model: nn.Module, setting: str, role: str) -> int:
    """A special token id of the model's config as an int.

    Raises:
        UnsupportedModelError: the config does not set it (``from_encoder_decoder_configs`` over a BERT decoder, for
            one, sets neither the start nor the end token; Hugging Face's ``generate`` refuses such a model too).
    """
    if value is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} sets no token that {role}; set {setting} to your tokenizer's token id "
            "before explaining")
    return int(value)


def _position_offset(decoder: nn.Module) -> int:
    """How many rows of the decoder's position table do not hold a position of its inputs: ``padding_idx + 1`` for
    RoBERTa-style embeddings (RoBERTa, XLM-RoBERTa, CamemBERT, Data2VecText, ...: positions are numbered from
    ``pad_token_id + 1``, so ``max_position_embeddings - pad_token_id - 1`` tokens fit), ``padding_idx + 2`` for
    ProphetNet's (numbered from ``pad_token_id + 1`` too, and its n-gram predicting streams read the row after each
    input's: with a KV cache a position past the table was a raw IndexError; without one, ProphetNet clamps it to the
    last row, silently), 0 otherwise."""
    for module in decoder.modules():
        if hasattr(module, "ngram") and isinstance(getattr(module, "position_embeddings", None), nn.Embedding):
            pad = module.position_embeddings.padding_idx
            return (pad if isinstance(pad, int) else 0) + 2
    for module in decoder.modules():
        table = getattr(module, "position_embeddings", None)
        pad = getattr(module, "padding_idx", None)
        if isinstance(table, nn.Embedding) and isinstance(pad, int) and table.padding_idx == pad:
            return pad + 1
    return 0


def _with_image_processor(adapter: CaptionAdapter, processor: Any) -> Any:
    """A copy of ``adapter`` whose images are preprocessed as ``processor`` (or the image processor it holds) does.

    Raises:
        UsageError: ``processor`` is not an image processor.
    """
    from .hf_processor import image_processor_settings, is_image_processor

    image = getattr(processor, "image_processor", processor)
    if not is_image_processor(image):
        raise UsageError(f"processor= for {type(adapter.model).__name__} must be its Hugging Face image processor "
                         f"(e.g. ViTImageProcessor.from_pretrained(NAME)) or a processor holding one; got "
                         f"{type(processor).__name__}")
    adapter = copy.copy(adapter)
    adapter.saved_preprocess = image_processor_settings(image)
    return adapter


class HFCaptionAdapter(CaptionAdapter):
    """Hugging Face ``VisionEncoderDecoderModel`` and ``BlipForConditionalGeneration``."""

    def __init__(self, model: nn.Module, kind: str, tokenizer: Any = None) -> None:
        super().__init__(model, tokenizer)
        self.kind = kind
        self.encoder_prefix = "encoder" if kind == "vision-encoder-decoder" else "vision_model"
        vision = model.config.encoder if kind == "vision-encoder-decoder" else model.config.vision_config
        #: the one input size the vision encoder takes (its position embeddings are not interpolated)
        self.fixed_size = pair(vision.image_size)
        unknown, windowed = _encoder_layout(model.get_submodule(self.encoder_prefix), self.fixed_size)
        if unknown is not None:  # (every caption method reads the layout: the plan lists none)
            self.notes.update(dict.fromkeys(self.capabilities, unknown))
            self.capabilities = frozenset()
        streams = _query_streams(model.get_submodule("decoder" if kind == "vision-encoder-decoder" else "text_decoder"))
        if streams > 1:
            self.capabilities = self.capabilities - {"word_queries"}
            self.notes["word_queries"] = (
                f"the decoder runs its cross-attention over {streams} query streams per token (ProphetNet's main "
                "stream and its n-gram predicting streams), so the row of each word is not known; vitexplain reads "
                "decoders with one query stream (GPT-2, BERT, BART, TrOCR, ...); 'attnlrp' and 'cp_lrp' (relevance of "
                "each word's logit) apply")
        if windowed:
            self.capabilities = self.capabilities - {"encoder_attention"}
            self.notes["encoder_attention"] = (
                f"the image encoder ({type(model.get_submodule(self.encoder_prefix)).__name__}) is a windowed, "
                "hierarchical one (Swin: attention inside windows, patch merging between stages), not the one "
                "global self-attention over the decoder's image tokens that Chefer's encoder rule (R_ii) assumes; "
                "use 'cross' (the decoder's cross-attention over its last-stage tokens) or explain the encoder "
                "alone: vx.Explainer(model.encoder) with the Swin methods")

    @property
    def _text_config(self) -> Any:
        config = self.model.config
        return config.decoder if self.kind == "vision-encoder-decoder" else config.text_config

    @property
    def end_id(self) -> int:
        cfg = self._text_config
        if self.kind == "blip":
            return _token_id(cfg.sep_token_id, self.model, "model.config.text_config.sep_token_id", "ends a caption")
        end = self.model.generation_config.eos_token_id
        end = end if end is not None else cfg.eos_token_id
        return _token_id(end[0] if isinstance(end, (list, tuple)) else end, self.model,
                         "model.generation_config.eos_token_id", "ends a caption")

    @property
    def start_id(self) -> int:
        if self.kind == "blip":
            return _token_id(self._text_config.bos_token_id, self.model, "model.config.text_config.bos_token_id",
                             "starts a caption")
        start = self.model.config.decoder_start_token_id
        start = start if start is not None else self._text_config.bos_token_id
        return _token_id(start, self.model, "model.config.decoder_start_token_id (and model.generation_config's)",
                         "the decoder is fed first")

    @property
    def max_positions(self) -> Optional[int]:
        cfg = self._text_config
        for name in ("max_position_embeddings", "n_positions"):
            size = getattr(cfg, name, None)
            if isinstance(size, int) and size > 0:
                decoder = self.model.decoder if self.kind == "vision-encoder-decoder" else self.model.text_decoder
                return size - _position_offset(decoder)
        return None

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        kwargs: dict[str, Any] = dict(max_new_tokens=max_len, do_sample=False, num_beams=1)
        if self.kind == "vision-encoder-decoder":
            kwargs.update(decoder_start_token_id=self.start_id, eos_token_id=self.end_id, pad_token_id=self.end_id)
        return self.model.generate(pixel_values=x, **greedy_kwargs(self.model, **kwargs))[:, 1:]

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        start = torch.full_like(ids[:, :1], self.start_id)
        inputs = torch.cat([start, ids[:, :-1]], dim=1)
        if self.kind == "vision-encoder-decoder":
            return self.model(pixel_values=x, decoder_input_ids=inputs).logits
        return self.model(pixel_values=x, input_ids=inputs).logits

    def preprocess_kwargs(self) -> dict[str, Any]:
        """The model type's preprocessing: BLIP's processor's (CLIP statistics). A VisionEncoderDecoder's pixel
        statistics depend on how it was trained, not on its type: its 0.5 here only sizes inputs, and images are
        preprocessed only with an image processor's settings (:meth:`unknown_pixels`, :meth:`with_image_processor`)."""
        vision = self.model.config.encoder if self.kind == "vision-encoder-decoder" else self.model.config.vision_config
        size = vision.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        if self.kind == "blip":  # BLIP's processor uses the CLIP statistics
            mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
        else:
            mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        return dict(input_size=size, mean=mean, std=std, crop_pct=1.0, interpolation="bicubic")

    def with_image_processor(self, processor: Any) -> "HFCaptionAdapter":
        """A copy that preprocesses images as ``processor`` does (a Hugging Face image processor, or a processor
        holding one: ``TrOCRProcessor``, ``BlipProcessor``, ...), overriding the model type's statistics.

        Raises:
            UsageError: ``processor`` is not an image processor.
        """
        return _with_image_processor(self, processor)

    def unknown_pixels(self) -> Optional[str]:
        """Why images cannot be preprocessed for this model (None when they can): a VisionEncoderDecoder given
        no image processor (``processor=``, or the one saved with its folder, ``model.vx_preprocess``)."""
        if self.kind != "vision-encoder-decoder":
            return None  # BLIP's statistics are its model type's
        saved = self.saved_preprocess or getattr(self.model, "vx_preprocess", None)
        if isinstance(saved, dict) and "mean" in saved and "std" in saved:
            return None
        return (f"{type(self.model).__name__}'s images cannot be preprocessed for you: its pixel statistics (mean, "
                "std, resizing) depend on how it was trained (0.5 for ViT-GPT2 and TrOCR, ImageNet's for some "
                "encoders), not on its model type, and no image processor was given. Give the image processor it was "
                "trained with: vx.Explainer(model, processor=ViTImageProcessor.from_pretrained(NAME)) (or its "
                "TrOCRProcessor, ...), or pass the pixels it makes: explain_caption(processor(images, "
                "return_tensors='pt').pixel_values)")


class TextToImage:
    """The text-query x image-key block of a joint decoder self-attention call, read as a
    cross-attention record (GIT).

    Without a KV cache (teacher forcing, and the first generation step) the call's queries are
    [image tokens, text tokens] and the text rows start at ``num_image``; with a cache each
    step's queries are text tokens only. The keys always start with the ``num_image`` image
    tokens.

    Args:
        record: the decoder's :class:`~vitexplain.recording.AttentionRecord`.
        num_image: number of image tokens (the vision encoder's tokens, class token included).
    """

    kind = "cross"

    def __init__(self, record: Any, num_image: int) -> None:
        self.record = record
        self.num_image = num_image
        self.text_start = num_image if record.num_queries == record.num_keys else 0

    def __getattr__(self, name: str) -> Any:  # name, step, index, num_heads, batch_size, ...
        return getattr(self.record, name)

    @property
    def num_queries(self) -> int:
        return self.record.num_queries - self.text_start

    @property
    def num_keys(self) -> int:
        return self.num_image

    def _rows(self, queries: Any) -> Any:
        rows = torch.arange(self.text_start, self.record.num_queries, device=self.record.device)
        return rows if queries is None else rows[queries]

    def probs(self, queries: Any = None) -> Tensor:
        """(B, H, n, num_image) attention of the selected text queries over the image keys."""
        return self.record.probs(self._rows(queries).view(-1))[..., : self.num_image]

    def grad_probs(self, queries: Any = None, **kwargs: Any) -> Tensor:
        """dy/dA on the same block."""
        return self.record.grad_probs(self._rows(queries).view(-1), **kwargs)[..., : self.num_image]


class GitCaptionAdapter(CaptionAdapter):
    """Hugging Face ``GitForCausalLM`` (see the module docstring for what "cross" means here)."""

    encoder_prefix = "git.image_encoder"
    joint = True
    start_setting = "bos_token_id"  # (a decoder-only model: captions start from its bos token)

    def with_image_processor(self, processor: Any) -> "GitCaptionAdapter":
        """A copy that preprocesses images as ``processor`` (a Hugging Face image processor, or a processor holding
        one) does, overriding the model type's (CLIP) statistics."""
        return _with_image_processor(self, processor)

    @property
    def end_id(self) -> int:
        end = self.model.generation_config.eos_token_id
        end = end if end is not None else self.model.config.eos_token_id
        return _token_id(end[0] if isinstance(end, (list, tuple)) else end, self.model,
                         "model.generation_config.eos_token_id", "ends a caption")

    @property
    def start_id(self) -> int:
        return _token_id(self.model.config.bos_token_id, self.model, "model.config.bos_token_id", "starts a caption")

    @property
    def max_positions(self) -> Optional[int]:
        size = getattr(self.model.config, "max_position_embeddings", None)  # text positions (image tokens apart)
        return size if isinstance(size, int) and size > 0 else None

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        pad = self.model.config.pad_token_id
        ids = self.model.generate(
            pixel_values=x, **greedy_kwargs(self.model, max_new_tokens=max_len, do_sample=False, num_beams=1,
                                            eos_token_id=self.end_id, pad_token_id=pad if pad is not None else self.end_id),
        )
        return ids[:, 1:]  # drop the start token GIT's generate begins with

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        start = torch.full_like(ids[:, :1], self.start_id)
        logits = self.model(pixel_values=x, input_ids=torch.cat([start, ids[:, :-1]], dim=1)).logits
        return logits[:, -ids.shape[1] :]  # rows of the text positions (after the image tokens)

    def cross_records(self, records: Sequence[Any]) -> list[Any]:
        if self.model.config.num_image_with_embedding:
            from ..errors import UnsupportedModelError

            raise UnsupportedModelError("GIT with several frames per sample (video) is not supported; use an image GIT")
        image = self.model.git.encoder.layer[0].attention.self.image_patch_tokens
        return [TextToImage(r, image) for r in self.decoder_records(records) if r.kind == "self"]

    def preprocess_kwargs(self) -> dict[str, Any]:
        size = self.model.config.vision_config.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
        return dict(input_size=size, mean=mean, std=std, crop_pct=1.0, interpolation="bicubic")


@register_adapter(priority=20)
def _detect_hf_captioner(model: nn.Module) -> Optional[Adapter]:
    name = type(model).__name__
    if name == "VisionEncoderDecoderModel":
        return HFCaptionAdapter(model, "vision-encoder-decoder")
    if name == "BlipForConditionalGeneration":
        return HFCaptionAdapter(model, "blip")
    if name == "GitForCausalLM":
        return GitCaptionAdapter(model)
    return None
