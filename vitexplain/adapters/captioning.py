"""Adapters for image captioners (encoder-decoder models with cross-attention).

A caption adapter knows where the image encoder is (its self-attention records and token
layout), how to generate greedily (with the model's own KV cache), and how to run the model
teacher-forced on given tokens so that logits row t predicts token t.

Supported: the zoo captioners (:class:`vitexplain.zoo.captioner.Captioner`, and the Show, Attend
and Tell :class:`vitexplain.zoo.sat.ShowAttendTell`), a model built
from ``nn.TransformerDecoder`` over a timm ViT (:class:`TransformerDecoderCaptioner`, or any
module with the same attributes); Hugging Face's captioners (``VisionEncoderDecoderModel``,
``BlipForConditionalGeneration``, ``GitForCausalLM``) in :mod:`~vitexplain.adapters.captioning_hf`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from ..layout import TokenLayout, pair
from ..methods.families import CAPTION
from .base import Adapter, find_layout_module, register_adapter
from .library_errors import library_errors
from ..errors import UnsupportedModelError, UsageError

__all__ = ["model_runs_of", "CaptionAdapter", "ZooCaptionAdapter", "TransformerDecoderCaptioner", "TorchDecoderCaptionAdapter", "IDS_ONLY",
           "ids_only", "greedy_kwargs", "DEFAULT_CACHES", "NOT_GREEDY"]

#: Hugging Face ``model.generate`` keyword arguments that make it return the (B, T) ids tensor, one answer per input,
#: whatever the model's ``generation_config`` says (a checkpoint's ``return_dict_in_generate``, ``output_scores``,
#: ``output_attentions``, ... would make it a ``GenerateOutput``, which cannot be sliced as ids; SDPA has no attention
#: weights to output; ``num_return_sequences`` > 1 would give several rows per input, which greedy search refuses)
IDS_ONLY: dict[str, Any] = dict(return_dict_in_generate=False, output_scores=False, output_logits=False,
                                output_attentions=False, output_hidden_states=False, num_return_sequences=1)


#: ``generation_config.cache_implementation`` values with which ``generate`` builds its default cache: None and
#: "dynamic" (a dynamic cache, with sliding-window layers where the model has them), "hybrid" (transformers 4's Gemma 2
#: default, which transformers 5 unsets itself)
DEFAULT_CACHES = (None, "dynamic", "hybrid")


#: ``generation_config`` settings (and their unset values) that turn greedy search into another decoding algorithm,
#: which ``generate`` runs instead of the greedy search vitexplain asks for: contrastive search (``penalty_alpha``) and
#: DoLa (``dola_layers``) give another answer and in transformers 5 load their code from the Hub (a ValueError asking
#: for ``trust_remote_code``); assisted decoding (``prompt_lookup_num_tokens``, ``assistant_early_exit``, ``use_mtp``)
#: gives the greedy answer, for one input at a time only (a ValueError for a batch); token healing rewrites the
#: prompt's last tokens (and needs the tokenizer), so the answer would follow another prompt than the one explained
NOT_GREEDY: dict[str, Any] = dict(penalty_alpha=None, dola_layers=None, prompt_lookup_num_tokens=None,
                                  assistant_early_exit=None, use_mtp=None, token_healing=False)


def ids_only(model: nn.Module) -> dict[str, Any]:
    """:data:`IDS_ONLY` for ``model.generate``, once the model's ``generation_config`` is known to stop where greedy
    generation with end tokens stops; with ``cache_implementation=None`` (the default dynamic cache) where the config
    asks for another cache, and the settings of :data:`NOT_GREEDY` the config sets unset (greedy search).

    Greedy generation only finds the answer's ids (the maps come from one teacher-forced forward without a cache),
    and its answer does not depend on the cache. The other caches do not all run on every model: a static or
    sliding-window cache on PaliGemma 2 (Gemma 2's sliding-window layers: ``generate`` hands the model one mask per
    layer type, which its forward reads as a tensor) raised a raw AttributeError, a quantized cache needs
    optimum-quanto (an ImportError) and full-attention layers, an offloaded one a GPU.

    Raises:
        UnsupportedModelError: the config sets ``stop_strings``, which ``generate`` applies only with a tokenizer
            (without one it raised a ValueError read as an image the model cannot read) and which end an answer on
            a string rather than an end token, so the words after it would be read as answer words; or
            ``force_words_ids`` / ``constraints``, which only constrained beam search applies.
    """
    config = getattr(model, "generation_config", None)
    name = type(model).__name__
    stops = getattr(config, "stop_strings", None)
    if stops:
        raise UnsupportedModelError(
            f"{name}.generation_config sets stop_strings={stops!r}, which vitexplain's greedy "
            "generation does not apply (it ends an answer at the model's end tokens): set "
            "model.generation_config.stop_strings = None to explain the answer up to the end token, or pass the "
            "answer to explain as caption=...")
    for key in ("force_words_ids", "constraints"):
        if getattr(config, key, None):
            raise UnsupportedModelError(
                f"{name}.generation_config sets {key}={getattr(config, key)!r}, which only constrained beam search "
                f"applies, and vitexplain generates greedily (one beam): set model.generation_config.{key} = None to "
                "explain the greedy answer, or pass the answer to explain as caption=...")
    unset = {key: value for key, value in NOT_GREEDY.items() if getattr(config, key, value) not in (None, value)}
    if getattr(config, "cache_implementation", None) not in DEFAULT_CACHES:
        unset["cache_implementation"] = None
    return {**IDS_ONLY, **unset} if unset else IDS_ONLY


def greedy_kwargs(model: nn.Module, **settings: Any) -> dict[str, Any]:
    """Keyword arguments of ``model.generate`` for vitexplain's greedy search: ``settings`` (``max_new_tokens``,
    ``do_sample=False``, ``num_beams=1``, the end and pad tokens, ...) and :func:`ids_only`, with
    ``generation_config=`` a copy of the model's generation config that holds them all.

    transformers 5 merges the model's generation config into the one ``generate`` builds and validates the result
    before the keyword arguments apply: a setting of the model's config that only they undo was refused there
    (``num_return_sequences=2`` without beams: "Greedy methods ... do not support num_return_sequences different than
    1"). The copy holds the final settings from the start; the model's config is left as it is. A setting of None
    that unsets one the model's config sets stays a keyword argument too (the merge refills a None of the copy from
    the model's config; the keyword arguments apply last).

    Raises:
        UnsupportedModelError: see :func:`ids_only`.
    """
    settings = {**ids_only(model), **settings}
    config = getattr(model, "generation_config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return settings
    fixed = copy.deepcopy(config)
    known = set(fixed.to_dict())
    for key, value in settings.items():
        if key in known:
            setattr(fixed, key, value)
    rest = {key: value for key, value in settings.items()
            if key not in known or (value is None and getattr(config, key, None) is not None)}
    return {"generation_config": fixed, **rest}


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
    #: the generation setting that holds the token a caption starts from (named in the advice on errors)
    start_setting: str = "decoder_start_token_id"

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        super().__init__(model)
        self.tokenizer = tokenizer
        self.capabilities = frozenset({"cross", "lrp", "encoder_attention", "word_queries"})

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

    @contextmanager
    def model_runs(self, generating: bool = False) -> Iterator[None]:
        """Where the model runs (greedy generation, the teacher-forced forward): an error that transformers' or torch's
        code raises there (a decoder that cannot run in this encoder-decoder, e.g. X-MOD asking for a language, a
        setting of ``generation_config`` that ``generate`` cannot take, a cache the decoder cannot use) is raised as an
        :class:`UnsupportedModelError` that carries the model's message and says what to do (the rule of
        :func:`~vitexplain.adapters.library_errors.library_errors`).

        Args:
            generating: the block runs ``generate`` (its message names the generation config and a given caption).

        Raises:
            UnsupportedModelError: such an error in the block.
        """
        model = type(self.model).__name__
        decoder = getattr(self.model, "decoder", None)
        parts = f" (decoder {type(decoder).__name__})" if isinstance(decoder, nn.Module) else ""

        def explain(err: BaseException) -> str:
            what = (f"{model}{parts} could not {'generate a caption' if generating else 'run on the caption'} "
                    f"({type(err).__name__}: {str(err).strip().rstrip('.')}). ")
            if generating:
                return (what + f"Either {model}.generation_config (the checkpoint's or yours) holds a setting its "
                        "generate cannot take: check the one named here, or start from the defaults, "
                        f"model.generation_config = GenerationConfig({self.start_setting}=..., eos_token_id=..., "
                        "pad_token_id=...), and where the error is in the decoder's KV cache set "
                        "model.generation_config.use_cache = False; or the model itself does not run as built (see its "
                        "message). A caption given as caption=... is explained without generating")
            return (what + "The model does not run as built: its own forward refuses these inputs (see its message: "
                    "a setting the decoder needs, e.g. X-MOD's model.decoder.set_default_language(...), or a decoder "
                    "Hugging Face does not run in an encoder-decoder); check that model(pixel_values=..., "
                    "decoder_input_ids=...) runs")

        with library_errors(explain, generating):
            yield

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

    @property
    def max_positions(self) -> Optional[int]:
        """The transformer captioner's learned positions (``max_len``); None for Show, Attend and Tell (an LSTM)."""
        from ..zoo.captioner import Captioner

        return int(self.model.max_len) if isinstance(self.model, Captioner) else None

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


def model_runs_of(adapter: Any, generating: bool = False) -> ContextManager[None]:
    """The adapter's :meth:`~vitexplain.adapters.captioning.CaptionAdapter.model_runs` (errors inside transformers as
    UnsupportedModelErrors), or nothing for an adapter of the user's own that does not subclass CaptionAdapter."""
    runs = getattr(adapter, "model_runs", None)
    return runs(generating) if callable(runs) else nullcontext()
