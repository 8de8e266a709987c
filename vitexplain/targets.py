"""What a gradient is taken of: a class index, a label name, a per-image list, or any score.

``resolve(target, logits, label_names)`` turns what the user passed into a :class:`Target`:
the per-image class indices (``-1`` when a callable defines the score) and a function from
the model's outputs to a (B,) score. The score of a class is its pre-softmax logit
(docs/methods.md): for multi-label models too, the default target is the top-scoring label.

Headless backbones (``num_classes=0``, ``ViTModel``, ``Dinov2Model``, ``CLIPVisionModel``,
``SiglipVisionModel``, ...) output a pooled embedding (B, D) instead of logits; explain a
score of it::

    vx.targets.similarity(text_embedding)     # cosine of the embedding to a given vector
    vx.targets.norm()                         # the embedding's L2 norm
    lambda emb: emb @ direction               # any callable outputs -> (B,)
"""

from __future__ import annotations

import difflib
import numbers
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from .errors import TargetError, UsageError

__all__ = ["Target", "TargetSpec", "resolve", "label_matches", "class_score", "logits_of", "embedding_of", "similarity", "norm", "given_token_ids"]

TargetSpec = Union[None, int, str, Sequence[Union[int, str]], Tensor, Callable[[Any], Tensor]]


def logits_of(outputs: Any) -> Tensor:
    """The (B, C) logits inside a model's outputs (a tensor, ``.logits``, a dict's ``"logits"``, or a tuple's
    first item)."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    raise TargetError(
        f"cannot find logits in the model output of type {type(outputs).__name__}; pass a "
        "callable target that maps the outputs to a (B,) score"
    )


def embedding_of(outputs: Any) -> Tensor:
    """The (B, D) pooled embedding inside a model's outputs.

    A tensor (what ``vx.Explainer`` passes: adapters return the pooled embedding of a
    headless model), or a Hugging Face output's ``image_embeds`` or ``pooler_output``.
    """
    if isinstance(outputs, Tensor):
        return outputs
    for name in ("image_embeds", "pooler_output"):
        value = getattr(outputs, name, None)
        if isinstance(value, Tensor):
            return value
    raise TargetError(
        f"cannot find a pooled embedding in the model output of type {type(outputs).__name__}; "
        "pass a callable target that maps the outputs to a (B,) score"
    )


def _rows_for(vector: Tensor, rows: int) -> Tensor:
    """A (D,) / (1, D) vector for every row, or a (B, D) one per row when B == rows."""
    if vector.dim() == 1:
        return vector.unsqueeze(0)
    if vector.shape[0] in (1, rows):
        return vector
    raise TargetError(
        f"the target embedding has {vector.shape[0]} rows but the score is taken over {rows} "
        "outputs (this method scores several perturbed copies per image); pass one (D,) vector, "
        "or explain one image at a time"
    )


def similarity(embedding: Any) -> Callable[[Any], Tensor]:
    """Target: cosine similarity of the model's pooled embedding to ``embedding``.

    For headless backbones (and any model whose outputs are an embedding), e.g. a CLIP
    vision tower explained against a text embedding.

    Args:
        embedding: (D,) vector (or (1, D); (B, D) one per image for methods that score the
            batch once), in the space of the model's output embedding.

    Returns:
        ``score(outputs) -> (B,)`` for ``target=``.
    """
    vector = torch.as_tensor(embedding).detach()
    if vector.dim() not in (1, 2) or vector.shape[-1] == 0:
        raise TargetError(f"similarity() needs a (D,) or (B, D) embedding, got shape {tuple(vector.shape)}")

    def score(outputs: Any) -> Tensor:
        emb = embedding_of(outputs)
        if emb.dim() != 2 or emb.shape[-1] != vector.shape[-1]:
            raise TargetError(
                f"similarity(): the model's embedding has shape {tuple(emb.shape)}, the target "
                f"vector {tuple(vector.shape)}; they must share the last dimension"
            )
        ref = _rows_for(vector, emb.shape[0]).to(device=emb.device, dtype=emb.dtype)
        return torch.nn.functional.cosine_similarity(emb, ref.expand_as(emb), dim=-1)

    score.__name__ = "similarity"
    return score


def norm() -> Callable[[Any], Tensor]:
    """Target: the L2 norm of the model's pooled embedding, (B,)."""

    def score(outputs: Any) -> Tensor:
        emb = embedding_of(outputs)
        return emb.flatten(1).norm(dim=-1)

    score.__name__ = "norm"
    return score


