"""Adapters for image captioners (encoder-decoder models with cross-attention).

A caption adapter knows where the image encoder is (its self-attention records and token
layout), how to generate greedily (with the model's own KV cache), and how to run the model
teacher-forced on given tokens so that logits row t predicts token t.

Supported: the zoo captioners (:class:`vitexplain.zoo.captioner.Captioner`, and the Show, Attend
and Tell :class:`vitexplain.zoo.sat.ShowAttendTell`), a model built
from ``nn.TransformerDecoder`` over a timm ViT (:class:`TransformerDecoderCaptioner`, or any
module with the same attributes), and Hugging Face ``VisionEncoderDecoderModel`` (e.g. ViT +
GPT-2), ``BlipForConditionalGeneration`` and ``GitForCausalLM``.

GIT has no cross-attention module: its text decoder runs one self-attention over the
sequence [image tokens, text tokens] (image tokens attend to each other, text tokens
causally to the image and the text before them). Its "cross-attention" is the block of that
attention in which text queries read image keys: :class:`GitCaptionAdapter` presents it as
one cross record per decoder call (:class:`TextToImage`), so ``cross`` reads it like any
decoder's; ``cross_generic`` applies Chefer's self-attention rule to the joint sequence
(``joint = True``, see ``methods/caption.py``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ..layout import TokenLayout, pair
from ..methods.families import CAPTION
from .base import Adapter, find_layout_module, register_adapter
from ..errors import UnsupportedModelError, UsageError

__all__ = [
    "CaptionAdapter",
    "GitCaptionAdapter",
    "TextToImage",
    "ZooCaptionAdapter",
    "TransformerDecoderCaptioner",
    "TorchDecoderCaptionAdapter",
    "HFCaptionAdapter",
]


class CaptionAdapter(Adapter):
    """An encoder-decoder image captioner.

    Attributes:
        encoder_prefix: module-name prefix of the image encoder (its self-attention
            records are the encoder's; every other record belongs to the decoder).
        tokenizer: optional object with ``decode(ids)`` for word strings (Hugging Face).
    """

    family = CAPTION
    encoder_prefix: str = "encoder"
    #: the decoder runs one self-attention over [image tokens, text tokens] (GIT)
    joint: bool = False

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        super().__init__(model)
        self.tokenizer = tokenizer
        self.capabilities = frozenset({"cross", "lrp", "encoder_attention"})

    def layout(self, input_size: tuple[int, int]) -> TokenLayout:
        """Token layout of the image encoder for a (H, W) input."""
        encoder = self.model.get_submodule(self.encoder_prefix)
        return find_layout_module(encoder, input_size)[2]

    @property
    def end_id(self) -> int:
        """Token id that ends a caption."""
        raise self.not_implemented("end_id()")

    @property
    def vocab_size(self) -> Optional[int]:
        """Number of token ids the decoder knows (ids are 0..vocab_size-1), or None if unknown."""
        vocab = getattr(self.model, "vocab", None)
        if vocab is not None and hasattr(vocab, "itos"):
            return len(vocab.itos)
        config = getattr(self.model, "config", None)
        for part in ("text_config", "decoder", None):
            cfg = getattr(config, part, None) if part else config
            size = getattr(cfg, "vocab_size", None)
            if isinstance(size, int):
                return size
        size = getattr(self.model, "vocab_size", None)
        return size if isinstance(size, int) else None

    @property
    def start_id(self) -> int:
        """Token id fed at the first decoding step."""
        raise self.not_implemented("start_id()")

    @property
    def max_positions(self) -> Optional[int]:
        """Longest decoder input (start token included) the model has position embeddings for,
        or None when unbounded or the model checks it itself."""
        return None

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        """Greedy generation; returns (B, T) generated ids (no start token)."""
        raise self.not_implemented("generate()")

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        """Logits (B, T, V) where row t predicts ``ids[:, t]`` (inputs: start + ids[:, :-1])."""
        raise self.not_implemented("teacher_forced()")

    def encode_caption(self, caption: str) -> list[int]:
        """Token ids of a caption (no start/end tokens)."""
        if self.tokenizer is None:
            raise UsageError(
                "this captioner has no tokenizer: pass the caption as a list of token ids, or "
                "give vx.Explainer(model, tokenizer=...)"
            )
        return list(self.tokenizer(caption, add_special_tokens=False)["input_ids"])

    def word(self, token_id: int) -> str:
        """The text of one token."""
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id]).strip()
        return str(token_id)

    def words(self, ids: Tensor) -> list[list[str]]:
        """Per image, the words of a (B, T) id tensor up to (excluding) the end token."""
        out = []
        for row in ids.tolist():
            words = []
            for token in row:
                if token == self.end_id:
                    break
                words.append(self.word(token))
            out.append(words)
        return out

    def decoder_records(self, records: Sequence[Any]) -> list[Any]:
        """The records issued outside the image encoder, in call order."""
        prefix = self.encoder_prefix
        return [r for r in records if not (r.name == prefix or r.name.startswith(prefix + "."))]

    def cross_records(self, records: Sequence[Any]) -> list[Any]:
        """The decoder's cross-attention calls (text queries over image keys), in call order."""
        return [r for r in self.decoder_records(records) if r.kind == "cross"]

    def encoder_records(self, records: Sequence[Any]) -> list[Any]:
        """Self-attention records of the image encoder, in call order."""
        prefix = self.encoder_prefix
        return [r for r in records if r.kind == "self" and (r.name == prefix or r.name.startswith(prefix + "."))]


class ZooCaptionAdapter(CaptionAdapter):
    """The zoo's captioners: :class:`~vitexplain.zoo.captioner.Captioner` (transformer decoder, KV
    cache) and :class:`~vitexplain.zoo.sat.ShowAttendTell` (LSTM decoder whose additive attention,
    registered with ``register_attention``, is recorded once per step; its encoder grid is the
    token layout)."""

    encoder_prefix = "encoder"

    @property
    def end_id(self) -> int:
        return self.model.vocab.eos_id

    @property
    def start_id(self) -> int:
        return self.model.vocab.bos_id

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        return self.model.generate(x, max_len=max_len)[0]

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        start = torch.full_like(ids[:, :1], self.start_id)
        return self.model(x, torch.cat([start, ids[:, :-1]], dim=1))

    def encode_caption(self, caption: str) -> list[int]:
        return self.model.vocab.encode(caption)

    def word(self, token_id: int) -> str:
        return self.model.vocab.itos[token_id]


class TransformerDecoderCaptioner(nn.Module):
    """A captioner built from ``nn.TransformerDecoder`` over a timm ViT encoder.

    A reference for models assembled from PyTorch's own layers: the decoder layers use
    ``nn.MultiheadAttention`` (self- and cross-attention); there is no KV cache, so each
    generation step re-runs the prefix. Any module with the attributes ``encoder`` (a ViT),
    ``decoder`` (``nn.TransformerDecoder``), ``embed``, ``pos``, ``head``, ``start_id`` and
    ``end_id`` is explained the same way.

    Args:
        encoder: a timm ViT with ``num_classes=0`` (its ``forward_features`` is the memory).
        vocab_size: number of tokens.
        dim: decoder width (must equal the encoder width).
        depth: decoder layers.
        heads: attention heads.
        max_len: longest decoder input.
        start_id: token fed first.
        end_id: token that ends a caption.
    """

    def __init__(self, encoder: nn.Module, vocab_size: int, dim: int, depth: int = 2, heads: int = 2, max_len: int = 16, start_id: int = 1, end_id: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        layer = nn.TransformerDecoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, depth)
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.head = nn.Linear(dim, vocab_size)
        self.start_id, self.end_id = start_id, end_id

    def forward(self, images: Tensor, tokens: Tensor) -> Tensor:
        """Teacher-forced logits (B, T, V) for input tokens (B, T) starting with ``start_id``."""
        memory = self.encoder.forward_features(images)
        t = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        x = self.embed(tokens) + self.pos[:, :t]
        return self.head(self.decoder(x, memory, tgt_mask=causal, tgt_is_causal=True))

    def generate(self, images: Tensor, max_len: int = 12) -> Tensor:
        """Greedy ids (B, T) without the start token (the prefix is re-run each step)."""
        tokens = torch.full((images.shape[0], 1), self.start_id, dtype=torch.long, device=images.device)
        done = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
        for _ in range(min(max_len, self.pos.shape[1])):
            nxt = self(images, tokens)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.end_id), nxt)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            done |= nxt == self.end_id
            if bool(done.all()):
                break
        return tokens[:, 1:]


