"""Show, Attend and Tell (Xu et al., ICML 2015): a CNN grid encoder and an LSTM decoder with additive attention.

The zoo's ``shapes-sat``. As in the paper ("soft" deterministic attention):

* the encoder gives annotation vectors ``a_i`` (B, N, D) on a (gh, gw) grid (a small CNN,
  stride 4: a 16 x 16 grid at 64 px; the paper used VGG's 14 x 14 conv5 grid at 224 px);
* the LSTM's initial memory and hidden state are predicted from the mean annotation by two
  MLPs (``init_h``, ``init_c``);
* at step t the additive attention (Bahdanau) scores every location,
  ``e_ti = v . tanh(W_a a_i + W_h h_{t-1})``, ``alpha_t = softmax(e_t)``, and the context is
  ``z_t = beta_t * sum_i alpha_ti a_i`` with the gating scalar ``beta_t = sigmoid(f_beta(h_{t-1}))``;
* the LSTM reads ``[E y_{t-1}, z_t]``; the word is predicted by the deep output layer
  ``p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))``;
* training adds the doubly stochastic attention regularisation
  ``lambda * sum_i (1 - sum_t alpha_ti)^2`` (:func:`doubly_stochastic`).

The attention module :class:`AdditiveAttention` returns ``(context, alpha)``; it is registered
with :func:`vitexplain.recording.register_attention`, so every capture records one ``cross``
record per decoding step (one query over the N grid locations) with the very ``alpha`` the
decoder used, and its gradient when gradients are captured. Word ``t`` is produced by step t,
whose attention is the one that explains it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from ..errors import UsageError
from ..layout import TokenLayout
from ..recording.custom import from_output, register_attention
from .captioner import CaptionText, Vocab

__all__ = ["GridEncoder", "AdditiveAttention", "ShowAttendTell", "doubly_stochastic"]

State = tuple[torch.Tensor, torch.Tensor]


class GridEncoder(nn.Module):
    """A small CNN whose last feature map is the grid of annotation vectors.

    3x3 conv-BN-ReLU layers with the given strides and dilations. The default, strides
    (2, 2, 1, 1, 1) and dilations (1, 1, 1, 2, 2), gives a stride-4 grid (16 x 16 at 64 px)
    with a 47 px receptive field (an object of the shapes images is 14 to 26 px wide).

    Args:
        widths: output channels of the layers; the last is the annotation size D.
        strides: stride of each layer; their product is the grid's stride.
        dilations: dilation of each layer.
    """

    def __init__(
        self,
        widths: Sequence[int] = (32, 64, 96, 96, 128),
        strides: Sequence[int] = (2, 2, 1, 1, 1),
        dilations: Sequence[int] = (1, 1, 1, 2, 2),
    ) -> None:
        super().__init__()
        if not len(widths) == len(strides) == len(dilations):
            raise UsageError("the grid encoder needs one stride and one dilation per layer")
        layers: list[nn.Module] = []
        c_in = 3
        for c_out, s, d in zip(widths, strides, dilations):
            layers += [nn.Conv2d(c_in, c_out, 3, s, d, dilation=d, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
            c_in = c_out
        self.body = nn.Sequential(*layers)
        self.embed_dim = int(widths[-1])
        self.stride = int(math.prod(strides))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> annotations (B, gh * gw, D), row-major over the grid."""
        return self.body(images).flatten(2).transpose(1, 2)

    def vx_token_layout(self, input_size: tuple[int, int]) -> TokenLayout:
        """The annotation grid as a token layout: no prefix tokens, the convolutions' output size (ceil(H / stride)
        x ceil(W / stride) with the default padding) locations of ``stride`` pixels from the top left."""
        h, w = input_size
        for conv in (m for m in self.body if isinstance(m, nn.Conv2d)):  # torch's output size of each convolution
            (kh, kw), (sh, sw), (ph, pw), (dh, dw) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
            h = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
            w = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        s = self.stride
        return TokenLayout(0, (h, w), False, "mean", patch_size=(s, s))


