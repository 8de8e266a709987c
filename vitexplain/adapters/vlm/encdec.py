"""Encoder-decoder vision-language models: the image reaches the text decoder through cross-attention.

Florence-2 (:mod:`~vitexplain.adapters.vlm.florence`) and Pix2Struct
(:mod:`~vitexplain.adapters.vlm.pix2struct`) encode the image (Florence-2: with the prompt) in an
encoder and generate the answer with a decoder that reads the encoder's tokens through
cross-attention. They are explained in the vision-language family (the model's processor, a prompt,
maps per image at its original resolution) with the same three methods, read at the decoder:

- the explained forward is one teacher-forced call with the decoder input ``prefix + answer``; the
  prefix (``L`` tokens: the decoder start token, and for Pix2Struct the prompt, left-padded) is what
  ``generate`` starts from, so decoder row ``L - 1 + t`` predicts answer word t (``answer_start``);
- the "image columns" are encoder positions (Florence-2: its image tokens among the prompt tokens;
  Pix2Struct: the non-padding patches);
- ``cross`` and ``cross_grad`` read the decoder's cross-attention (``lm_records``), ``cross_generic``
  applies Chefer's encoder-decoder rules (:func:`vitexplain.methods.vlm_encdec.encoder_decoder_generic`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..captioning import greedy_kwargs
from .base import VLMAdapter

__all__ = ["EncoderDecoderVLMAdapter"]


class EncoderDecoderVLMAdapter(VLMAdapter):
    """A vision-language encoder-decoder (subclasses say where the encoder and decoder are).

    Attributes:
        encoder_prefix: module name of the encoder whose self-attention ``cross_generic`` propagates.
        decoder_prefix: module name of the text decoder (its self- and cross-attention records).
    """

    encoder_decoder = True
    encoder_prefix: str = "encoder"
    decoder_prefix: str = "decoder"

    @property
    def decoder_start_id(self) -> int:
        start = getattr(self.model.generation_config, "decoder_start_token_id", None)
        if start is None:
            start = self.model.config.get_text_config(decoder=True).decoder_start_token_id
        return int(start)

    def decoder_prefix_ids(self, inputs: Any) -> tuple[Tensor, Tensor]:
        """(B, L) ids the decoder starts from (left-padded) and their (B, L) mask: the decoder start token,
        then the token ``generate`` forces first where the generation config forces one (BART's
        ``forced_bos_token_id``), which is no answer word."""
        device = next(self.model.parameters()).device
        batch = next(v for v in inputs.values() if isinstance(v, Tensor)).shape[0]
        prefix = [self.decoder_start_id]
        forced = getattr(self.model.generation_config, "forced_bos_token_id", None)
        if forced is not None:
            prefix.append(int(forced))
        ids = torch.tensor([prefix] * batch, dtype=torch.long, device=device)
        return ids, torch.ones_like(ids)

    def answer_start(self, inputs: Any) -> int:
        return int(self.decoder_prefix_ids(inputs)[0].shape[1])

    def generate_kwargs(self, inputs: Any) -> dict[str, Any]:
        """The keyword arguments ``model.generate`` takes for the processor's batch (the decoder prefix included)."""
        kwargs = dict(inputs)
        kwargs["decoder_input_ids"] = self.decoder_prefix_ids(inputs)[0]
        return kwargs

    def generate(self, inputs: Any, max_len: int) -> Tensor:
        ends = self.end_ids
        out = self.model.generate(**self.generate_kwargs(inputs), **greedy_kwargs(
            self.model, max_new_tokens=max_len, do_sample=False, num_beams=1, pad_token_id=self.pad_id,
            suppress_tokens=self.placeholder_ids or None, **({"eos_token_id": ends} if ends else {})))
        return out[:, self.answer_start(inputs):]

    def teacher_inputs(self, inputs: Any, ids: Tensor) -> dict[str, Any]:
        """The encoder's inputs as the processor gave them; the decoder's: prefix + answer ids (the decoder
        mask extended where the batch has one: Pix2Struct's left-padded prompts), as ``generate`` is given them."""
        kwargs = self.generate_kwargs(inputs)
        prefix, mask = self.decoder_prefix_ids(inputs)
        kwargs["decoder_input_ids"] = torch.cat([prefix, ids], dim=1)
        if "decoder_attention_mask" in kwargs:
            kwargs["decoder_attention_mask"] = torch.cat([mask, torch.ones_like(ids, dtype=mask.dtype)], dim=1)
        return kwargs

    def _under(self, records: Sequence[Any], prefix: str) -> list[Any]:
        return [r for r in records if r.name == prefix or r.name.startswith(prefix + ".")]

    def lm_records(self, records: Sequence[Any]) -> list[Any]:
        """The decoder's cross-attention calls (decoder queries over the encoder's tokens), one per layer."""
        return [r for r in self._under(records, self.decoder_prefix) if r.kind == "cross"]

    def encoder_records(self, records: Sequence[Any]) -> list[Any]:
        """The encoder's self-attention calls, in call order."""
        return [r for r in self._under(records, self.encoder_prefix) if r.kind == "self"]

    def decoder_records(self, records: Sequence[Any]) -> list[Any]:
        """The decoder's self- and cross-attention calls, in call order."""
        return self._under(records, self.decoder_prefix)