def class_score(classes: Tensor) -> Callable[[Any], Tensor]:
    """Score function returning, per image, the logit of ``classes`` (B,)."""

    def score(outputs: Any) -> Tensor:
        logits = logits_of(outputs)
        return logits.gather(1, classes.to(logits.device).view(-1, 1)).squeeze(1)

    return score


@dataclass
class Target:
    """A resolved target.

    Attributes:
        classes: (B,) long class indices; -1 where a callable defines the score.
        score: maps the model outputs to the (B,) scalar scores that are explained.
        description: human-readable, for manifests.
    """

    classes: Tensor
    score: Callable[[Any], Tensor]
    description: str
    custom: bool = False

    def repeat(self, n: int) -> "Target":
        """The same target for a batch in which every image is repeated ``n`` times in a row.

        Used by methods that score several perturbed copies of each image at once
        (image i's copies are rows ``i * n .. i * n + n - 1``).
        """
        if self.custom:
            return self
        classes = self.classes.repeat_interleave(n)
        return Target(classes, class_score(classes), self.description)


def label_matches(value: str, label_names: Sequence[str]) -> list[int]:
    """The classes ``value`` names: those whose label is ``value``, else those whose label lists it among its
    comma-separated synonyms ("goldfish, Carassius auratus": ImageNet's names in timm)."""
    matches = [i for i, name in enumerate(label_names) if name == value]
    return matches or [i for i, name in enumerate(label_names) if value in (s.strip() for s in str(name).split(","))]


def _labels_hint(value: str, label_names: Sequence[str]) -> str:
    """The labels close to ``value`` (all of them when there are few), for an unknown-label message."""
    names = [str(n) for n in label_names]
    if len(names) <= 20:
        return f"this model's labels are {names}"
    synonyms = {s.strip(): n for n in names for s in n.split(",")}
    close = [synonyms[s] for s in difflib.get_close_matches(value, list(synonyms), n=5, cutoff=0.6)]
    near = f"close ones: {list(dict.fromkeys(close))}" if close else "none is close"
    return f"this model has {len(names)} labels ({near}; adapter.label_names lists them)"


def _held_integer(value: Any) -> Any:
    """A 0-d integer tensor (``logits[i].argmax()``) as the Python int it holds, as a 0-d target tensor is read;
    anything else as it is."""
    if isinstance(value, Tensor) and value.dim() == 0 and not (value.is_floating_point() or value.is_complex()
                                                               or value.dtype == torch.bool):
        return int(value)
    return value


def _index(value: Union[int, str], num_classes: int, label_names: Optional[Sequence[str]]) -> int:
    if not isinstance(value, (str, numbers.Integral)) or isinstance(value, bool):
        raise TargetError(
            f"target {value!r} is a {type(value).__name__}; a class target is an integer index or a label name "
            "(a float is never rounded to a class: pass int(...) if that is what you mean)"
        )
    if isinstance(value, str):
        if not label_names:
            raise TargetError(
                f"target {value!r} is a label name, but this model has no label names; pass a class index"
            )
        matches = label_matches(value, label_names)
        if not matches:
            raise TargetError(f"unknown label {value!r}; {_labels_hint(value, label_names)}")
        if len(matches) > 1:  # e.g. ImageNet's two 'crane' classes (the bird, the machine)
            raise TargetError(f"label {value!r} names several classes {matches}; pass the class index you mean")
        return matches[0]
    index = int(value)
    if not 0 <= index < num_classes:
        raise TargetError(f"target class {index} is out of range for a model with {num_classes} classes (0..{num_classes - 1})")
    return index


