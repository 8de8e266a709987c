"""What a capture says when its records are not all of the model's attention, or when there are none.

Attention the capture saw and no record can hold (timm's ``HaloAttn``, see ``interception.py``) is noted per
module (:meth:`~vitexplain.recording.recorder.Recorder.not_recorded`): reading the records then warns
(:class:`~vitexplain.errors.UnrecordedAttentionWarning`), or, when nothing was recorded, the
:class:`~vitexplain.errors.NoAttentionError` says what was seen.
"""

from __future__ import annotations

from typing import Mapping

from ..errors import NoAttentionError

__all__ = ["SUPPORTED", "unrecorded_note", "no_attention"]

#: What the capture records, as its errors list it.
SUPPORTED = (
    "torch.nn.functional.scaled_dot_product_attention (timm ViT/DeiT/EVA/BEiT/Swin, "
    "torchvision, Hugging Face attn_implementation='sdpa'), FlexAttention, attention modules "
    "that compute softmax(q k^T) in Python (timm fused_attn=False, Hugging Face 'eager'), "
    "nn.MultiheadAttention / nn.Transformer* layers, and modules declared with "
    "vx.capture(model, attention={name: extractor}) or vx.recording.register_attention"
)


def unrecorded_note(unrecorded: Mapping[str, str]) -> str:
    """What was seen and not recorded (module name -> why), per reason with up to four modules' names; '' for
    nothing."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in unrecorded.items():
        by_reason.setdefault(reason, []).append(name or "(the model itself)")
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        parts.append(f"the attention of {', '.join(names[:4])}{more} was seen and not recorded ({reason})")
    return "; ".join(parts)


def no_attention(model_name: str, forward_count: int, other_thread_forwards: int, unrecorded: str) -> NoAttentionError:
    """The error of a capture without records, saying why as far as the capture can tell.

    Args:
        model_name: the captured model's class name.
        forward_count: forwards of the model in the scope's thread.
        other_thread_forwards: forwards of the model in other threads during the scope.
        unrecorded: :func:`unrecorded_note` of what was seen and not recorded.
    """
    if unrecorded:
        return NoAttentionError(f"no attention of {model_name} could be recorded: {unrecorded}. Use the CNN methods "
                                "('gradcam', 'spatial', 'channel') for it")
    if forward_count == 0 and other_thread_forwards:
        return NoAttentionError(
            f"{model_name} ran inside vx.capture(...) only in another thread than the one that entered it; a capture "
            "sees the attention of its own thread only: enter vx.capture in the thread that calls the model"
        )
    if forward_count == 0:
        return NoAttentionError(
            f"no forward of {model_name} ran inside vx.capture(...): call the model inside the `with` block, e.g. "
            "`with vx.capture(model) as rec: model(x)`"
        )
    return NoAttentionError(
        f"no attention call was seen during the forward of {model_name}. vitexplain captures {SUPPORTED}. If "
        f"{model_name} is a CNN, use the CNN methods ('gradcam', 'spatial', 'channel'); if it is TorchScript, capture "
        "the original nn.Module (torch.compile-d models are handled)."
    )
