"""What a capture's records hold after a language model's ``generate``, and what the capture costs it.

A random-init Llama-shaped decoder (``--layers``, ``--hidden``, ``--heads``, ``--kv-heads``; Hugging Face
"sdpa" attention, a dynamic KV cache) generates ``--new`` tokens greedily after a prompt of each of
``--prompts`` tokens, under ``torch.no_grad``. Per prompt length:

* ``KV cache MB``: the model's own cache at the end (keys and values of every layer);
* ``records MB, keys kept``: the bytes of the distinct tensors the records reference (q, k, v, mask,
  probabilities) when every decoding step keeps its queries and keys (``early.KEYS_BYTES`` set out of reach:
  how every capture kept them before vitexplain/recording/early.py). A dynamic cache concatenates, so each
  step's keys are a new tensor that only its record keeps alive;
* ``records MB``: the same with the default, where a decoding step whose keys take at least
  ``early.KEYS_BYTES`` keeps its probabilities, computed at the call, instead;
* ``captured / plain``: CPU time of the captured ``generate`` over the plain one, both settings (medians of
  ``--reps`` interleaved rounds in a shuffled order, one torch thread).

Usage::

    python benchmarks/decode_memory.py [--prompts 512,2048] [--new 64] [--reps 5] [--no-report]

Writes its table to docs/benchmarks.md (section "Decoding: what the records hold") unless ``--no-report``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import vitexplain as vx
from vitexplain.recording import early
from _common import held_bytes, interleaved_times, report, table

SECTION = "Decoding: what the records hold"


def row(model: torch.nn.Module, prompt: int, new: int, reps: int) -> list[object]:
    """One table row for a prompt of ``prompt`` tokens."""
    ids = torch.randint(3, model.config.vocab_size, (1, prompt))
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    default = early.KEYS_BYTES

    def plain() -> None:
        with torch.no_grad():
            model.generate(ids, **kw)

    def captured(keys_bytes: int) -> int:
        early.KEYS_BYTES = keys_bytes
        try:
            with torch.no_grad(), vx.capture(model) as rec:
                model.generate(ids, **kw)
            return held_bytes(rec.records)
        finally:
            early.KEYS_BYTES = default

    out = model.generate(ids, **kw, return_dict_in_generate=True)
    cache = sum(t.numel() * t.element_size() for layer in out.past_key_values.layers for t in (layer.keys, layer.values))
    kept, now = captured(2**62), captured(default)
    runs = interleaved_times({"plain": plain, "kept": lambda: captured(2**62), "default": lambda: captured(default)},
                             reps=reps, warmup=1, clock=time.process_time, shuffle_seed=0)
    med = {k: statistics.median(v) for k, v in runs.items()}
    mb = 2**20
    return [f"{prompt} + {new}", f"{cache / mb:.1f}", f"{kept / mb:.1f}", f"{now / mb:.1f}",
            f"{med['kept'] / med['plain']:.2f}", f"{med['default'] / med['plain']:.2f}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-report", action="store_true", help="print only; do not rewrite docs/benchmarks.md")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=8192,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()
    per_token = a.kv_heads * (a.hidden // a.heads) * 4
    rows = [row(model, int(n), a.new, a.reps) for n in a.prompts.split(",")]
    header = ["prompt + new tokens", "KV cache MB", "records MB, keys kept", "records MB",
              "captured / plain, keys kept", "captured / plain"]
    body = table(header, rows) + (
        f"\n\nA random-init Llama ({a.layers} layers, hidden {a.hidden}, {a.heads} heads, {a.kv_heads} key/value heads: "
        f"{per_token} key bytes per token and layer, float32), greedy generate, batch 1, a dynamic cache. "
        f"'keys kept': every decoding step's record keeps its queries and keys (how captures kept them before "
        f"vitexplain/recording/early.py); the default keeps a decoding step's probabilities, computed at the call, "
        f"once its keys take {early.KEYS_BYTES // 2**20} MiB or more. Records MB: the distinct tensors the records "
        "reference after the generate (the prompt's call keeps its q and k: its probabilities would be larger). "
        "captured / plain: median CPU time over interleaved rounds.")
    report(SECTION, body, print_only=a.no_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
