"""Cost of vx.capture during a VLM's ``generate``, side by side with a plain ``generate``.

Models: the bundled ``shapes-vlm`` (a Hugging Face LLaVA, SDPA) and a tiny random-init LLaVA of a
more usual shape (CLIP tower at 224 px / patch 14: 256 image tokens, Llama with GQA). For each,
greedy ``generate`` of ``--new`` tokens on a batch of images, timed as medians of interleaved
repetitions (plain, captured, plain, captured, ...), under ``torch.no_grad``:

* ``plain``: ``model.generate(**inputs)``;
* ``captured``: the same inside ``with vx.capture(model) as rec`` (records only: the fused kernel
  runs, each record keeps the call's q, k, v and mask by reference, no probabilities), as every
  capture after the first of a model runs: it starts narrowed from what an earlier capture learned
  (vitexplain/recording/discovery.py), intercepting only where attention is issued
  (vitexplain/recording/narrowing.py), and records Hugging Face SDPA calls from their arguments
  where checked, a module's later calls of a checked shape through its lane (their arguments kept, the
  records made when read: vitexplain/recording/direct.py);
* ``first capture``: the same on a copy of the model whose learned entry is forgotten before each
  run (``discovery.forget``): a capture that discovers the model (its mode on every torch call
  until the second forward, outside layers after the first of their class);
* ``full interception``: the same capture with interception everywhere for the whole scope (the
  recorder's private ``_full_interception`` flag: how every capture worked before narrowing; the
  tests' oracle);
* ``empty mode``: the same inside a TorchFunctionMode that only passes every call on (the floor of
  any capture that intercepts torch calls, as vx.capture does to see SDPA);
* ratio = captured / plain (the issue's target: <= 1.10), first capture / plain, full interception / plain,
  and empty mode / plain; beside them, captured / plain of the fastest run of each (other processes on a
  shared machine only ever slow a run down: what a quiet machine gives).

Memory: what the records hold after the captured ``generate``: the bytes of the distinct tensors
they reference (``_q, _k, _v, _mask, _probs``), next to the bytes that every call's N_q x N_k
probabilities would take (``B x H x N_q x N_k`` float32 summed over records: what a capture that
kept attention matrices would hold), and how many records hold probabilities (0: no N x N kept).

Usage: python benchmarks/vlm_capture.py [--reps 15] [--batch 4] [--new 8] [--models shapes-vlm,tiny] [--no-report]
[--cpu-time] (``--cpu-time``: the process's CPU time instead of wall time, for a machine shared with other work)
(``--no-report`` prints without rewriting docs/benchmarks.md; by default the table replaces its
section there.)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

import vitexplain as vx
from vitexplain.recording import discovery
from _common import held_bytes, interleaved_times, report, table


def tiny_llava() -> tuple[torch.nn.Module, object]:
    """A random-init LLaVA of a common shape (CLIP 224/14 tower, Llama GQA) and its processor."""
    import transformers

    from vitexplain.zoo.vlm import build_processor, build_tokenizer

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(image_size=224, patch_size=14, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=4, num_attention_heads=4)
    words = [f"w{i}" for i in range(500)]
    text = transformers.LlamaConfig(vocab_size=505, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=4,
                                      image_seq_length=256, vision_feature_select_strategy="default",
                                      vision_feature_layer=-2)
    model = transformers.LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa").eval()
    args = {"words": words, "img_size": 224, "patch_size": 14, "vision_type": "clip"}
    processor = build_processor(args)
    assert processor.tokenizer.get_vocab() == build_tokenizer(words).get_vocab()
    return model, processor


class _PassThrough(TorchFunctionMode):
    """A torch function mode that runs every call unchanged (the cost of intercepting at all)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _held_bytes(records) -> tuple[int, int, int]:
    """(bytes of distinct tensors the records reference, bytes of their N_q x N_k probabilities, records with probs)."""
    dense = with_probs = 0
    for r in records:
        with_probs += r._probs is not None
        b, h, nq, _ = r.q_shape
        dense += b * h * nq * r.k_shape[2] * 4
    return held_bytes(records), dense, with_probs


