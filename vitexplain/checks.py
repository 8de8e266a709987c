"""Checks of what goes into and comes out of an explanation, shared by the API and the CLI.

Inputs: a preprocessed batch must be a finite (B, C, H, W) float tensor with the model's
channels and dtype. Outputs: the target scores and every map must be finite; a NaN map is
never returned (:class:`~vitexplain.errors.NumericalError` names the images). A gradient
target must depend on the model's outputs.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from .errors import InputError, NumericalError, TargetError, UnsupportedModelError, UsageError
from .finite import all_finite

__all__ = ["channels_of", "input_channels", "check_batch", "check_tensor_input", "check_finite_scores", "check_finite_maps",
           "check_not_underflowed", "checked_score", "differentiable",
           "model_dtype", "model_device", "any_training", "training_layers", "warn_training", "buffers_kept"]


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); CPU for a model without either."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)  # the first one only
    return first.device if first is not None else torch.device("cpu")


def model_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype of the model's first floating-point parameter, or None."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _rows(mask: Tensor) -> str:
    bad = [int(i) for i in mask.nonzero().flatten()]
    return f"{bad[:10]}{'...' if len(bad) > 10 else ''}"


def check_batch(x: Tensor) -> None:
    """Reject an empty batch or non-finite pixels: both would give maps that mean nothing.

    Raises:
        InputError: the batch is empty or holds NaN / inf values.
    """
    if x.shape[0] == 0:
        raise InputError("the batch is empty (0 images); pass at least one image")
    if all_finite(x):
        return
    bad = (~torch.isfinite(x.detach())).flatten(1).any(dim=1)
    raise InputError(
        f"the input holds NaN or infinite values (images {_rows(bad)}); "
        "explanations of such inputs mean nothing: check the preprocessing or the images"
    )


def check_tensor_input(x: Tensor, channels: int, dtype: Optional[torch.dtype], device: torch.device) -> Tensor:
    """A preprocessed batch, checked, on the model's device.

    Args:
        x: what the user passed as a tensor.
        channels: the number of channels the model takes.
        dtype: the model's floating-point dtype (None: not checked).
        device: the model's device.

    Returns:
        ``x`` (detached) on ``device``.

    Raises:
        InputError: not a (B, C, H, W) floating-point tensor, channels-last or a wrong
            channel count, a dtype other than the model's, empty, or non-finite.
    """
    shape = tuple(x.shape)
    if not x.is_floating_point():
        raise InputError(
            f"expected a preprocessed (B, {channels}, H, W) float tensor, got a {x.dtype} tensor of shape {shape}; "
            "pass images as uint8 (H, W, 3) arrays or paths instead, and they are preprocessed for you"
        )
    if x.dim() == 3 and shape[0] == channels:
        raise InputError(f"expected a batch (B, {channels}, H, W), got one image of shape {shape}; pass x[None]")
    if x.dim() != 4:
        raise InputError(f"expected a preprocessed (B, {channels}, H, W) float tensor, got shape {shape}")
    if shape[1] != channels:
        hint = (" (channels-last? pass x.permute(0, 3, 1, 2))" if shape[-1] == channels else
                " (grayscale? repeat it to 3 channels: x.expand(-1, 3, -1, -1))" if shape[1] == 1 else "")
        raise InputError(f"the model takes {channels} channels, the input has shape {shape}{hint}")
    if dtype is not None and x.dtype != dtype:
        raise InputError(
            f"the input is {x.dtype} but the model's weights are {dtype}: pass x.to({dtype}) (or convert the model "
            "with model.to(dtype))"
        )
    check_batch(x)
    return x.detach().to(device)


def checked_score(score: Tensor) -> Tensor:
    """A target score a gradient can be taken of.

    Raises:
        TargetError: the score does not depend on the model's outputs (detached).
    """
    if not score.requires_grad:
        raise TargetError(
            "the target score does not depend on the model's outputs (it is detached: .detach(), .item(), "
            "numpy or torch.no_grad() cut the gradient), so no gradient method can explain it; return a "
            "differentiable function of the outputs"
        )
    return score


def differentiable(score: Tensor) -> Tensor:
    """``score``, checked by :func:`checked_score` when gradients are enabled (it is about to be
    differentiated); unchecked otherwise (a forward-only method such as occlusion takes any score)."""
    return checked_score(score) if torch.is_grad_enabled() else score


def check_finite_scores(score: Tensor, outputs: Any = None) -> None:
    """Raise when a target score (B,) holds NaN or inf.

    Args:
        score: the explained scores.
        outputs: the model outputs they were computed from (to tell a model whose outputs are
            not finite from a target function that returns NaN/inf).

    Raises:
        NumericalError: the images whose score is not finite, and what to check.
    """
    if all_finite(score):
        return
    bad = ~torch.isfinite(score.detach())
    if isinstance(outputs, Tensor) and all_finite(outputs):
        raise NumericalError(
            f"the target score is NaN or inf for images {_rows(bad)} although the model's outputs are finite: "
            "check the target function's arithmetic (a division by zero, log of 0, ...)"
        )
    raise NumericalError(
        f"the model's outputs are not finite (NaN or inf) for images {_rows(bad)}, so no map would mean anything: "
        "check the input's scale (preprocessed images are about -3..3; an input that makes activations overflow "
        "gives inf) and the model's weights"
    )


def check_finite_maps(maps: Tensor, method: str) -> Tensor:
    """``maps`` when every value is finite.

    Raises:
        NumericalError: the images whose map holds NaN or inf.
    """
    if all_finite(maps):
        return maps
    bad = ~torch.isfinite(maps.detach()).flatten(1).all(dim=1) if maps.dim() > 1 else ~torch.isfinite(maps)
    raise NumericalError(
        f"method {method!r} broke down numerically: its maps hold NaN or inf for images {_rows(bad)} (e.g. "
        "gradients that overflowed); no such map is returned. Check the input's scale, or try another method"
    )


def check_not_underflowed(maps: Tensor, lengths: list[int], method: str, dtype: Optional[torch.dtype]) -> Tensor:
    """``maps`` (B, T, h, w) unless a float16 model gave an all-zero map to an image with words.

    A float16 backward flushes gradients below 6e-8 to zero (a model whose gradients are that small, such as a
    freshly initialised one, gets all-zero gradient maps); bfloat16 has float32's range.

    Raises:
        NumericalError: the images whose maps are all zero in a float16 model.
    """
    if dtype != torch.float16:
        return maps
    flat = maps.detach().flatten(2)
    empty = torch.tensor([n > 0 and not bool(flat[i, :n].any()) for i, n in enumerate(lengths)])
    if bool(empty.any()):
        raise NumericalError(
            f"method {method!r} gave all-zero maps for images {_rows(empty)} of this float16 model: its gradients "
            "are smaller than float16's smallest number (6e-8) and underflowed to zero; no such map is returned. "
            "Run the model in float32 or bfloat16 (model.float() or model.bfloat16()), or use a method without "
            "gradients ('cross')"
        )
    return maps


def channels_of(preprocess_kwargs: dict[str, Any]) -> int:
    """The number of channels of the model input (from its normalisation mean), 3 by default."""
    mean = preprocess_kwargs.get("mean")
    return len(mean) if isinstance(mean, (tuple, list)) and mean else 3


def input_channels(model: nn.Module, preprocess_kwargs: Union[dict[str, Any], Callable[[], dict[str, Any]]]) -> int:
    """The number of channels the model takes: timm's ``in_chans`` where the model keeps it (a model whose
    first registered convolution does not read the image, as CSATv2's 1 x 1 convs over its 64 DCT
    coefficients, says so there), else the input channels of its first 2-D convolution (the patch embedding
    or stem; timm's ``in_chans`` and Hugging Face's ``num_channels`` set it, while their normalisation
    settings keep three values), else :func:`channels_of` of ``preprocess_kwargs`` (the settings, or a function
    giving them: called only then)."""
    declared = getattr(model, "in_chans", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        return declared
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is not None:
        return int(first.in_channels)
    return channels_of(preprocess_kwargs() if callable(preprocess_kwargs) else preprocess_kwargs)


def check_gradients_allowed(methods: Any, entry: str) -> None:
    """Refuse methods that take gradients inside ``torch.inference_mode()`` (which cannot be switched off inside it;
    ``torch.no_grad()`` can, and vitexplain enables gradients where its methods need them).

    Args:
        methods: the names of the methods that take gradients (nothing to check when empty).
        entry: the call, for the message (``"explain"``, ``"explain_caption"``).

    Raises:
        UsageError: gradients are needed and inference mode is on.
    """
    if methods and torch.is_inference_mode_enabled():
        raise UsageError(
            f"{', '.join(methods)} take(s) gradients, which torch.inference_mode() forbids (it cannot be switched off "
            f"inside); call {entry} outside inference_mode (torch.no_grad() is fine: vitexplain enables gradients "
            "where its methods need them)")


def check_patch_dropout(model: nn.Module) -> None:
    """Refuse a model that drops patch tokens at random in training mode (timm's and OpenCLIP's ``PatchDropout``):
    its attention covers a random subset of the patches, which no map over the image can place.

    Raises:
        UnsupportedModelError: a ``PatchDropout`` module with ``prob > 0`` is in training mode.
    """
    if not any_training(model):
        return
    for name, module in model.named_modules():  # (also one in training mode inside a model in eval mode)
        if type(module).__name__ == "PatchDropout" and module.training and float(getattr(module, "prob", 0.0) or 0.0) > 0:
            raise UnsupportedModelError(
                f"{name} drops {float(module.prob):.0%} of the patch tokens at random (patch dropout, training mode), "
                "so the attention covers patches no map can place; call model.eval() first")


def any_training(model: nn.Module) -> bool:
    """Whether ``model`` or any module under it is in training mode: one walk over the ``_modules`` dicts that stops
    at the first (``named_modules()`` costs ~4x as much, on every explanation of a model in eval mode)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if module.training:
            return True
        for child in module._modules.values():
            if child is not None:
                stack.append(child)
    return False


