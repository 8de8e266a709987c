"""Scoped capture of attention (fused SDPA kept on), activations and their gradients."""

from .records import ActivationRecord, AttentionRecord, attention_probs
from .recorder import Recorder, capture

__all__ = ["capture", "Recorder", "AttentionRecord", "ActivationRecord", "attention_probs"]