def bench(name: str, model: torch.nn.Module, processor, *, batch: int, new: int, reps: int, cpu: bool) -> list[object]:
    size = processor.image_processor.crop_size["height"]
    images = list(vx.data.shapes(batch, seed=10_000, size=max(size, 16)).images)
    prompt = "<image> " + " ".join(processor.tokenizer.convert_ids_to_tokens([5, 6, 7]))
    inputs = processor(images=images, text=[prompt] * batch, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def plain() -> None:
        with torch.no_grad():
            model.generate(**inputs, **kw)

    def captured() -> None:
        with torch.no_grad(), vx.capture(model):
            model.generate(**inputs, **kw)

    fresh = copy.deepcopy(model)  # (forgetting it leaves what captures of `model` learned as it is)

    def first_capture() -> None:
        discovery.forget(fresh)
        with torch.no_grad(), vx.capture(fresh):
            fresh.generate(**inputs, **kw)

    def captured_full() -> None:
        rec = vx.capture(model)
        rec._full_interception = True
        with torch.no_grad(), rec:
            model.generate(**inputs, **kw)

    def empty_mode() -> None:
        with torch.no_grad(), _PassThrough():
            model.generate(**inputs, **kw)

    fns = {"plain": plain, "captured": captured, "first": first_capture, "full": captured_full, "empty": empty_mode}
    runs = interleaved_times(fns, reps=reps, warmup=2, clock=time.process_time if cpu else time.perf_counter)
    times = {k: statistics.median(v) for k, v in runs.items()}
    fastest = min(runs["captured"]) / min(runs["plain"])
    with torch.no_grad(), vx.capture(model) as rec:
        out = model.generate(**inputs, **kw)
    held, dense, with_probs = _held_bytes(rec.records)
    with torch.no_grad():
        again = model.generate(**inputs, **kw)
    same = torch.equal(out, again)
    seq = int(inputs["input_ids"].shape[1])
    return [name, f"{batch} x ({seq} + {new})", f"{times['plain'] * 1e3:.1f}", f"{times['captured'] * 1e3:.1f}",
            f"{times['captured'] / times['plain']:.3f}", f"{fastest:.3f}", f"{times['first'] / times['plain']:.3f}", f"{times['full'] / times['plain']:.3f}",
            f"{times['empty'] / times['plain']:.3f}", "yes" if rec._narrowing.narrowed else "no", len(rec.records), with_probs,
            f"{held / 2**20:.2f}", f"{dense / 2**20:.2f}", "yes" if same else "NO"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default="shapes-vlm,tiny", help="comma separated: shapes-vlm, tiny")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with this process's CPU time instead of wall time (one thread; for a shared machine)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    chosen = a.models.split(",")
    if "shapes-vlm" in chosen:
        model = vx.zoo.load("shapes-vlm")
        rows.append(bench("shapes-vlm", model, model.vx_processor, batch=a.batch, new=a.new, reps=a.reps, cpu=a.cpu_time))
    if "tiny" in chosen:
        tiny, proc = tiny_llava()
        rows.append(bench("tiny LLaVA (CLIP 224/14, Llama GQA)", tiny, proc, batch=a.batch, new=a.new, reps=a.reps, cpu=a.cpu_time))
    header = ["model", "batch x (prompt + new)", "plain ms", "captured ms", "ratio", "ratio of the fastest runs",
              "first capture ratio", "full interception ratio",
              "empty mode ratio", "narrowed", "records",
              "records with N x N",
              "held by records MB", "all N_q x N_k MB", "same ids"]
    clock = "CPU time" if a.cpu_time else "wall time"
    body = (f"Median {clock} of {a.reps} interleaved repetitions, greedy generate, torch.no_grad, SDPA, "
            f"{a.threads} thread(s). 'held by records': distinct tensors the records reference (q, k, v, masks; "
            "k and v of a decode step are the KV cache's own tensors when it grows in place); 'all N_q x N_k': what "
            "keeping every call's probabilities would take; 'full interception': the capture with its mode on every torch "
            "call of the scope (as before narrowing); 'empty mode': a pass-through TorchFunctionMode on every call, the "
            "floor of intercepting everything (its cost is per torch op, so it weighs most on tiny models whose ops take "
            "microseconds); 'narrowed': the capture intercepted only where attention is issued; 'first capture': a capture "
            "that discovers the model (what earlier captures learned forgotten), as the first capture of a model runs; "
            "'ratio of the fastest runs': the fastest captured run over the fastest plain one (other processes only "
            "ever slow a run down). "
            "Target: ratio <= 1.10.\n\n" + table(header, rows))
    report("VLM capture during generate", body, print_only=a.no_report)


if __name__ == "__main__":
    main()