def resolve(
    target: TargetSpec, outputs: Any, label_names: Optional[Sequence[str]] = None, *, has_head: bool = True
) -> Target:
    """Resolve a user target against the model outputs.

    Args:
        target: None (each image's top prediction), an int or label name (same for all
            images), a sequence or tensor with one int/label per image (0-d tensors and
            NumPy scalars/arrays count as the Python values they hold), or a callable
            ``score(outputs) -> (B,)`` tensor.
        outputs: the model outputs of the explained forward (logits (B, C) or an object
            with ``.logits``).
        label_names: class names, for label-name targets.
        has_head: False for a headless backbone (its outputs are an embedding): then only a
            callable target is accepted.

    Returns:
        The :class:`Target`.

    Raises:
        TargetError: out-of-range index, unknown label, wrong number of targets, or a
            callable returning something other than a (B,) tensor.
    """
    if callable(target) and not isinstance(target, Tensor):
        def score(out: Any) -> Tensor:
            value = target(out)
            rows = _batch_size(out)
            if not isinstance(value, Tensor) or value.dim() != 1 or value.shape[0] != rows:
                raise TargetError(
                    f"a callable target must return a ({rows},) tensor with one score per image, got "
                    f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
                )
            return value

        batch = _batch_size(outputs)
        classes = torch.full((batch,), -1, dtype=torch.long)
        return Target(classes, score, getattr(target, "__name__", "callable"), custom=True)

    if not has_head:
        raise TargetError(
            "this model has no classifier head: its output is a pooled embedding, not class "
            f"logits, so target={target!r} has no class to explain. Pass "
            "target=vx.targets.similarity(vector) (cosine to a given embedding), "
            "vx.targets.norm(), or any callable score(outputs) -> (B,)"
        )

    logits = logits_of(outputs)
    if logits.dim() != 2:
        raise TargetError(f"expected (B, C) logits, got shape {tuple(logits.shape)}; pass a callable target")
    batch, num_classes = logits.shape
    if isinstance(target, Tensor) and target.dim() == 0 or type(target).__module__ == "numpy" and hasattr(target, "tolist"):
        target = target.tolist()  # a 0-d tensor, a NumPy scalar or array: the Python value(s) it holds
    if target is None:
        classes = logits.detach().argmax(dim=1)
        description = "predicted"
    elif isinstance(target, (int, str)) and not isinstance(target, bool):
        classes = torch.full((batch,), _index(target, num_classes, label_names), dtype=torch.long)
        description = str(target)
    else:
        if isinstance(target, Tensor) and (target.is_floating_point() or target.is_complex() or target.dim() > 1):
            raise TargetError(
                f"a target tensor must be a (B,) tensor of integer class indices, got {target.dtype} of shape "
                f"{tuple(target.shape)}; pass target.long() if the values are whole class indices"
            )
        if isinstance(target, (str, bytes)) or not isinstance(target, (Sequence, Tensor)):
            raise TargetError(
                f"target must be None, a class index, a label name, one of those per image, or a callable "
                f"score(outputs) -> (B,); got {type(target).__name__} {target!r}"
            )
        values = target.tolist() if isinstance(target, Tensor) else [_held_integer(v) for v in target]
        if len(values) != batch:
            raise TargetError(f"got {len(values)} targets for a batch of {batch} images; pass one per image")
        classes = torch.tensor([_index(v, num_classes, label_names) for v in values], dtype=torch.long)
        description = "per-image"
    classes = classes.to(logits.device)
    return Target(classes, class_score(classes), description)


def _batch_size(outputs: Any) -> int:
    try:
        return int(logits_of(outputs).shape[0])
    except TargetError:
        first = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        return int(first.shape[0])


