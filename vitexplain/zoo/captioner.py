"""A tiny image captioner: a timm ViT encoder and a small pre-norm transformer decoder.

The decoder is written so that its attention can be read:

* every attention is a small module that calls
  :func:`torch.nn.functional.scaled_dot_product_attention` with ``q, k, v`` shaped
  ``(B, heads, N, head_dim)``;
* :class:`CrossAttention` (``is_cross_attention = True``) attends from the text tokens to
  *all* encoder tokens (class token + patch tokens, ``1 + gh * gw``) and always receives the
  encoder output as an argument named ``memory``, also when its keys and values come from
  the cache;
* :class:`SelfAttention` (``is_cross_attention = False``) is causal;
* generation keeps a KV cache: self-attention keys/values are appended per step, cross-attention
  keys/values are computed once, so every generation step issues queries of length 1.

Word ``t`` of a generated caption is produced by decoding step ``t``, whose query is the token
fed at that step (``<bos>`` for ``t = 0``, else word ``t - 1``); its cross-attention row is the
one that explains word ``t``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from ..errors import NotFoundError, UsageError

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "Vocab",
    "CaptionText",
    "SelfAttention",
    "CrossAttention",
    "DecoderLayer",
    "Captioner",
]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

Cache = dict[str, torch.Tensor]


class Vocab:
    """A word vocabulary with ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2.

    Args:
        words: the content words (e.g. colors, shapes and "and"), in id order after the specials.
    """

    def __init__(self, words: Sequence[str]) -> None:
        self.itos: list[str] = [PAD, BOS, EOS] + [w for w in words if w not in (PAD, BOS, EOS)]
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise UsageError("vocabulary words must be unique")
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, caption: str) -> list[int]:
        """Word ids of a caption (no specials); raises ``KeyError`` naming an unknown word."""
        try:
            return [self.stoi[w] for w in caption.split()]
        except KeyError as err:
            raise NotFoundError(f"word {err.args[0]!r} is not in the vocabulary {self.itos[3:]}") from None

    def decode(self, ids: Sequence[int]) -> str:
        """Caption of a sequence of ids: stops at ``<eos>``, skips ``<pad>`` and ``<bos>``."""
        words: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            words.append(self.itos[i])
        return " ".join(words)


class CaptionText:
    """Text helpers of the zoo captioners (they have ``self.vocab`` and ``self.max_len``)."""

    vocab: Vocab
    max_len: int

    def tokenize(self, captions: Sequence[str], max_len: Optional[int] = None) -> torch.Tensor:
        """Token ids ``<bos> w_1 .. w_n <eos> <pad> ...`` of a batch of captions.

        Args:
            captions: B captions.
            max_len: pad to this length (default: the longest caption + 2).

        Returns:
            (B, T) long tensor. Teacher forcing feeds ``ids[:, :-1]`` and predicts ``ids[:, 1:]``.
        """
        seqs = [[self.vocab.bos_id, *self.vocab.encode(c), self.vocab.eos_id] for c in captions]
        length = max_len or max(len(s) for s in seqs)
        if any(len(s) > length for s in seqs) or length > self.max_len + 1:
            raise UsageError(f"captions longer than max_len ({self.max_len} decoder positions)")
        out = torch.full((len(seqs), length), self.vocab.pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out

    def decode(self, ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
        """Captions of (B, T) token ids (stops at ``<eos>``, skips ``<pad>``/``<bos>``)."""
        rows = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return [self.vocab.decode(r) for r in rows]


class SelfAttention(nn.Module):
    """Causal multi-head self-attention over the text tokens (fused SDPA).

    Args:
        dim: model width D.
        num_heads: number of heads H (``D % H == 0``).
    """

    is_cross_attention = False

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise UsageError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cache: Optional[Cache] = None) -> torch.Tensor:
        """Attend causally.

        Args:
            x: (B, T, D) text tokens. With a cache holding earlier steps, T must be 1.
            cache: optional dict; keys ``"k"``, ``"v"`` (B, H, T_past, hd) are read and extended.

        Returns:
            (B, T, D).
        """
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, T, hd) each
        past = cache is not None and "k" in cache
        if past:
            if t != 1:
                raise UsageError("with a KV cache, decode one token per step (T == 1)")
            k = torch.cat([cache["k"], k], dim=2)
            v = torch.cat([cache["v"], v], dim=2)
        if cache is not None:
            cache["k"], cache["v"] = k, v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=(t > 1))
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class CrossAttention(nn.Module):
    """Multi-head cross-attention from text tokens to all encoder tokens (fused SDPA).

    Args:
        dim: text width D.
        num_heads: number of heads H.
        memory_dim: width of the encoder tokens (defaults to ``dim``).
    """

    is_cross_attention = True

    def __init__(self, dim: int, num_heads: int, memory_dim: Optional[int] = None) -> None:
        super().__init__()
        if dim % num_heads:
            raise UsageError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(memory_dim or dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cache: Optional[Cache] = None) -> torch.Tensor:
        """Attend from the text to the image.

        Args:
            x: (B, T, D) text tokens.
            memory: (B, N, D_mem) encoder tokens (class token + patches). Always passed, also
                when keys and values are taken from the cache.
            cache: optional dict; ``"k"``, ``"v"`` (B, H, N, hd) are computed from ``memory``
                on the first call and reused afterwards.

        Returns:
            (B, T, D).
        """
        b, t, d = x.shape
        q = self.q(x).reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            n = memory.shape[1]
            kv = self.kv(memory).reshape(b, n, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            k, v = kv.unbind(0)
            if cache is not None:
                cache["k"], cache["v"] = k, v
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention, cross-attention, MLP (each residual).

    Args:
        dim: width D.
        num_heads: heads of both attentions.
        mlp_ratio: hidden width of the MLP relative to D.
        memory_dim: width of the encoder tokens.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0, memory_dim: Optional[int] = None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = SelfAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, num_heads, memory_dim)
        self.norm3 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, cache: Optional[dict[str, Cache]] = None) -> torch.Tensor:
        """Args: x (B, T, D), memory (B, N, D_mem), cache: {"self": {...}, "cross": {...}} or None.

        Returns:
            (B, T, D).
        """
        self_cache = cross_cache = None
        if cache is not None:
            self_cache = cache.setdefault("self", {})
            cross_cache = cache.setdefault("cross", {})
        x = x + self.self_attn(self.norm1(x), cache=self_cache)
        x = x + self.cross_attn(self.norm2(x), memory=memory, cache=cross_cache)
        return x + self.mlp(self.norm3(x))


class Captioner(CaptionText, nn.Module):
    """ViT encoder + transformer decoder that writes "<color> <shape> and ..." captions.

    Args:
        words: content words of the vocabulary (specials are added in front).
        img_size: encoder input size (square).
        patch_size: encoder patch size.
        enc_dim: encoder width.
        enc_depth: encoder blocks.
        enc_heads: encoder heads.
        enc_mlp_ratio: encoder MLP ratio.
        dec_dim: decoder width.
        dec_depth: decoder layers.
        dec_heads: decoder heads (self and cross).
        dec_mlp_ratio: decoder MLP ratio.
        max_len: longest token sequence the decoder accepts (incl. ``<bos>``).

    Attributes:
        encoder: a timm ``VisionTransformer`` (class token, ``num_classes=0``); its
            ``forward_features`` output (B, 1 + gh * gw, enc_dim) is the decoder's memory.
        vocab: the :class:`Vocab`.
    """

    def __init__(
        self,
        words: Sequence[str],
        img_size: int = 64,
        patch_size: int = 8,
        enc_dim: int = 96,
        enc_depth: int = 4,
        enc_heads: int = 4,
        enc_mlp_ratio: float = 2.0,
        dec_dim: int = 96,
        dec_depth: int = 2,
        dec_heads: int = 2,
        dec_mlp_ratio: float = 2.0,
        max_len: int = 16,
    ) -> None:
        super().__init__()
        self.vocab = Vocab(words)
        self.max_len = max_len
        self.encoder = VisionTransformer(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=enc_dim,
            depth=enc_depth,
            num_heads=enc_heads,
            mlp_ratio=enc_mlp_ratio,
            num_classes=0,
            global_pool="token",
            class_token=True,
        )
        self.embed = nn.Embedding(len(self.vocab), dec_dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dec_dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        nn.init.trunc_normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(
            DecoderLayer(dec_dim, dec_heads, dec_mlp_ratio, memory_dim=enc_dim) for _ in range(dec_depth)
        )
        self.norm = nn.LayerNorm(dec_dim)
        self.head = nn.Linear(dec_dim, len(self.vocab))

    # -- model --------------------------------------------------------------------------------
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Encoder tokens.

        Args:
            images: (B, 3, H, W) normalised images.

        Returns:
            (B, 1 + gh * gw, enc_dim) memory: class token then patch tokens (row-major).
        """
        return self.encoder.forward_features(images)

    def decode_step(
        self,
        tokens: torch.Tensor,
        memory: torch.Tensor,
        cache: Optional[list[dict[str, Cache]]] = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Run the decoder on text tokens.

        Args:
            tokens: (B, T) token ids at positions ``start .. start + T - 1``.
            memory: (B, N, enc_dim) encoder tokens.
            cache: per-layer caches (one dict per layer) for incremental decoding, or None.
            start: position of the first token (for the learned positions).

        Returns:
            (B, T, V) next-token logits.
        """
        t = tokens.shape[1]
        if start + t > self.max_len:
            raise UsageError(f"decoder positions up to {start + t} exceed max_len={self.max_len}")
        x = self.embed(tokens) + self.pos[:, start:start + t]
        for i, layer in enumerate(self.layers):
            x = layer(x, memory=memory, cache=None if cache is None else cache[i])
        return self.head(self.norm(x))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced next-token logits.

        Args:
            images: (B, 3, H, W) normalised images.
            tokens: (B, T) input ids starting with ``<bos>``.

        Returns:
            (B, T, V) logits; position t predicts token t + 1.
        """
        return self.decode_step(tokens, self.encode(images))

    def generate(self, images: torch.Tensor, max_len: int = 12) -> tuple[torch.Tensor, list[str]]:
        """Greedy decoding with a KV cache (queries of length 1 per step).

        Runs under the caller's grad mode (wrap in ``torch.no_grad()`` for plain inference).

        Args:
            images: (B, 3, H, W) normalised images.
            max_len: most tokens to generate (incl. ``<eos>``), at most ``self.max_len``.

        Returns:
            ``(ids, captions)``: ids (B, T) long without ``<bos>``; a sequence ends with its
            ``<eos>`` followed by ``<pad>``; T <= max_len is the number of steps run. Captions
            are the decoded strings.
        """
        max_len = min(max_len, self.max_len)
        memory = self.encode(images)
        b = images.shape[0]
        cache: list[dict[str, Cache]] = [{} for _ in self.layers]
        token = torch.full((b, 1), self.vocab.bos_id, dtype=torch.long, device=images.device)
        done = torch.zeros(b, dtype=torch.bool, device=images.device)
        out: list[torch.Tensor] = []
        for step in range(max_len):
            logits = self.decode_step(token, memory, cache=cache, start=step)
            nxt = logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.vocab.pad_id), nxt)
            out.append(nxt)
            done = done | (nxt == self.vocab.eos_id)
            if bool(done.all()):
                break
            token = nxt[:, None]
        ids = torch.stack(out, dim=1) if out else torch.zeros(b, 0, dtype=torch.long, device=images.device)
        return ids, self.decode(ids)

    def extra_repr(self) -> str:
        return f"vocab={len(self.vocab)}, max_len={self.max_len}"

