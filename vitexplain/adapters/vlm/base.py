"""Decoder-only vision-language models: what every VLM adapter knows, and the image-token geometry.

A VLM adapter (:class:`VLMAdapter`) runs the model's own processor on images and prompts (left
padding, so every prompt ends at the same position), generates greedily, runs the teacher-forced
forward on prompt + answer, says which sequence positions hold each image's pixel-bearing tokens
(:meth:`VLMAdapter.image_columns`), which records are the language model's layers, and where each
image token's pixels are in the original image (:class:`ImageView`: one or more token grids, each
covering a box of the original image: the processed image, or tiles and a thumbnail).

Token scores become maps at the original resolution by :func:`render`: every original pixel takes
the score of the token whose grid cell covers its centre (the token's footprint), summed over the
pieces that cover it (tiles and a thumbnail both cover a pixel).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from ...errors import InputError, UnsupportedModelError, UsageError
from ...methods.families import VLM
from ..base import Adapter

__all__ = ["Piece", "ImageView", "VLMAdapter", "render", "processed_box", "submodule_named", "processor_images"]


@dataclass(frozen=True)
class Piece:
    """One grid of image tokens over a box of the original image.

    Attributes:
        name: ``"image"``, ``"thumbnail"``, ``"tile r,c"``.
        grid: (gh, gw) tokens, in row-major order in the sequence.
        box: (y0, x0, y1, x1) the region of the original image the grid covers, in original pixels
            (may reach outside the image where the processor padded it).
        start: index of the grid's first token among the image's pixel-bearing tokens.
        clamp: pixels outside the box take the nearest edge cell instead of nothing (the edge tokens'
            receptive fields reach past the box: Florence-2's overlapping convolutions).
    """

    name: str
    grid: tuple[int, int]
    box: tuple[float, float, float, float]
    start: int
    clamp: bool = False

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


@dataclass(frozen=True)
class ImageView:
    """Where one image's tokens are: its original size and its token grids.

    Attributes:
        size: (H, W) of the original image.
        pieces: the token grids, in sequence order.
        skip: indices, among the image's image-token positions, of tokens without pixels.
        sequence_tokens: how many image tokens the sequence holds when they are not the pixel-bearing
            tokens themselves (a Q-Former's queries, mapped to the patches by
            :meth:`VLMAdapter.to_pixel_tokens`); None: ``num_tokens + len(skip)``.
    """

    size: tuple[int, int]
    pieces: tuple[Piece, ...]
    skip: tuple[int, ...] = ()
    sequence_tokens: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        """How many pixel-bearing tokens the image has."""
        return max(p.start + p.num_tokens for p in self.pieces)

    def pixel_columns(self, columns: Tensor) -> Tensor:
        """The image's pixel-bearing token positions among all its image-token positions ``columns``
        (``skip``: indices of tokens without pixels, e.g. LLaVA-NeXT's row newlines).

        Raises:
            UnsupportedModelError: the sequence holds another number of image tokens than the geometry.
        """
        expected = self.sequence_tokens if self.sequence_tokens is not None else self.num_tokens + len(self.skip)
        if columns.numel() != expected:
            raise UnsupportedModelError(
                f"the sequence holds {columns.numel()} image tokens, but the processed geometry of a {self.size[0]}x"
                f"{self.size[1]} image has {expected}; the processor and the model disagree "
                "(pass the model's own processor)"
            )
        if not self.skip:
            return columns
        keep = torch.ones(columns.numel(), dtype=torch.bool, device=columns.device)
        keep[list(self.skip)] = False
        return columns[keep]


def _cells(length: int, low: float, high: float, cells: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For each of ``length`` pixels (centres at i + 0.5), its grid cell over [low, high) and whether it is inside."""
    centres = torch.arange(length, device=device, dtype=torch.float64) + 0.5
    index = torch.floor((centres - low) / (high - low) * cells).long()
    inside = (index >= 0) & (index < cells)
    return index.clamp(0, cells - 1), inside


def render(scores: Tensor, view: ImageView) -> tuple[Tensor, list[Tensor]]:
    """Token scores as maps at the original resolution.

    Args:
        scores: (T, n) scores of the image's pixel-bearing tokens.
        view: the image's token geometry (n == ``view.num_tokens``, the pixel-bearing tokens).

    Returns:
        ((T, H, W) the sum of the pieces' maps, per piece its (T, H, W) map, zero outside its box).
    """
    if scores.shape[-1] != view.num_tokens:
        raise UnsupportedModelError(
            f"the image has {scores.shape[-1]} image tokens in the sequence, but its processed geometry has "
            f"{view.num_tokens}; the processor and the model disagree (pass the model's own processor)"
        )
    height, width = view.size
    layers = []
    for piece in view.pieces:
        gh, gw = piece.grid
        if not piece.num_tokens:  # no tokens: LLaVA-NeXT's unpadding leaves no row of a very wide image's tiles
            layers.append(scores.new_zeros(scores.shape[0], height, width))
            continue
        grid = scores[:, piece.start : piece.start + piece.num_tokens].reshape(-1, gh, gw)
        y0, x0, y1, x1 = piece.box
        rows, row_in = _cells(height, y0, y1, gh, scores.device)
        cols, col_in = _cells(width, x0, x1, gw, scores.device)
        layer = grid[:, rows][:, :, cols]
        if not piece.clamp:
            layer = layer * (row_in[:, None] & col_in[None, :]).to(scores.dtype)
        layers.append(layer)
    return torch.stack(layers).sum(dim=0), layers


def processed_box(image_processor: Any, height: int, width: int) -> tuple[float, float, float, float]:
    """The box of an (H, W) original image that a resize (+ centre crop) image processor keeps.

    Follows transformers' processors: ``size={"shortest_edge": S}`` scales the short side to S and
    the long side to ``int(S * long / short)``; ``size={"height", "width"}`` resizes to that size;
    then ``crop_size`` (when ``do_center_crop``) cuts the centre, padding first where the crop is larger.
    """
    size = dict(getattr(image_processor, "size", None) or {})
    if not getattr(image_processor, "do_resize", True) or not size:
        rh, rw = height, width
    elif size.get("shortest_edge") and not size.get("longest_edge"):
        short = size["shortest_edge"]
        if height <= width:
            rh, rw = short, int(short * width / height)
        else:
            rh, rw = int(short * height / width), short
    elif size.get("height") and size.get("width"):
        rh, rw = size["height"], size["width"]
    else:
        raise UnsupportedModelError(f"cannot follow this image processor's resize (size={size}); its geometry is unknown")
    top, left, ch, cw = 0.0, 0.0, rh, rw
    crop = dict(getattr(image_processor, "crop_size", None) or {})
    if getattr(image_processor, "do_center_crop", False) and crop:
        ch, cw = crop["height"], crop["width"]
        top = -((ch - rh) // 2) if ch > rh else int((rh - ch) / 2.0)
        left = -((cw - rw) // 2) if cw > rw else int((rw - cw) / 2.0)
    sy, sx = height / rh, width / rw
    return (top * sy, left * sx, (top + ch) * sy, (left + cw) * sx)


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

    def __init__(self, model: nn.Module, processor: Any = None) -> None:
        super().__init__(model)
        self.processor = processor
        self.processor_kwargs: dict[str, Any] = {}
        # "rollout": every language-model layer mixes tokens by attention (Chefer's rules carry relevance through it)
        self.capabilities = frozenset({"image_attention", "rollout"})
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

    def format_prompt(self, prompt: str) -> str:
        """The text given to the processor: the prompt with the image token in front unless it has one."""
        token = str(getattr(self.processor, "image_token", None) or self.image_token)  # (may be an AddedToken)
        return prompt if token in prompt else f"{token}{prompt}"

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
        side = tokenizer.padding_side
        tokenizer.padding_side = self.padding_side
        try:
            pils = processor_images(images)
            given = [[image] for image in pils] if self.nested_images else pils
            batch = processor(images=given, text=texts, return_tensors="pt", padding=True, **self.processor_kwargs)
        except (ValueError, TypeError, KeyError) as err:  # the processor's own checks (image tokens, kwargs)
            raise InputError(
                f"{type(processor).__name__} refused the prompts {texts!r} with {len(images)} image(s)"
                f"{' and processor_kwargs=' + repr(self.processor_kwargs) if self.processor_kwargs else ''}: {str(err).rstrip('.')}. "
                "Check the image (its size and aspect ratio) and the prompt (one image per prompt, at most one image token in it: "
                "vitexplain adds it when missing)"
            ) from err
        finally:
            tokenizer.padding_side = side
        for key in list(batch.keys()):
            # an empty prompt gives a second tokenizer (InstructBLIP's Q-Former) no token at all,
            # and the processor builds that empty batch as float: ids and masks are integers
            if key.endswith(("input_ids", "attention_mask")) and batch[key].is_floating_point():
                batch[key] = batch[key].long()
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
        out = self.model.generate(**inputs, max_new_tokens=max_len, do_sample=False, num_beams=1,
                                  pad_token_id=self.pad_id, suppress_tokens=self.placeholder_ids or None,
                                  **({"eos_token_id": ends} if ends else {}))
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
