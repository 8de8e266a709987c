"""The front door: model -> adapter -> capture -> method -> :class:`Explanation`.

Example::

    ex = vx.Explainer(model)
    e = ex.explain(x, method="cdam")                   # x: (B, 3, H, W) preprocessed
    e.maps                                             # (B, gh, gw) float32
    es = ex.explain(["a.jpg", "b.png"], method=["rollout", "generic"])   # images: preprocessed for you

Several methods in one call share one forward and (when any needs it) one backward pass.
The model is never modified: no eval()/train() switch, no eager attention, no hooks left.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from numbers import Integral
from typing import Any, Callable, Iterator, Optional, Sequence, Union, overload

import torch
from torch import Tensor, nn

from .adapters import Adapter, adapter_for, preprocessing
from .checks import (buffers_kept, check_batch, check_finite_maps, check_finite_scores, check_gradients_allowed,
                     check_patch_dropout, check_tensor_input, checked_score, input_channels, model_device, model_dtype,
                     warn_training)
from .errors import InputError, UnsupportedMethodError, UnsupportedModelError, UsageError
from .methods.families import Family
from .methods.grad_layout import contiguous_norm_grads
from .plan import MethodArg, Plan, UnusedTargetWarning, applicable, make_plan, split_options
from .recording import capture, hooks_paused
from .recording.materialize import check_mode
from .results import CaptionExplanation, Explanation
from .captioner import explain_captioner
from .sizes import run_sized
from .targets import TargetSpec, logits_of, resolve

__all__ = ["Explainer", "Explanation", "CaptionExplanation"]

class Explainer:
    """Explains a model's decisions with any registered method.

    What runs is decided by one plan (:meth:`plan`, :mod:`vitexplain.plan`): the family's
    defaults when no method is named, the registry and the adapter's capabilities for whether
    a method applies (and why not), the declared options, and what the capture records.

    Args:
        model: a ViT (timm, torchvision, Hugging Face), a CNN, a zoo model, a captioner, or a
            vision-language model (LLaVA, ...; give its ``processor``).
        adapter: override the automatically chosen adapter.
        processor: a vision-language model's processor (tokenizer + image processor); default: the
            model's ``vx_processor`` where it carries one (the zoo's ``shapes-vlm``), as ``explore`` does. For a
            Hugging Face captioner, its image processor (or a processor holding one): images are preprocessed as
            it does (a VisionEncoderDecoder's images need it: its statistics depend on how it was trained); a
            processor that also holds a tokenizer (``TrOCRProcessor``) gives it too, unless ``tokenizer=`` is given.
        processor_kwargs: extra keyword arguments for every call of ``processor`` (e.g. Gemma 3's
            ``{"do_pan_and_scan": True}``); the maps follow the geometry they give.
        tokenizer: an encoder-decoder captioner's tokenizer (or a processor holding one, such as
            ``BlipProcessor``): encodes text captions and names the words (default: the model's
            ``vx_tokenizer`` where it carries one, as ``vitexplain caption --model DIR`` loads it; without
            either, a Hugging Face captioner's words are its token ids).
        attention_mode: how the capture gets attention probabilities (see ``vx.capture``).
            ``"auto"`` (default): when a requested method reads every layer's attention
            without gradients (rollout) and the model runs on a CPU, attention is computed
            once by the capture (while the probabilities kept stay small); otherwise the
            fused kernel runs and methods recompute the rows they read.
            ``"fused"`` or ``"materialize"`` force one way.
    """

    def __init__(self, model: nn.Module, *, adapter: Optional[Adapter] = None, attention_mode: str = "auto",
                 processor: Any = None, processor_kwargs: Optional[dict[str, Any]] = None, tokenizer: Any = None) -> None:
        self.model = model
        if adapter is not None and not isinstance(adapter, Adapter):  # (an int was an AttributeError later)
            raise UsageError(f"adapter= must be a vitexplain Adapter (see vitexplain.adapters), got "
                             f"{type(adapter).__name__}; leave it out to choose one from the model")
        # a torch.compile-d model is explained through its original module, run eagerly
        # (see vx.capture); the compiled code is neither called nor recompiled
        self.adapter = adapter or adapter_for(model)
        self.attention_mode = check_mode(attention_mode)
        if processor is None and hasattr(self.adapter, "with_processor"):
            processor = getattr(model, "vx_processor", None)  # (a zoo VLM carries its processor)
        if processor is not None and hasattr(self.adapter, "with_image_processor"):  # a Hugging Face captioner's
            if processor_kwargs:
                raise UsageError("processor_kwargs= is for a vision-language model's processor; a captioner's image "
                                 "processor is read as it is configured")
            self.adapter = self.adapter.with_image_processor(processor)
            if tokenizer is None and getattr(processor, "tokenizer", None) is not None:
                tokenizer = processor.tokenizer  # (a TrOCRProcessor / BlipProcessor: its own tokenizer, unless given)
        elif processor is not None:
            if not hasattr(self.adapter, "with_processor"):
                raise UsageError(f"processor= is for vision-language models and Hugging Face captioners; "
                                 f"{type(model).__name__} is a {self.family.name} model and takes preprocessed images")
            self.adapter = self.adapter.with_processor(processor, processor_kwargs)
        elif processor_kwargs:
            raise UsageError("processor_kwargs= needs processor= (the vision-language model's processor)")
        if tokenizer is None and self.family.name == "caption":
            tokenizer = getattr(model, "vx_tokenizer", None)  # (a captioner loaded from a model folder carries it)
        if tokenizer is not None:
            self.adapter = _with_tokenizer(self.adapter, tokenizer)

    @property
    def family(self) -> Family:
        """The model's family (``ex.family.name``: ``"vit"``, ``"swin"``, ``"cnn"``, ``"caption"``, ...)."""
        return self.adapter.family

    def plan(self, method: MethodArg = None, **options: Any) -> Plan:
        """What explaining this model with ``method`` runs, or a clear error saying why not.

        Args:
            method: a method name, a list of names, or None for the family's default methods
                (those that apply to this model).
            **options: options of a single named method (``discard_ratio=0.9``), or per
                method as ``name={...}``.

        Returns:
            The :class:`~vitexplain.plan.Plan`: ``plan.names``, ``plan.steps`` (checked
            options), ``plan.capture``, ``plan.available``, ``plan.refused`` (why not).

        Raises:
            UnsupportedMethodError: a named method does not apply (the message says why).
            OptionError: bad options.
        """
        method, per_method = split_options(method, options)
        return make_plan(self.adapter, method, per_method, attention_mode=self.attention_mode)

    def methods(self) -> list[str]:
        """Names of the methods that apply to this model (what ``plan()`` lists as available)."""
        return list(applicable(self.adapter)[0])

    def default_method(self) -> str:
        """The method ``explain``/``explain_caption`` run when none is named: the first of the
        family's defaults that applies to this model."""
        return self.plan().names[0]

    def __repr__(self) -> str:
        return f"Explainer({type(self.model).__name__}, family={self.family.name!r})"

    # -- inputs -----------------------------------------------------------------------
    def preprocess(self, images: Any, *, crop: bool = True) -> tuple[Tensor, list[Any], list[Any], list[Any]]:
        """Load and preprocess images with the model's own preprocessing.

        Args:
            images: a path, an image file's bytes, a PIL image, an (H, W, 3) uint8 array, or a list (or
                generator) of those (or an (N, H, W, 3) uint8 array of N images).
            crop: resize and center-crop as the model's eval transform does (True), or
                resize the whole image to the input size (False).

        Returns:
            (x (B, 3, H, W) on the model's device, in its floating-point dtype, the uint8 RGB regions the model saw,
            crop boxes in original pixel coordinates, the sources as given).
        """
        from .data.arrays import as_rgb
        from .data.images import load_image, preprocess, seen_region

        if not isinstance(crop, bool):  # ("no" was truthy: the images were cropped)
            raise UsageError(f"crop must be True or False, got {type(crop).__name__} {crop!r}")
        unknown = getattr(self.adapter, "unknown_pixels", None)  # (statistics that would be a guess: refused)
        why = unknown() if unknown is not None else None
        if why:
            raise UsageError(why)
        if getattr(images, "ndim", None) == 4 and not isinstance(images, Tensor):  # (N, H, W, 3) uint8 array
            images = list(images)
        items = list(images) if isinstance(images, (list, tuple, Iterator)) else [images]  # a generator: its images
        if not items:  # (said "preprocess got no images")
            raise UsageError("no images to explain: pass a path, a PIL image, an (H, W, 3) uint8 array, a list of them, "
                             "or a preprocessed (B, 3, H, W) tensor")
        sources, arrays = [], []
        for item in items:
            is_path = isinstance(item, (str, os.PathLike))
            encoded = isinstance(item, (bytes, bytearray, memoryview))  # an image file's bytes, as load_image takes
            sources.append(item if is_path else None)
            arrays.append(load_image(item) if is_path or encoded else as_rgb(item, "each image"))
        x, boxes = preprocess(arrays, crop=crop, **preprocessing(self.adapter))
        size = tuple(x.shape[-2:])
        regions = [seen_region(a, b, size) for a, b in zip(arrays, boxes)]
        dtype = model_dtype(self.model)  # a float64/half model takes its own dtype (preprocess gives float32)
        return x.to(device=model_device(self.model), dtype=dtype or x.dtype), regions, boxes, sources

    # -- explaining ---------------------------------------------------------------------
    @overload
    def explain(self, images: Any, method: Optional[str] = None, target: TargetSpec = None, **options: Any) -> Explanation: ...

    @overload
    def explain(self, images: Any, method: Sequence[str], target: TargetSpec = None, **options: Any) -> list[Explanation]: ...

    def explain(
        self,
        images: Any,
        method: MethodArg = None,
        target: TargetSpec = None,
        **options: Any,
    ) -> Union[Explanation, list[Explanation]]:
        """Explain a batch with one or several methods (one shared forward/backward).

        Args:
            images: (B, 3, H, W) preprocessed tensor, or images (paths, PIL, uint8 arrays, or a
                list of them), which are loaded and preprocessed with the model's settings.
            method: a method name, a list of names (see :meth:`methods`), or None for the
                family's default (:meth:`default_method`).
            target: None (top prediction per image), an int, a label name, one per image
                (list/tensor), or a callable ``score(outputs) -> (B,)``. Class-agnostic methods
                (raw, rollout, the CNN gates) do not read it: a class given to them alone is warned
                about (it only labels the result).
            **options: method options for a single method (e.g. ``discard_ratio=0.9``); for
                several methods, ``name={...}`` per method (e.g. ``rollout={"head_fusion": "max"}``).

        Returns:
            An :class:`Explanation` for a single method (a name, or None), a list for a list of names.

        Raises:
            UnsupportedMethodError: a method does not apply to this model (or the model is a
                captioner: use :meth:`explain_caption`).
            InputError, TargetError, OptionError: bad images, target or options.
            NumericalError: the model's outputs or a map are not finite.
        """
        plan = self._plan_for("explain", method, options)
        x, images_seen, boxes, sources = self._inputs(images)
        model = self.adapter.model
        check_patch_dropout(model)
        warn_training(model, stacklevel=3)
        unused = plan.unused_target(target)
        if unused is not None:
            warnings.warn(unused, UnusedTargetWarning, stacklevel=3)
        with buffers_kept(model):  # a training-mode forward updates batch-norm statistics: put them back
            return self._explain_batch(plan, x, target, images_seen, boxes, sources)

    def _explain_batch(self, plan: Plan, x: Tensor, target: TargetSpec, images_seen: Any, boxes: Any, sources: Any
                       ) -> Union[Explanation, list[Explanation]]:
        """:meth:`explain` on the checked (B, 3, H, W) input ``x``: one forward (and backward), then each step."""
        model = self.adapter.model
        settings = plan.capture
        # a method with forward rules (LRP) alone in the call: the forward runs under its rules
        alone = plan.steps[0].spec if len(plan.steps) == 1 and plan.steps[0].spec.forward_rules else None
        rules = alone.forward_rules(plan.steps[0].options, model) if alone else contextlib.nullcontext()
        grads = settings.grads or alone is not None
        check_gradients_allowed(plan.names if grads else (), "explain")
        x_in = x.detach()
        if grads:
            x_in.requires_grad_(True)
        # BatchNorm hands its backward a contiguous gradient (PyTorch's eval batch_norm backward is wrong for a
        # channels-last gradient of a contiguous input, e.g. one image's tokens: methods/grad_layout.py)
        norms = contiguous_norm_grads(model) if settings.grads else contextlib.nullcontext()
        with torch.set_grad_enabled(grads), capture(model, **settings.capture_kwargs()) as rec:
            with rules, norms:
                outputs = self._forward(x_in)
        resolved = resolve(target, outputs, self.adapter.label_names, has_head=self.adapter.has_head)
        with torch.set_grad_enabled(grads), rules:
            score = resolved.score(outputs)
        check_finite_scores(score, outputs)
        shared = (rules, score) if alone else None
        if settings.grads:
            with torch.enable_grad():  # also under the caller's torch.no_grad()
                rec.backward(checked_score(score), retain_graph=settings.retain_graph)
        layout = self.adapter.layout(tuple(x.shape[-2:])) if hasattr(self.adapter, "layout") else None
        try:
            logits = logits_of(outputs).detach()
        except Exception:
            logits = outputs
        results = []
        for step in plan.steps:
            ctx = plan.family.context(self.adapter, x_in, outputs, resolved, rec, layout, method=step.name)
            if shared is not None:
                ctx.shared = shared
            # a method's own pass over the graph (LeGrad) adds nothing to the records; one taking gradients
            # takes them also under the caller's torch.no_grad()
            with hooks_paused(), torch.set_grad_enabled(grads or torch.is_grad_enabled()):
                maps = step.spec.fn(ctx, **step.options)
            extras: dict[str, Any] = {}
            if isinstance(maps, tuple):  # a method may return (maps, extras)
                maps, extras = maps
            results.append(
                plan.family.result(
                    maps=check_finite_maps(maps.detach().float(), step.name),
                    targets=resolved.classes.detach(),
                    method=step.name,
                    options=dict(step.options),
                    logits=logits,
                    signed=step.spec.signed,
                    input_size=(int(x.shape[-2]), int(x.shape[-1])),
                    layout=layout.for_map(tuple(maps.shape[-2:]), tuple(x.shape[-2:])) if layout is not None else None,
                    images=images_seen,
                    sources=sources,
                    label_names=self.adapter.label_names,
                    boxes=boxes,
                    extras=extras,
                    score_name=resolved.description if resolved.custom else None,
                )
            )
        rec.clear()  # (the attention it holds goes now: the next batch's capture reuses its buffers, workspace.py)
        return results[0] if plan.single else results

    @overload
    def explain_caption(self, images: Any, method: Optional[str] = None, caption: Union[None, str, Sequence[Any]] = None,
                        *, prompt: Union[None, str, Sequence[str]] = None, max_len: int = 16, **options: Any) -> CaptionExplanation: ...

    @overload
    def explain_caption(self, images: Any, method: Sequence[str], caption: Union[None, str, Sequence[Any]] = None,
                        *, prompt: Union[None, str, Sequence[str]] = None, max_len: int = 16, **options: Any) -> list[CaptionExplanation]: ...

    def explain_caption(
        self,
        images: Any,
        method: MethodArg = None,
        caption: Union[None, str, Sequence[Any]] = None,
        *,
        prompt: Union[None, str, Sequence[str]] = None,
        max_len: int = 16,
        **options: Any,
    ) -> Union[CaptionExplanation, list[CaptionExplanation]]:
        """Per-word maps of a captioner: what in the image made it say each word.

        Args:
            images: (B, 3, H, W) preprocessed tensor, or images/paths (preprocessed for you).
            method: ``"cross"`` (cross-attention per word) or ``"cross_generic"`` (Chefer's
                encoder-decoder relevance, gradient of each word's log-probability); a list;
                or None for the family's default.
            caption: None to generate greedily (with the model's KV cache; the steps are
                stitched into one map per word), or the caption(s) to explain teacher-forced:
                one string for all images, one per image, or token-id lists (``e.ids``, or what
                ``model.generate`` returns: a caption ends at its end token; a leading start token
                is dropped where it is also the end token, GPT-2 and TrOCR; elsewhere it stays a word, with
                a warning: pass ``generate(...)[:, 1:]``).
            prompt: vision-language models only: the prompt (one, or one per image; the image
                token is put in front unless the prompt has it). A question plus
                ``caption=`` answer words explains visual question answering.
            max_len: most tokens to generate.
            **options: method options (single method), or ``name={...}`` per method.
                ``cross`` takes ``layers`` (None = mean over all decoder layers, an index or
                a list) and ``head_fusion``.

        Returns:
            A :class:`CaptionExplanation` (or a list, one per method).
        """
        plan = self._plan_for("explain_caption", method, options)
        if not isinstance(max_len, Integral) or isinstance(max_len, bool) or max_len < 1:
            raise UsageError(f"max_len must be a positive number of tokens to generate, got {max_len!r}")
        max_len = int(max_len)  # (a NumPy integer is a count too)
        if hasattr(self.adapter, "lm_records"):  # a vision-language model
            from .vlm import explain_vlm

            vlm_results = explain_vlm(self.adapter, plan, images, caption, prompt, max_len)
            return vlm_results[0] if plan.single else vlm_results
        if prompt is not None:
            raise UsageError(f"prompt= is for vision-language models; {type(self.model).__name__} captions without one")
        x, regions, boxes, sources = self._inputs(images)
        check_patch_dropout(self.adapter.model)
        warn_training(self.adapter.model, stacklevel=3)
        with buffers_kept(self.adapter.model):  # a training-mode forward updates batch-norm statistics: put them back
            results = explain_captioner(self.adapter, plan, x, regions, sources, caption, max_len, self.attention_mode,
                                        boxes)
        return results[0] if plan.single else results

    def _plan_for(self, entry: str, method: MethodArg, options: dict[str, Any]) -> Plan:
        """The plan of an ``explain``/``explain_caption`` call: ``method`` None is the family's
        default method (one result); the call must be the family's entry point."""
        if self.family.entry != entry:
            raise UnsupportedMethodError(
                f"{type(self.model).__name__} is a {self.family.name} model ({self.family.summary}): "
                f"use Explainer.{self.family.entry}(images, method=...) with one of {self.methods()}"
            )
        if method is None:
            method = self.default_method()
        return self.plan(method, **options)

    def _inputs(self, images: Any) -> tuple[Tensor, Any, Any, Any]:
        """The model input for ``images`` (checked, on the model's device) and, when images were
        given, the regions the model saw, their crop boxes and sources.

        Raises:
            UnsupportedModelError: the model's weights are on the meta device (no values).
        """
        device = model_device(self.model)
        if device.type == "meta":
            raise UnsupportedModelError(
                f"{type(self.model).__name__}'s weights are on the meta device: they have shapes but no values, so "
                "nothing can be computed or explained; load real weights first (e.g. model.to_empty(device='cpu') then "
                "model.load_state_dict(...), or build the model outside torch.device('meta'))"
            )
        # (the preprocessing settings are read only when the model itself does not say its channels)
        channels = input_channels(self.adapter.model, lambda: preprocessing(self.adapter))
        if isinstance(images, Tensor):
            x = check_tensor_input(images, channels, model_dtype(self.model), device)
            return x, None, None, None
        x, regions, boxes, sources = self.preprocess(images)
        check_batch(x)
        if x.shape[1] != channels:
            raise InputError(
                f"the model takes {channels}-channel input, but images are preprocessed to {x.shape[1]} channels "
                f"(RGB); pass a preprocessed (B, {channels}, H, W) float tensor instead"
            )
        return x, regions, boxes, sources

    def _forward(self, x: Tensor) -> Any:
        """The adapter's forward, its size refusals translated (:meth:`_sized`)."""
        return self._sized(x, lambda: self.adapter.forward(x))

    def _sized(self, x: Tensor, run: Callable[[], Any]) -> Any:
        """``run()``, a call of the model on ``x``, its refusals of the input size made an :class:`InputError`
        that says what to do (:func:`vitexplain.sizes.run_sized`)."""
        return run_sized(self.adapter, x, run)


def _with_tokenizer(adapter: Adapter, tokenizer: Any) -> Adapter:
    """A copy of a captioner's adapter that encodes and names words with ``tokenizer`` (a processor's own one).

    Raises:
        UsageError: the model is not an encoder-decoder captioner, or ``tokenizer`` cannot encode text.
    """
    from .adapters.captioning import CaptionAdapter

    if not isinstance(adapter, CaptionAdapter):
        raise UsageError(f"tokenizer= is for captioners; a {adapter.family.name} model takes none"
                         + (" (give a vision-language model its processor=)" if adapter.family.name == "vlm" else ""))
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise UsageError(f"tokenizer= must be a Hugging Face tokenizer (callable, with decode()), or a processor "
                         f"holding one; got {type(tokenizer).__name__}")
    adapter = copy.copy(adapter)
    adapter.tokenizer = tokenizer
    return adapter
