"""The input of every method: one captured forward (and backward) of one batch.

Methods are pure functions ``fn(ctx, **options) -> maps``: they read records and
activations from ``ctx.recorder``, never touch the model's hooks, and return (B, gh, gw)
float32 maps on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from ..recording import AttentionRecord, Recorder
from ..errors import UnsupportedMethodError
from ..layout import TokenLayout
from ..targets import Target

__all__ = ["Context", "query_blocks", "readout_vector", "DEFAULT_BLOCK_BYTES"]

#: Budget for one block of recomputed probabilities (B x H x rows x N float32).
DEFAULT_BLOCK_BYTES = 32 * 2**20


@dataclass
class Context:
    """One explained batch.

    Attributes:
        adapter: the model adapter (see ``vitexplain.adapters``).
        x: (B, 3, H, W) preprocessed input, the tensor the model saw.
        outputs: the model outputs of the explained forward.
        target: the resolved target (classes and score function).
        recorder: the capture of that forward (records, activations, grads if asked).
        layout: token layout for ViTs, None for CNNs.
        method: the method being computed (for error messages).
    """

    adapter: Any
    x: Tensor
    outputs: Any
    target: Target
    recorder: Recorder
    layout: Optional[TokenLayout] = None
    method: str = ""

    @property
    def batch_size(self) -> int:
        return int(self.x.shape[0])

    def model_module(self, name: str) -> torch.nn.Module:
        """A submodule of the explained model by name."""
        return self.adapter.model.get_submodule(name)

    def score(self, outputs: Any) -> Tensor:
        """The (B,) target scores of some model outputs (same targets as the explanation)."""
        return self.target.score(outputs)

    def require_grid(self, *, rollout: bool = False) -> TokenLayout:
        """The layout, or a clear error when the method needs a single patch grid."""
        layout = self.layout
        if layout is None:
            raise UnsupportedMethodError(f"method {self.method!r} needs a ViT token layout")
        if layout.windowed and (rollout or layout.grid is None):
            alternatives = "'cdam', 'gradcam', 'integrated_gradients', 'occlusion'"
            what = "rollout across layers" if rollout else "a single patch grid"
            raise UnsupportedMethodError(
                f"method {self.method!r} needs {what}, but this model uses windowed "
                f"attention (Swin-style); use gradient-on-token methods instead: {alternatives}"
            )
        return layout

    def layers(self) -> list[AttentionRecord]:
        """The self-attention records of the model's blocks, input side first.

        One record per block from the last forward; a clear error when the blocks did not
        issue exactly one self-attention each or the sequence does not fit the layout.
        """
        blocks = getattr(self.adapter, "blocks", None) or []
        records = [r for r in self.recorder.records if r.kind == "self"]
        if blocks:
            by_block: list[AttentionRecord] = []
            for block in blocks:
                inside = [r for r in records if r.name == block or r.name.startswith(block + ".")]
                if not inside:
                    raise UnsupportedMethodError(
                        f"block {block!r} issued no attention call during the forward; "
                        f"method {self.method!r} needs one per block"
                    )
                by_block.append(inside[-1])
            records = by_block
        layout = self.require_grid(rollout=True)
        for record in records:
            layout.check(record.num_keys)
        return records


def query_blocks(record: AttentionRecord, block_bytes: int = DEFAULT_BLOCK_BYTES) -> Iterator[slice]:
    """Slices of query rows such that one block of probabilities fits ``block_bytes``."""
    per_row = max(1, record.batch_size * record.num_heads * record.num_keys * 4)
    rows = max(1, min(record.num_queries, block_bytes // per_row))
    for start in range(0, record.num_queries, rows):
        yield slice(start, min(start + rows, record.num_queries))


def readout_vector(layout: TokenLayout, batch: int, device: torch.device) -> Tensor:
    """The query row(s) the classifier reads, as a (B, N) weight vector.

    ``"class"``: one-hot at the class token. ``"mean"`` (average pooling): uniform over the
    patch tokens, so a map is the mean over those queries of what they attend to.
    """
    vector = torch.zeros(batch, layout.num_tokens, device=device)
    if layout.readout == "class" and layout.class_index is not None:
        vector[:, layout.class_index] = 1.0
    else:
        vector[:, layout.patch_slice] = 1.0 / layout.num_patches
    return vector


RowFn = Callable[[AttentionRecord, slice], Tensor]
"""Computes (B, rows, N) fused rows of one layer's matrix for a slice of query rows."""