class TorchDecoderCaptionAdapter(CaptionAdapter):
    """Models shaped like :class:`TransformerDecoderCaptioner`."""

    encoder_prefix = "encoder"

    @property
    def end_id(self) -> int:
        return int(self.model.end_id)

    @property
    def start_id(self) -> int:
        return int(self.model.start_id)

    @property
    def max_positions(self) -> Optional[int]:
        return int(self.model.pos.shape[1])

    @property
    def fixed_size(self) -> Optional[tuple[int, int]]:
        """The one input size of the timm encoder (None when it takes any size)."""
        return self.preprocess_kwargs()["input_size"] if not getattr(self.model.encoder, "dynamic_img_size", False) else None

    @property
    def vocab_size(self) -> Optional[int]:
        return int(self.model.embed.num_embeddings)

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        return self.model.generate(x, max_len=max_len)

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        start = torch.full_like(ids[:, :1], self.start_id)
        return self.model(x, torch.cat([start, ids[:, :-1]], dim=1))

    def preprocess_kwargs(self) -> dict[str, Any]:
        """The timm encoder's data config, at the size its patch embedding was built for (timm's
        fallback 224 would not fit a ViT built with another ``img_size``)."""
        from ..data.images import preprocess_kwargs

        encoder = self.model.encoder
        kwargs = preprocess_kwargs(encoder)
        size = getattr(getattr(encoder, "patch_embed", None), "img_size", None)
        if size is not None and not getattr(encoder, "dynamic_img_size", False):
            kwargs["input_size"] = tuple(pair(size))
        return kwargs