def training_layers(model: nn.Module, *, random_only: bool = False) -> list[str]:
    """Names of the model's layers in training mode whose output depends on it: dropout, batch / instance norm,
    drop path and other ``Drop*`` layers (listed first; not those of rate 0), any module holding parameters of its
    own, and the model itself when it has no submodules (its forward may read its flag).

    Not the model's own flag: a wrapper built after ``model.eval()`` (``nn.Sequential(normalize, model)``,
    ``nn.DataParallel(model)``) is in training mode itself while every layer it runs is not, and a model in eval
    mode may hold a layer switched back to training (a BatchNorm, Monte Carlo dropout). A container without
    parameters of its own in training mode (the wrapper) changes nothing.

    Args:
        random_only: only the dropout, norm and drop-path layers (those that make two forwards differ).
    """
    if not any_training(model):
        return []
    stochastic, others = [], []
    alone = next(model.children(), None) is None
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not module.training:
            continue
        if isinstance(module, _TRAINING_KINDS) or "Drop" in kind or "StochasticDepth" in kind:
            rate = getattr(module, "p", getattr(module, "drop_prob", None))
            if not (isinstance(rate, (int, float)) and rate == 0):  # (a dropout of rate 0 is the identity)
                stochastic.append(name or kind)
        elif next(module.parameters(recurse=False), None) is not None or (module is model and alone):
            others.append(name or kind)
    return stochastic if random_only else stochastic + others


_TRAINING_KINDS = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def warn_training(model: nn.Module, stacklevel: int) -> None:
    """Warn that explanations of ``model`` in training mode are random (dropout) and batch-dependent (batch norm).

    Args:
        stacklevel: as ``warnings.warn``'s, counted from this function (2: its caller).
    """
    layers = training_layers(model)
    if layers:
        which = "" if model.training and len(layers) > 1 else f" ({len(layers)} layer(s): {', '.join(layers[:3])}" \
            f"{', ...' if len(layers) > 3 else ''})"
        warnings.warn(
            f"the model is in training mode{which}: dropout makes explanations random (and batch norm makes each "
            "image's depend on the batch); call model.eval() first",
            stacklevel=stacklevel,
        )


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Restores the buffers of a model in training mode (or holding a module in training mode) on exit (batch-norm
    running statistics and counters, which its forwards update): the user's model is left as found."""
    training = any_training(model)  # (a BatchNorm in training mode inside a model in eval mode)
    saved = [(b, b.detach().clone()) for b in model.buffers()] if training else []
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
