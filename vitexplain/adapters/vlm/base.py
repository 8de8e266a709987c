"""Decoder-only vision-language models: what every VLM adapter knows.

A VLM adapter (:class:`VLMAdapter`) runs the model's own processor on images and prompts (left
padding, so every prompt ends at the same position), generates greedily, runs the teacher-forced
forward on prompt + answer, says which sequence positions hold each image's pixel-bearing tokens
(:meth:`VLMAdapter.image_columns`), which records are the language model's layers, and where each
image token's pixels are in the original image (:meth:`VLMAdapter.views`, the geometry of
:mod:`~vitexplain.adapters.vlm.views`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import InputError, UnsupportedModelError, UsageError, VitexplainError
from ...methods.families import VLM
from ..base import Adapter
from ..captioning import greedy_kwargs
from ..library_errors import library_errors
from .views import ImageView

__all__ = ["VLMAdapter", "submodule_named", "processor_images"]


def processor_images(images: Sequence[Any]) -> list[Any]:
    """(H, W, 3) uint8 arrays as PIL RGB images, the form a processor cannot misread: given an array
    with a side of 1 or 3 pixels (e.g. (3, 45, 3), (1, 37, 3), (4, 3, 3)), transformers may guess that
    the channels come first and process another image, silently."""
    import numpy as np
    from PIL import Image

    return [Image.fromarray(np.ascontiguousarray(image), "RGB") for image in images]


def submodule_named(model: nn.Module, *suffixes: str) -> str:
    """The name of the first submodule whose name ends with one of ``suffixes`` ("" when none)."""
    for name, _ in model.named_modules():
        if any(name == s or name.endswith("." + s) for s in suffixes):
            return name
    return ""


class VLMAdapter(Adapter):
    """A decoder-only VLM whose image tokens sit in the language model's sequence.

    Subclasses say where the image tokens are (:meth:`views`, :meth:`image_columns`) and add the
    model's own inputs to the teacher-forced forward (:meth:`teacher_inputs`).

    Attributes:
        processor: the model's processor (tokenizer + image processor).
        processor_kwargs: extra keyword arguments of every processor call (e.g. Gemma 3's
            ``{"do_pan_and_scan": True}``, Qwen's ``{"max_pixels": ...}``).
        lm_prefix: module name of the language model (its self-attention records are read).
    """

    family = VLM
    #: the token that stands for the image in a prompt (the processor expands it)
    image_token: str = "<image>"
    #: the first position id (PaliGemma counts from 1)
    position_offset: int = 0
    #: the processor takes one list of images per prompt
    nested_images: bool = False
    #: the image reaches the language model through cross-attention layers (mllama): :meth:`lm_records`
    #: are those layers' calls and :meth:`image_columns` index their keys
    cross_layers: bool = False
    #: how the processor pads prompts ("left": every prompt ends at the same position)
    padding_side: str = "left"
    #: processor outputs the model needs (a batch without one is refused in :meth:`prepare`), and what for
    required_inputs: tuple[str, ...] = ()
    required_for: str = ""
    #: per-token processor outputs (B, L) the teacher-forced forward extends over the answer, each with the value
    #: ``generate`` gives its generated tokens (e.g. ``{"mm_token_type_ids": 0}``: text)
    answer_values: Mapping[str, int] = {}

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model)
        self.processor = processor
        self.processor_kwargs: dict[str, Any] = {}
        # "rollout": every language-model layer mixes tokens by attention (Chefer's rules carry relevance through it)
        self.capabilities = frozenset({"image_attention", "rollout"})
        # AttnLRP / CP-LRP per word: offered where an adapter's pixels-to-tokens pooling is checked (LLaVA adds "lrp")
        self.notes["lrp"] = ("AttnLRP and CP-LRP per word are checked against a hand-written oracle on LLaVA, ViP-LLaVA, "
                             "Video-LLaVA, PaliGemma, Gemma 3, Qwen2/2.5/3-VL, LLaVA-NeXT(-Video), LLaVA-OneVision, "
                             "Idefics3, SmolVLM, InternVL, Qianfan-OCR, Mistral 3, LightOnOCR, Pixtral-12B and mllama only; "
                             f"{type(model).__name__} is not, so they are not offered: use cross_generic or cross_grad")
        self.lm_prefix = submodule_named(model, "language_model", "text_model")

    def without_attention_flow(self, layers: Sequence[str], mixing: str) -> None:
        """Refuse ``cross_generic`` when some language-model layers mix tokens without attention (hybrid LMs).

        Args:
            layers: the language model's ``config.layer_types``.
            mixing: what those other layers are (e.g. "linear attention (Gated DeltaNet)").
        """
        other = sum(t not in ("full_attention", "sliding_attention") for t in layers)
        if other:
            self.capabilities = self.capabilities - {"rollout"}
            self.notes["rollout"] = (
                f"{other} of the {len(layers)} language-model layers of {type(self.model).__name__} are {mixing}, which "
                "mixes tokens with no attention matrix to carry relevance through; cross and cross_grad read its "
                "attention layers")

    # -- what the Explainer needs -------------------------------------------------------------
    def with_processor(self, processor: Any, kwargs: Optional[dict[str, Any]] = None) -> "VLMAdapter":
        """This adapter with the model's processor (and extra keyword arguments for its calls)."""
        self.processor = processor
        self.processor_kwargs = dict(kwargs or {})
        return self

    @property
    def image_processor(self) -> Any:
        """The processor's image processor as every processor call sees it: ``processor_kwargs`` that name its
        settings (``size``, ``crop_size``, ``do_image_splitting``, ...) override them there, so the token
        geometry reads them from a copy with those settings applied (the processor's own object is left as found)."""
        found = self.require_processor().image_processor
        settings = {k: v for k, v in self.processor_kwargs.items() if hasattr(found, k)}
        if not settings:
            return found
        applied = copy.copy(found)
        for key, value in settings.items():
            setattr(applied, key, value)
        return applied

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", None)

    def require_processor(self) -> Any:
        if self.processor is None or self.tokenizer is None:
            raise UsageError(
                f"{type(self.model).__name__} is a vision-language model: pass its processor, "
                "vx.Explainer(model, processor=AutoProcessor.from_pretrained(path))"
            )
        return self.processor

    @property
    def image_token_id(self) -> int:
        config = self.model.config
        for name in ("image_token_id", "image_token_index"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        raise UnsupportedModelError(f"{type(self.model).__name__}'s config names no image token id")

    @property
    def end_ids(self) -> list[int]:
        """Token ids that end an answer."""
        end = getattr(self.model.generation_config, "eos_token_id", None)
        if end is None and self.tokenizer is not None:
            end = self.tokenizer.eos_token_id
        return [] if end is None else [int(e) for e in (end if isinstance(end, (list, tuple)) else [end])]

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = (self.end_ids or [0])[0]
        return int(pad)

    def linear_dtype(self, suffix: str) -> Optional[torch.dtype]:
        """The weight dtype of the model's ``nn.Linear`` whose name ends with ``suffix`` (a patch projection that
        reads the processor's float32 patches with no vision tower to cast them), or None when there is none."""
        return next((m.weight.dtype for name, m in self.model.named_modules()
                     if name.endswith(suffix) and isinstance(m, nn.Linear)), None)

    @contextmanager
    def own_processor(self) -> Iterator[None]:
        """Where the processor's batch and the token geometry are read: a KeyError, AttributeError, TypeError or
        IndexError there (a batch without the model's inputs, an image processor without its settings) comes from
        a processor that is not the model's, and is raised as an :class:`UnsupportedModelError` saying so.

        Raises:
            UnsupportedModelError: such an error in the block.
        """
        try:
            yield
        except VitexplainError:
            raise
        except (KeyError, AttributeError, TypeError, IndexError) as err:
            raise UnsupportedModelError(
                f"{type(self.processor).__name__} and {type(self.model).__name__} disagree ({type(err).__name__}: {err}): "
                "is it another family's processor? Pass the model's own processor, "
                "vx.Explainer(model, processor=AutoProcessor.from_pretrained(path))") from err

    @contextmanager
    def model_reads_batch(self, generating: bool = False) -> Iterator[None]:
        """Where the model runs on the processor's batch (generation, the teacher-forced forward): a ValueError,
        RuntimeError or IndexError that transformers' or torch's code raises there (an image size, aspect ratio, tile
        count or number of image tokens the model cannot read, e.g. from ``processor_kwargs``, a processor of another
        checkpoint or a very elongated image) is raised as an :class:`UnsupportedModelError` that says so and carries
        the model's message. Running out of memory, and an error raised by other code (the user's own modules or
        hooks), come out as they are.

        Args:
            generating: the block runs ``generate``, which also reads ``model.generation_config``: the message names it
                too, and a TypeError, AttributeError, KeyError or ImportError of transformers' or torch's code there
                (a setting of a type or a cache the model's code cannot take, e.g. ``begin_suppress_tokens=5``) is
                raised as well.

        Raises:
            UnsupportedModelError: such an error in the block.
        """
        def explain(err: BaseException) -> str:
            settings = f" with processor_kwargs={self.processor_kwargs!r}" if self.processor_kwargs else ""
            model = type(self.model).__name__
            what = (f"{model} could not {'generate an answer' if generating else 'run'} on the batch of "
                    f"{type(self.processor).__name__}{settings} ({type(err).__name__}: {str(err).strip().rstrip('.')}). ")
            if generating:
                return (what + f"Either {model}.generation_config (the checkpoint's or yours) holds a setting its generate "
                        "cannot take: check the one named here, or start from the defaults, model.generation_config = "
                        "GenerationConfig(eos_token_id=..., pad_token_id=...); or the model cannot read an image size, aspect "
                        "ratio, number of tiles or of image tokens outside what it was built for: use the model's own "
                        "processor settings and check the image. An answer given as caption=... needs no generation")
            return (what + "It cannot read an image size, aspect ratio, "
                    "number of tiles or of image tokens outside what it was built for: use the model's own processor "
                    "settings (processor_kwargs or another checkpoint's processor may change them) and check the image")

        with library_errors(explain, generating):
            yield

    def format_prompt(self, prompt: str) -> str:
        """The text given to the processor: the prompt with the image token in front unless it has one."""
        token = str(getattr(self.processor, "image_token", None) or self.image_token)  # (may be an AddedToken)
        return prompt if token in prompt else f"{token}{prompt}"

    def check_prompts(self, prompts: Sequence[str]) -> None:
        """Refuse a prompt that holds the model's image token itself where the processor writes the image with another
        placeholder (Gemma 3: ``<image_soft_token>``, written by the processor for ``<start_of_image>``): each such
        token would stand for one more image feature than the image has.

        Raises:
            InputError: naming the prompt, the token and the placeholder to write instead.
        """
        try:
            raw = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
        except (VitexplainError, TypeError, ValueError, IndexError, OverflowError):  # (a family with no such token)
            return
        placeholder = self.format_prompt("")  # ("": the processor puts the image in front itself, bare_prompt checks)
        if not isinstance(raw, str) or not raw or not placeholder or raw in placeholder:
            return
        for i, prompt in enumerate(prompts):
            if raw in prompt:
                raise InputError(
                    f"prompt {i} ({prompt!r}) holds {raw!r}, the token {type(self.processor).__name__} writes for each "
                    f"feature of the image, so the model would find more image tokens than image features; write the "
                    f"image as {placeholder!r} or leave it out (vitexplain puts it in front)")

    def bare_prompt(self, prompt: str) -> str:
        """The prompt for a processor that puts the image tokens in front of it itself (BLIP-2,
        InstructBLIP, Florence-2): unchanged, once checked to hold no image token of its own.

        Raises:
            InputError: the prompt holds the image token (the model would find more image tokens than
                image features).
        """
        token = getattr(self.processor, "image_token", None)
        if token is not None and str(token) in prompt:
            raise InputError(
                f"the prompt {prompt!r} holds the image token {str(token)!r}, which {type(self.processor).__name__} "
                "puts in front of every prompt itself; remove it from the prompt"
            )
        return prompt

    def prepare(self, images: Sequence[Any], prompts: Sequence[str]) -> Any:
        """The processor's batch for (H, W, 3) uint8 images and prompts, left-padded (tensors on the model's device)."""
        processor = self.require_processor()
        texts = [self.format_prompt(p) for p in prompts]
        tokenizer = self.tokenizer
        side, pad = tokenizer.padding_side, tokenizer.pad_token
        tokenizer.padding_side = self.padding_side
        if pad is None:  # (Llama-style tokenizers have none: pad with the end token, say, masked out as generate's padding)
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(self.pad_id) or tokenizer.eos_token or tokenizer.unk_token
        try:
            pils = processor_images(images)
            given = [[image] for image in pils] if self.nested_images else pils
            batch = processor(images=given, text=texts, return_tensors="pt", padding=True, **self.processor_kwargs)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, ArithmeticError) as err:
            # the processor's own checks (image tokens, kwargs), and its failures on an image it cannot take (1 x 1 px)
            raise InputError(
                f"{type(processor).__name__} refused the prompts {texts!r} with {len(images)} image(s)"
                f"{' and processor_kwargs=' + repr(self.processor_kwargs) if self.processor_kwargs else ''}: {str(err).rstrip('.')}. "
                "Check the image (its size and aspect ratio) and the prompt (one image per prompt, at most one image token in it: "
                "vitexplain adds it when missing)"
            ) from err
        finally:
            tokenizer.padding_side = side
            if pad is None:
                tokenizer.pad_token = None
        for key in list(batch.keys()):
            # an empty prompt gives a second tokenizer (InstructBLIP's Q-Former) no token at all,
            # and the processor builds that empty batch as float: ids and masks are integers
            if key.endswith(("input_ids", "attention_mask")) and batch[key].is_floating_point():
                batch[key] = batch[key].long()
        missing = [key for key in self.required_inputs if key not in batch]
        if missing:
            raise UnsupportedModelError(
                f"the processor gave no {' or '.join(missing)}, which {type(self.model).__name__} needs "
                f"{self.required_for}; use the model's own processor (from transformers >= 5)")
        device = next(self.model.parameters()).device
        return batch.to(device)

    @property
    def placeholder_ids(self) -> list[int]:
        """Token ids that stand for image content (never an answer word: generation suppresses them)."""
        return [self.image_token_id]

    def generate(self, inputs: Any, max_len: int) -> Tensor:
        """Greedy answer ids (B, T) after the prompt (padded after each answer's end); image
        placeholder tokens are suppressed (fed back, they would ask for an image that is not there)."""
        ends = self.end_ids
        out = self.model.generate(**inputs, **greedy_kwargs(
            self.model, max_new_tokens=max_len, do_sample=False, num_beams=1, pad_token_id=self.pad_id,
            suppress_tokens=self.placeholder_ids or None, **({"eos_token_id": ends} if ends else {})))
        return out[:, inputs["input_ids"].shape[1]:]

    def answer_start(self, inputs: Any) -> int:
        """L: the position of answer word 0 in the sequence whose row ``L - 1 + t`` predicts word t
        (the left-padded prompt's length).

        Raises:
            UnsupportedModelError: a prompt ends in padding (its row ``L - 1`` would be a pad's).
        """
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask[:, -1].all()):
            raise UnsupportedModelError(
                f"the processor padded prompt(s) {(mask[:, -1] == 0).nonzero()[:, 0].tolist()} at the end, so the "
                "position that predicts answer word 0 would be padding; give prompts of one length"
            )
        return int(inputs["input_ids"].shape[1])

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        """The teacher-forced forward's keyword arguments: prompt + answer ids, the mask extended,
        and positions that skip the left padding (as ``generate`` counts them)."""
        kwargs = {k: v for k, v in inputs.items() if k != "labels"}  # (PaliGemma's processor adds labels)
        mask = inputs["attention_mask"]
        kwargs["input_ids"] = torch.cat([inputs["input_ids"], ids], dim=1)
        kwargs["attention_mask"] = torch.cat([mask, torch.ones_like(ids, dtype=mask.dtype)], dim=1)
        kwargs["position_ids"] = (kwargs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0) + self.position_offset
        for key, value in self.answer_values.items():  # per-token inputs: the answer's as generate gives them
            given = inputs[key]
            kwargs[key] = torch.cat([given, torch.full_like(ids, value, dtype=given.dtype)], dim=1)
        return kwargs

    def forward_logits(self, kwargs: dict[str, Any]) -> Tensor:
        """(B, N, V) logits of one forward."""
        return self.model(**kwargs, use_cache=False).logits

    def position_limit(self) -> Optional[int]:
        """The most positions a sequence of the language model may take: the smallest learned position table's
        (``embed_positions`` of BART, OPT, less their offset); None where positions are no table (rotary,
        relative, sinusoidal)."""
        sizes = [int(m.num_embeddings) - int(getattr(m, "offset", 0)) for name, m in self.model.named_modules()
                 if name.endswith("embed_positions") and isinstance(m, nn.Embedding)]
        return min(sizes) if sizes else None

    def image_columns(self, inputs: Any) -> list[Tensor]:
        """Per image, the sequence positions of its image tokens in the processor's batch, in sequence order."""
        found = inputs["input_ids"] == self.image_token_id
        return [row.nonzero()[:, 0] for row in found]

    def lm_records(self, records: Sequence[Any]) -> list[Any]:
        """The language model's self-attention records (one per layer of one forward)."""
        prefix = self.lm_prefix + "."
        return [r for r in records if r.kind == "self" and r.name.startswith(prefix)]

    def views(self, images: Sequence[Any], inputs: Any) -> list[ImageView]:
        """Per image, where its tokens' pixels are."""
        raise self.not_implemented("views()")

    def to_pixel_tokens(self, scores: list[Tensor], recorder: Any) -> list[Tensor]:
        """Per image, (T, n_b) scores of its image tokens in the sequence as scores of its pixel-bearing
        tokens (the identity, except where a Q-Former or resampler sits between the two)."""
        return scores

    def lrp_pixels(self, kwargs: Mapping[str, Any]) -> str:
        """The keyword of the teacher-forced forward whose pixels AttnLRP's relevance is read at (adapters with the
        ``"lrp"`` capability)."""
        raise self.not_implemented("lrp_pixels()")

    def lrp_tokens(self, relevance: Tensor, counts: Sequence[int], inputs: Mapping[str, Any]) -> list[Tensor]:
        """Per image, (T, n_b) relevance of its image tokens from (B, T, ...) relevance at the pixels of
        :meth:`lrp_pixels` (channels summed): each token's pixels summed (adapters with the ``"lrp"`` capability);
        ``inputs``: the teacher-forced forward's keyword arguments (tiled models read ``image_sizes`` there)."""
        raise self.not_implemented("lrp_tokens()")

    def word(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)]).strip()

    def encode_answer(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def vocab_size(self) -> Optional[int]:
        size = getattr(self.model.config.get_text_config(), "vocab_size", None)
        return size if isinstance(size, int) else None

    def describe(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"