def given_token_ids(caption: Any, batch: int, encode: Callable[[str], list[int]], *, vocab: Optional[int],
                    forbidden: Sequence[int] = ()) -> list[list[int]]:
    """The token ids of given captions (a captioner's, or a vision-language model's answer words), one list per image.

    Args:
        caption: one caption for every image or one per image; each a string (``encode``-d) or token ids (a list,
            a tensor or an array; one flat sequence of ids is one caption for every image).
        batch: the number of images B.
        encode: text -> token ids (may raise a :class:`UsageError` for words the tokenizer does not know).
        vocab: the vocabulary size (None: unknown), ids must be below it.
        forbidden: ids that are never caption words (the tokens standing for the image).

    Raises:
        UsageError: not one caption or one per image, an empty caption, or ids outside the vocabulary (or forbidden).
    """
    if not isinstance(caption, str) and hasattr(caption, "tolist"):  # a tensor or array of token ids
        caption = caption.tolist()
        caption = [caption] if isinstance(caption, int) else caption
    if isinstance(caption, str):
        items: list[Any] = [caption] * batch
    elif isinstance(caption, (Mapping, set, frozenset)):  # (a dict was read as its keys: "got 1 captions for 2 images")
        raise UsageError(f"caption must be text, a list of texts (one per image) or token ids; got "
                         f"{type(caption).__name__} {reprlib.repr(caption)}, which holds no caption in order: pass e.g. "
                         "caption='a red circle', caption=['a red circle', 'a blue square'] or caption=[5, 6, 7]")
    else:
        try:
            items = list(caption)
        except TypeError:
            raise UsageError(f"caption must be a string or a list (token ids, or one caption per image), got "
                             f"{type(caption).__name__}") from None
    if items and isinstance(_token_id(items[0]), int) and not isinstance(items[0], bool):
        items = [items] * batch
    if len(items) != batch:
        raise UsageError(f"got {len(items)} captions for {batch} images; pass one caption or one per image")
    for i, c in enumerate(items):
        if not isinstance(c, str) and not hasattr(c, "__iter__"):  # (None was a TypeError)
            raise UsageError(f"caption {i} is {type(c).__name__} {c!r}; each caption is a string or a list of token ids")
        if not isinstance(c, str) and any(isinstance(t, str) for t in c):  # words were called ids "outside the vocabulary"
            raise UsageError(f"caption {i} is a list holding words {list(c)[:5]}; pass its text as one string "
                             f"({' '.join(str(t) for t in c)[:60]!r}), or token ids")
    seqs = [encode(c) if isinstance(c, str) else [_token_id(t) for t in c] for c in items]
    for i, seq in enumerate(seqs):
        if not seq and isinstance(items[i], str) and items[i].strip():
            raise UsageError(f"caption {i} ({items[i]!r}) encodes to no token with this tokenizer; give words it "
                             "knows, or their token ids")
        if not seq:
            raise UsageError(f"caption {i} is empty; give the words to explain, or caption=None to generate")
        kinds = [t for t in seq if isinstance(t, bool) or not isinstance(t, int)]
        if kinds:  # (floats, nested lists: were called ids "outside the vocabulary", 5.0 among them)
            raise UsageError(
                f"caption {i} holds {kinds[:3]} ({type(kinds[0]).__name__}), which are not token ids: give each "
                "caption as text or as one flat list of integer ids (a float tensor of ids: ids.long(); one (B, T) "
                "tensor or array for B images)")
        bad = [t for t in seq if t < 0 or (vocab is not None and t >= vocab) or t in forbidden]
        if bad:
            raise UsageError(
                f"caption {i} holds token ids {bad[:5]} outside the vocabulary (0..{vocab - 1 if vocab else '?'})"
                f"{' or standing for the image' if forbidden else ''}; pass text, or ids the model's tokenizer produced"
                + (" (a vision-language model's generate() returns the prompt, image tokens included, before the answer: "
                   "pass only the answer, out[:, prompt_length:])" if any(t in forbidden for t in bad) else "")
            )
    return seqs


def _token_id(token: Any) -> Any:
    """A token id as a Python int (NumPy and 0-d tensor integers included); anything else as given, for the caller
    to refuse."""
    if hasattr(token, "tolist") and not isinstance(token, (list, str)):
        token = token.tolist()
    if isinstance(token, numbers.Integral) and not isinstance(token, bool):
        return int(token)
    return token
