"""``Explainer.explain_caption`` for vision-language models: images + prompt -> per-word maps.

One way through: the model's processor (left padding) -> greedy generation (no capture) or the
given answer words -> one teacher-forced forward of prompt + answer under ``vx.capture`` (the
model's SDPA kept; with gradients when a method needs them) -> each method's per-token scores
(:mod:`vitexplain.methods.vlm`) -> the adapter's token-to-pixel geometry -> maps per image at its
original resolution (:class:`~vitexplain.results.VLMCaptionExplanation`).

Maps are always read from the teacher-forced forward, never stitched from generation steps: on
the generated ids it issues the same attention as generation did (the same ids, positions and
masks), in one call per layer, also for sliding-window layers.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .adapters.vlm.base import VLMAdapter
from .adapters.vlm.views import render
from .checks import check_finite_maps, check_gradients_allowed, warn_training
from .errors import InputError, NumericalError, UsageError
from .methods.vlm_context import VLMContext
from .plan import Plan
from .recording import capture
from .recording.graph import embeddings_in_graph
from .results import VLMCaptionExplanation
from .targets import given_token_ids

__all__ = ["explain_vlm", "check_answer"]


def _images(images: Any) -> tuple[list[Any], list[Any]]:
    """(H, W, 3) uint8 RGB arrays of the images, and their sources (paths or None)."""
    from .data.arrays import as_rgb
    from .data.images import load_image

    if isinstance(images, Tensor):
        raise InputError(
            "a vision-language model takes images (paths, PIL images or (H, W, 3) uint8 arrays), which its "
            "processor resizes and tiles itself; a preprocessed tensor cannot be mapped back to the image"
        )
    if getattr(images, "ndim", None) == 4:
        images = list(images)
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise InputError("no images given")
    arrays, sources = [], []
    for i, item in enumerate(items):
        if isinstance(item, (list, tuple)) and item and not isinstance(item[0], (list, tuple, int, float)):
            # several images (not an image's rows of pixels as lists): of different sizes, a bare ValueError of NumPy's
            raise InputError(
                f"image {i} is a {type(item).__name__} of {len(item)} item(s): explain_caption explains one image per "
                "prompt (the image token is put in each prompt once); pass a flat list of images, with one prompt each")
        is_path = isinstance(item, (str, Path))
        sources.append(item if is_path else None)
        arrays.append(load_image(item) if is_path else as_rgb(item, "each image"))
    return arrays, sources


def _per_image(value: Union[None, str, Sequence[Any]], count: int, what: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * count
    if isinstance(value, str):
        return [value] * count
    try:
        items = list(value)
    except TypeError:
        raise UsageError(f"{what} must be a string or a list of one per image, got {type(value).__name__}") from None
    if len(items) != count:
        raise UsageError(f"got {len(items)} {what}s for {count} images; pass one {what} or one per image")
    return items


def check_answer(adapter: Any, caption: str) -> None:
    """A given answer must be words the model's tokenizer knows.

    A word-level tokenizer turns an unknown word into its unknown token, which the model was never
    asked to explain; the run refuses it instead.

    Raises:
        UsageError: a word becomes the tokenizer's unknown token.
    """
    tokenizer = adapter.tokenizer
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or unk not in adapter.encode_answer(caption):
        return
    unknown = [w for w in caption.split() if w != tokenizer.unk_token and unk in adapter.encode_answer(w)]
    raise UsageError(f"the tokenizer does not know {unknown or 'a word of it'} (it would become {tokenizer.unk_token}); "
                     "use words of the model's vocabulary")


def _answer_ids(adapter: VLMAdapter, caption: Any, count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(B, T) given answer ids (padded) and (B,) lengths; each answer ends at its first end token (``e.ids`` of a
    generated explanation, or ``generate``'s output, pad after it: those are not words)."""

    def encode(text: str) -> list[int]:
        check_answer(adapter, text)
        return adapter.encode_answer(text)

    seqs = given_token_ids(caption, count, encode, vocab=adapter.vocab_size, forbidden=adapter.placeholder_ids)
    ends = set(adapter.end_ids)
    for i, seq in enumerate(seqs):  # an answer ends at its first end token (after it: generate's padding), as a caption
        cut = next((k for k, t in enumerate(seq) if t in ends), len(seq))
        if cut == 0:
            raise UsageError(f"answer {i} starts with the end token ({seq[0]}): it has no word to explain; give its "
                             "words, or caption=None to generate")
        seqs[i] = seq[:cut]
    length = max(len(s) for s in seqs)
    ids = torch.tensor([s + [adapter.pad_id] * (length - len(s)) for s in seqs], dtype=torch.long, device=device)
    return ids, torch.tensor([len(s) for s in seqs], device=device)