class AdditiveAttention(nn.Module):
    """Bahdanau attention of the decoder state over the grid: ``softmax_i(v . tanh(W_a a_i + W_h h))``.

    Args:
        feature_dim: D, size of an annotation vector.
        hidden_dim: size of the LSTM state.
        attention_dim: size of the tanh layer.
    """

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.features = nn.Linear(feature_dim, attention_dim)
        self.hidden = nn.Linear(hidden_dim, attention_dim, bias=False)
        self.v = nn.Linear(attention_dim, 1)

    def forward(self, annotations: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend once.

        Args:
            annotations: (B, N, D) grid features.
            hidden: (B, hidden_dim) previous LSTM state.

        Returns:
            ``(context, alpha)``: (B, D) weighted sum of the annotations and (B, N) weights.
        """
        scores = self.v(torch.tanh(self.features(annotations) + self.hidden(hidden)[:, None])).squeeze(-1)
        alpha = torch.softmax(scores, dim=-1)
        return torch.einsum("bn,bnd->bd", alpha, annotations), alpha


# every capture of a model using it records its weights (one "cross" record per call)
register_attention(AdditiveAttention, from_output(1, "cross"))


class ShowAttendTell(CaptionText, nn.Module):
    """Show, Attend and Tell captioner for the shapes captions.

    Args:
        words: content words of the vocabulary (specials are added in front).
        img_size: input size (square), for the preprocessing config.
        widths: encoder channels; the last is the annotation size D.
        strides: encoder strides (their product is the grid's stride).
        dilations: encoder dilations.
        embed_dim: word embedding size.
        hidden_dim: LSTM state size.
        attention_dim: size of the additive attention's tanh layer.
        dropout: dropout before the output layer (training only).
        context_dropout: dropout of the context vector where it enters the LSTM (training
            only; the output layer always sees it whole): the memory then carries an object's
            features unreliably, so each word is read from its own step's attention.
        max_len: most decoding steps.

    Attributes:
        encoder: the :class:`GridEncoder`.
        attention: the :class:`AdditiveAttention`.
        vocab: the :class:`~vitexplain.zoo.captioner.Vocab`.
    """

    def __init__(
        self,
        words: Sequence[str],
        img_size: int = 64,
        widths: Sequence[int] = (32, 64, 96, 96, 128),
        strides: Sequence[int] = (2, 2, 1, 1, 1),
        dilations: Sequence[int] = (1, 1, 1, 2, 2),
        embed_dim: int = 64,
        hidden_dim: int = 128,
        attention_dim: int = 64,
        dropout: float = 0.2,
        context_dropout: float = 0.0,
        max_len: int = 12,
    ) -> None:
        super().__init__()
        self.vocab = Vocab(words)
        self.max_len = max_len
        self.img_size = img_size
        self.encoder = GridEncoder(widths, strides, dilations)
        d = self.encoder.embed_dim
        self.init_h = nn.Linear(d, hidden_dim)
        self.init_c = nn.Linear(d, hidden_dim)
        self.attention = AdditiveAttention(d, hidden_dim, attention_dim)
        self.f_beta = nn.Linear(hidden_dim, 1)
        self.embed = nn.Embedding(len(self.vocab), embed_dim)
        self.lstm = nn.LSTMCell(embed_dim + d, hidden_dim)
        self.out_h = nn.Linear(hidden_dim, embed_dim)
        self.out_z = nn.Linear(d, embed_dim, bias=False)
        self.drop = nn.Dropout(dropout)
        self.context_drop = nn.Dropout(context_dropout)
        self.out = nn.Linear(embed_dim, len(self.vocab))

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images -> (B, N, D) annotations."""
        return self.encoder(images)

    def init_state(self, annotations: torch.Tensor) -> State:
        """(h_0, c_0) from the mean annotation, each (B, hidden_dim)."""
        mean = annotations.mean(dim=1)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))

    def step(self, token: torch.Tensor, annotations: torch.Tensor, state: State) -> tuple[torch.Tensor, State, torch.Tensor]:
        """One decoding step.

        Args:
            token: (B,) previous word ids (``<bos>`` first).
            annotations: (B, N, D).
            state: (h, c) of the previous step.

        Returns:
            ``(logits (B, V), new state, alpha (B, N))``.
        """
        h, c = state
        context, alpha = self.attention(annotations, h)
        z = torch.sigmoid(self.f_beta(h)) * context
        e = self.embed(token)
        h, c = self.lstm(torch.cat([e, self.context_drop(z)], dim=-1), (h, c))
        logits = self.out(self.drop(e + self.out_h(h) + self.out_z(z)))
        return logits, (h, c), alpha

    def run_decoder(self, annotations: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced decoding.

        Args:
            annotations: (B, N, D).
            tokens: (B, T) input ids starting with ``<bos>``.

        Returns:
            ``(logits (B, T, V), alphas (B, T, N))``; row t predicts token t + 1.
        """
        state = self.init_state(annotations)
        logits, alphas = [], []
        for t in range(tokens.shape[1]):
            step_logits, state, alpha = self.step(tokens[:, t], annotations, state)
            logits.append(step_logits)
            alphas.append(alpha)
        return torch.stack(logits, dim=1), torch.stack(alphas, dim=1)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits (B, T, V) for input ids (B, T) starting with ``<bos>``."""
        return self.run_decoder(self.encode(images), tokens)[0]

    def generate(self, images: torch.Tensor, max_len: int = 12) -> tuple[torch.Tensor, list[str]]:
        """Greedy decoding, one attention per step (same contract as ``Captioner.generate``).

        Returns:
            ``(ids, captions)``: ids (B, T) without ``<bos>``; a sequence ends with its
            ``<eos>`` followed by ``<pad>``.
        """
        max_len = min(max_len, self.max_len)
        annotations = self.encode(images)
        state = self.init_state(annotations)
        b = images.shape[0]
        token = torch.full((b,), self.vocab.bos_id, dtype=torch.long, device=images.device)
        done = torch.zeros(b, dtype=torch.bool, device=images.device)
        out: list[torch.Tensor] = []
        for _ in range(max_len):
            logits, state, _ = self.step(token, annotations, state)
            token = torch.where(done, torch.full_like(token, self.vocab.pad_id), logits.argmax(-1))
            out.append(token)
            done = done | (token == self.vocab.eos_id)
            if bool(done.all()):
                break
        ids = torch.stack(out, dim=1) if out else torch.zeros(b, 0, dtype=torch.long, device=images.device)
        return ids, self.decode(ids)

    def extra_repr(self) -> str:
        return f"vocab={len(self.vocab)}, max_len={self.max_len}"


def doubly_stochastic(alphas: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The doubly stochastic attention penalty of Xu et al. (2015), eq. 14, per image.

    Each location should receive, summed over the caption's steps, about one unit of attention:
    ``sum_i (1 - sum_t alpha_ti)^2``.

    Args:
        alphas: (B, T, N) attention weights of every step.
        steps: (B, T) bool, the steps that belong to the caption (up to its ``<eos>``).

    Returns:
        (B,) the penalty of each image.
    """
    coverage = (alphas * steps[..., None].to(alphas.dtype)).sum(dim=1)
    return ((1.0 - coverage) ** 2).sum(dim=-1)