def _windowed_encoder(encoder: nn.Module, size: tuple[int, int]) -> bool:
    """Whether the image encoder's known layout is windowed (Swin); False when no layout is known (the caption
    methods then say so when they need it)."""
    try:
        return bool(find_layout_module(encoder, size)[2].windowed)
    except UnsupportedModelError:
        return False


class HFCaptionAdapter(CaptionAdapter):
    """Hugging Face ``VisionEncoderDecoderModel`` and ``BlipForConditionalGeneration``."""

    def __init__(self, model: nn.Module, kind: str, tokenizer: Any = None) -> None:
        super().__init__(model, tokenizer)
        self.kind = kind
        self.encoder_prefix = "encoder" if kind == "vision-encoder-decoder" else "vision_model"
        vision = model.config.encoder if kind == "vision-encoder-decoder" else model.config.vision_config
        #: the one input size the vision encoder takes (its position embeddings are not interpolated)
        self.fixed_size = pair(vision.image_size)
        if _windowed_encoder(model.get_submodule(self.encoder_prefix), self.fixed_size):
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
            return int(cfg.sep_token_id)
        end = self.model.generation_config.eos_token_id
        end = end if end is not None else cfg.eos_token_id
        return int(end[0] if isinstance(end, (list, tuple)) else end)

    @property
    def start_id(self) -> int:
        if self.kind == "blip":
            return int(self._text_config.bos_token_id)
        start = self.model.config.decoder_start_token_id
        return int(start if start is not None else self._text_config.bos_token_id)

    @property
    def max_positions(self) -> Optional[int]:
        cfg = self._text_config
        for name in ("max_position_embeddings", "n_positions"):
            size = getattr(cfg, name, None)
            if isinstance(size, int) and size > 0:
                return size
        return None

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        kwargs = dict(max_new_tokens=max_len, do_sample=False, num_beams=1)
        if self.kind == "vision-encoder-decoder":
            kwargs.update(decoder_start_token_id=self.start_id, eos_token_id=self.end_id, pad_token_id=self.end_id)
        return self.model.generate(pixel_values=x, **kwargs)[:, 1:]

    def teacher_forced(self, x: Tensor, ids: Tensor) -> Tensor:
        start = torch.full_like(ids[:, :1], self.start_id)
        inputs = torch.cat([start, ids[:, :-1]], dim=1)
        if self.kind == "vision-encoder-decoder":
            return self.model(pixel_values=x, decoder_input_ids=inputs).logits
        return self.model(pixel_values=x, input_ids=inputs).logits

    def preprocess_kwargs(self) -> dict[str, Any]:
        vision = self.model.config.encoder if self.kind == "vision-encoder-decoder" else self.model.config.vision_config
        size = vision.image_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        if self.kind == "blip":  # BLIP's processor uses the CLIP statistics
            mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
        else:
            mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
        return dict(input_size=size, mean=mean, std=std, crop_pct=1.0, interpolation="bicubic")


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

    @property
    def end_id(self) -> int:
        end = self.model.generation_config.eos_token_id
        end = end if end is not None else self.model.config.eos_token_id
        return int(end[0] if isinstance(end, (list, tuple)) else end)

    @property
    def start_id(self) -> int:
        return int(self.model.config.bos_token_id)

    @property
    def max_positions(self) -> Optional[int]:
        size = getattr(self.model.config, "max_position_embeddings", None)  # text positions (image tokens apart)
        return size if isinstance(size, int) and size > 0 else None

    def generate(self, x: Tensor, max_len: int) -> Tensor:
        pad = self.model.config.pad_token_id
        ids = self.model.generate(
            pixel_values=x, max_new_tokens=max_len, do_sample=False, num_beams=1,
            eos_token_id=self.end_id, pad_token_id=pad if pad is not None else self.end_id,
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
def _detect_zoo_captioner(model: nn.Module) -> Optional[Adapter]:
    from ..zoo.captioner import Captioner
    from ..zoo.sat import ShowAttendTell

    if isinstance(model, (Captioner, ShowAttendTell)):
        adapter = ZooCaptionAdapter(model)
        if isinstance(model, ShowAttendTell):
            adapter.capabilities = adapter.capabilities - {"lrp"}
            adapter.notes["lrp"] = ("Show, Attend and Tell decodes with an LSTM (gates multiply activations inside one "
                                    "fused cell) and additive attention, which the LRP rules do not cover")
        return adapter
    return None


@register_adapter(priority=20)
def _detect_torch_decoder(model: nn.Module) -> Optional[Adapter]:
    if isinstance(getattr(model, "decoder", None), nn.TransformerDecoder) and hasattr(model, "encoder") and hasattr(model, "start_id"):
        return TorchDecoderCaptionAdapter(model)
    return None


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