def _generated(adapter: VLMAdapter, inputs: Any, max_len: int) -> tuple[Tensor, Tensor]:
    """Greedy answers: (B, T) ids and (B,) lengths up to (excluding) the first end token."""
    with torch.no_grad():
        ids = adapter.generate(inputs, max_len)
    ends = torch.zeros_like(ids, dtype=torch.bool)
    for end in adapter.end_ids:
        ends |= ids == end
    lengths = torch.where(ends.any(dim=1), ends.float().argmax(dim=1), torch.full_like(ends[:, 0], ids.shape[1], dtype=torch.long))
    return ids, lengths.long()


def _answer_room(adapter: VLMAdapter, inputs: Any, start: int) -> Optional[int]:
    """How many answer tokens fit in the model's learned position table after the prompt (None: no table).

    Raises:
        InputError: the prompt alone fills the table.
    """
    limit = adapter.position_limit()
    if limit is None:
        return None
    ids = inputs.get("input_ids")  # (an encoder-decoder's encoder input: at most the whole table)
    longest = 0 if ids is None else int(ids.shape[1])
    if start >= limit or longest > limit:
        raise InputError(f"the prompt takes {max(start, longest)} positions (image tokens included), but the model has "
                         f"{limit} learned positions{', so no answer word fits' if start >= limit else ''}; "
                         "give a shorter prompt")
    return limit - start


def _check_finite_answer_rows(logits: Tensor, start: int, lengths: Tensor) -> None:
    """Raise when the rows of ``logits`` (B, N, V) that predict the answer words (``start - 1 + t``, at least the
    first word's) hold NaN or inf: greedy decoding of NaN scores picks token 0 at every step, and attention-only
    methods never read the scores, so such a model's "answer" and maps would pass as results.

    Raises:
        NumericalError: naming the images and what to check.
    """
    if not isinstance(logits, Tensor):
        return
    lo = max(start - 1, 0)
    bad = [b for b, n in enumerate(lengths.tolist())
           if not bool(torch.isfinite(logits[b, lo : lo + max(int(n), 1)].detach()).all())]
    if bad:
        raise NumericalError(
            f"the model's outputs (next-word scores) are not finite (NaN or inf) for images {bad}, so its answers and "
            "maps would mean nothing: check the model's weights and the input's scale")


def explain_vlm(adapter: VLMAdapter, plan: Plan, images: Any, caption: Any, prompt: Any,
                max_len: int) -> list[VLMCaptionExplanation]:
    """Per-word maps of a VLM, one explanation per method of ``plan`` (see ``Explainer.explain_caption``).

    Raises:
        UsageError: no processor, or prompts/captions that are not one or one per image.
        InputError: a tensor instead of images.
    """
    adapter.require_processor()
    check_gradients_allowed([s.name for s in plan.steps if s.spec.grads], "explain_caption")  # (before generating)
    model = adapter.model
    warn_training(model, stacklevel=4)
    arrays, sources = _images(images)
    prompts = _per_image(prompt, len(arrays), "prompt", "")
    if any(not isinstance(p, str) for p in prompts):
        raise UsageError("prompt must be a string or one string per image")
    with adapter.own_processor():  # (another family's processor fails here, before any generation)
        adapter.check_prompts(prompts)
        inputs = adapter.prepare(arrays, prompts)
        views = adapter.views(arrays, inputs)
        start = adapter.answer_start(inputs)
        columns = [view.pixel_columns(cols) for view, cols in zip(views, adapter.image_columns(inputs))]
    room = _answer_room(adapter, inputs, start)
    if caption is None:
        with adapter.model_reads_batch(generating=True):
            ids, lengths = _generated(adapter, inputs, max_len if room is None else min(max_len, room))
    else:
        ids, lengths = _answer_ids(adapter, caption, len(arrays), next(model.parameters()).device)
        if room is not None and int(lengths.max()) > room:
            raise UsageError(f"the answer has {int(lengths.max())} tokens, but after this prompt the model has positions "
                             f"for {room} (its {adapter.position_limit()} learned positions); give a shorter answer or prompt")
    t = max(int(lengths.max()), 1)
    ids = ids[:, :t]
    if ids.shape[1] < t:
        ids = F.pad(ids, (0, t - ids.shape[1]), value=adapter.pad_id)
    with adapter.own_processor():
        kwargs = adapter.teacher_inputs(inputs, ids)
    grads = plan.capture.grads
    if grads:  # every attention call in the graph, also with frozen weights (requires_grad_(False))
        for key in ("pixel_values", "flattened_patches", "pixel_values_images"):  # (Pix2Struct's, Video-LLaVA's)
            if isinstance(kwargs.get(key), Tensor) and kwargs[key].is_floating_point():
                kwargs[key] = kwargs[key].detach().clone().requires_grad_(True)
    with torch.set_grad_enabled(grads), embeddings_in_graph(model) if grads else nullcontext(), \
            capture(model, **plan.capture.capture_kwargs()) as rec, adapter.model_reads_batch():
        logits = adapter.forward_logits(kwargs)
    _check_finite_answer_rows(logits, start, lengths)
    words = [[adapter.word(i) for i in row[: int(n)].tolist()] for row, n in zip(ids, lengths)]
    captions = [adapter.tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True).strip() for row, n in zip(ids, lengths)]
    height = max(v.size[0] for v in views)
    width = max(v.size[1] for v in views)
    results = []
    for step in plan.steps:
        ctx = VLMContext(adapter, rec, ids, lengths, start, columns, logits if grads else None, step.name, inputs=kwargs)
        with torch.set_grad_enabled(grads):
            scores = step.spec.fn(ctx, **step.options)
        scores = [check_finite_maps(score.detach().float(), step.name).clone() for score in scores]
        for b, score in enumerate(scores):
            score[int(lengths[b]):] = 0.0
        with torch.no_grad():
            pixel_scores = adapter.to_pixel_tokens(scores, rec)
        maps = torch.zeros(len(arrays), t, height, width, device=ids.device)
        image_maps, token_scores, layers = [], [], []
        for b, (score, view) in enumerate(zip(scores, views)):
            pixel_map, pieces = render(pixel_scores[b], view)
            same = view.size == (height, width)  # others are resampled: overlays resize a map back onto its image
            maps[b] = pixel_map if same else F.interpolate(pixel_map[None], size=(height, width), mode="nearest-exact")[0]
            image_maps.append(pixel_map)
            token_scores.append(score)
            layers.append({p.name: layer for p, layer in zip(view.pieces, pieces)})
        results.append(VLMCaptionExplanation(
            maps=maps, tokens=words, ids=ids.detach(), captions=captions, method=step.name,
            options=dict(step.options), input_size=(height, width), layout=None, images=arrays, sources=sources,
            signed=step.spec.signed, prompts=prompts, image_maps=image_maps, token_scores=token_scores, layers=layers,
        ))
    rec.clear()
    return results
