"""Train ``shapes-vlm`` (a Hugging Face LLaVA) on freshly generated shapes images.

Usage::

    python -m vitexplain.zoo.train_vlm --out stage1 --threads 1
    python -m vitexplain.zoo.train_vlm --out vitexplain/zoo/weights --resume stage1/shapes-vlm.json \
        --steps 600 --lr 5e-4 --seed 1 --label-smoothing 0.1 --threads 1

reproduce the bundled ``shapes-vlm.safetensors`` / ``shapes-vlm.json`` (each stage's command is in
its JSON, ``training.command`` and ``training.previous.command``; 414 CPU s in all). Stage 2's label
smoothing keeps the model from certainty: on words it is sure of, the gradient of the word's
log-probability vanishes (``onehot - p``), and the gradient-weighted methods (``cross_generic``,
``cross_grad``) read noise there (per-word pointing 0.873 without stage 2, 0.963 with it; ``cross``
0.980 and 0.988; ``benchmarks/vlm_pointing.py``). Options: ``--steps``, ``--batch-size``, ``--lr``,
``--seed``, ``--aux-weight``, ``--label-smoothing``, ``--qa-every``, ``--resume``, ``--eval-images``;
``--measure CKPT`` only measures a checkpoint again.

Recipe (the seeds follow :mod:`vitexplain.zoo.train`: training streams ``< 9_000``, evaluation
``>= 10_000``; every step draws new images, so none is seen twice):

* the objective is the answer's next-token cross-entropy: input ``<s> <image>x64 PROMPT CAPTION
  </s>``, loss on ``CAPTION </s>`` only; each batch uses one of the training prompts
  (:data:`vitexplain.zoo.vlm.PROMPTS`) in turn;
* plus token labeling (Jiang et al. 2021, :class:`vitexplain.zoo.token_labels.AuxHeads`) on the vision
  tower's last-layer patch tokens (the tokens LLaVA projects into the language model): a
  training-only head predicts the shape and colour coverage of each patch. It makes the tiny CLIP
  tower learn from ~10^5 images and keeps its tokens local. The language model's attention is never
  supervised;
* AdamW, linear warmup then cosine decay, gradient clipping at 1.0 (``recipes.lr_at``).

At the end the script measures, on held-out two-object images (seed ``POINTING_SEED``), per-word
pointing of the raw attention of the row that predicts each colour / shape word over the 64 image
columns (mean over layers and heads, read from an eager-attention copy of the model; a hit when the
highest patch overlaps the object, :func:`peak_on_object`), and
greedy-caption accuracy on seed ``EVAL_SEED``; both go into the JSON config under ``metrics``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.drawing import COLORS, SHAPES
from ..data.synthetic import shapes
from ..errors import UsageError
from .evaluate import EVAL_SEED
from .token_labels import AuxHeads, patch_targets
from .recipes import MAX_TRAIN_SEED, lr_at, param_groups
from .vlm import IMAGE_TOKEN, PROMPT, PROMPTS, VLM_ARGS, build_llava, build_processor, caption_accuracy

__all__ = ["POINTING_SEED", "teacher_inputs", "qa_pairs", "peak_on_object", "vision_layers", "train_vlm",
           "attention_pointing", "measure", "main"]

NAME = "shapes-vlm"
#: Question batches draw images from index QA_START of the training stream (never the caption batches').
QA_START = 100_000_000
#: Held-out two-object images of the pointing measurement.
POINTING_SEED = 20_000


def teacher_inputs(tokenizer: Any, captions: Sequence[str], prompt: str | Sequence[str], num_image_tokens: int,
                   image_token_id: int) -> dict[str, torch.Tensor]:
    """Teacher-forcing inputs ``<s> <image>xN prompt caption </s>``, right-padded.

    Args:
        tokenizer: the processor's tokenizer.
        captions: B answers.
        prompt: one prompt for all, or one per answer; each starts with the ``<image>`` placeholder.
        num_image_tokens: N, what the processor expands the placeholder to.
        image_token_id: the placeholder's id.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels`` (B, T) (labels -100 except on the answer and
        ``</s>``) and ``answer_start`` (B,) the position of each answer's first word.
    """
    prompts = [prompt] * len(captions) if isinstance(prompt, str) else list(prompt)
    placeholder = tokenizer.convert_ids_to_tokens(image_token_id)
    rows, starts = [], []
    for p, c in zip(prompts, captions):
        head = tokenizer(p.replace(placeholder, "").strip()).input_ids
        # <s> then the image tokens then the prompt words (the placeholder stands first in every prompt)
        prefix = [head[0]] + [image_token_id] * num_image_tokens + head[1:]
        rows.append(prefix + tokenizer(c, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
        starts.append(len(prefix))
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    labels = torch.full((len(rows), t), -100, dtype=torch.long)
    for i, (r, start) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        labels[i, start: len(r)] = torch.tensor(r[start:])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "answer_start": torch.tensor(starts, dtype=torch.long)}


def qa_pairs(batch: Any, generator: torch.Generator) -> tuple[list[str], list[str]]:
    """One question per image about one of its objects, in the vocabulary of the captions:
    ``"<image> what is the star ?"`` -> its colour, ``"<image> what is red ?"`` -> its shape.

    Args:
        batch: images whose objects have distinct shapes and distinct colours (so the answer is unique).
        generator: draws the object and the kind of question.

    Returns:
        (prompts, answers).
    """
    prompts, answers = [], []
    for i in range(len(batch)):
        k = int(torch.randint(len(batch.classes[i]), (1,), generator=generator))
        shape, color = SHAPES[int(batch.classes[i][k])], COLORS[int(batch.colors[i][k])]
        if int(torch.randint(2, (1,), generator=generator)):
            prompts.append(f"{IMAGE_TOKEN} what is the {shape} ?")
            answers.append(color)
        else:
            prompts.append(f"{IMAGE_TOKEN} what is {color} ?")
            answers.append(shape)
    return prompts, answers


def vision_layers(model: nn.Module) -> nn.ModuleList:
    """The CLIP encoder layers of the LLaVA's vision tower."""
    tower = model.model.vision_tower
    return getattr(tower, "vision_model", tower).encoder.layers


def init_vision_from_vit(model: nn.Module, vit: nn.Module) -> None:
    """Copy a trained timm ViT trunk (``shapes-vit``) into the LLaVA's vision tower (CLIP or SigLIP).

    Same widths, depth, heads, patch size, GELU and pre-norm blocks: timm's fused ``qkv`` is split
    into ``q/k/v_proj``, ``proj`` is ``out_proj``, the final norm is ``post_layernorm``. A CLIP tower
    gets the class token (``class_embedding``) and all position embeddings; its patch embedding has
    no bias, so timm's is added to the patch tokens' position embeddings (the same sum). CLIP also
    normalises the embeddings before the first block (``pre_layrnorm``), which timm does not: its
    weight is set to the embeddings' mean standard deviation (measured on shapes images) and its bias
    to 0, so the first block's own norm sees exactly what it saw in timm and the residual stream
    keeps its scale; training adapts to the rest. A SigLIP tower has no class token: the patch
    tokens' position embeddings are copied and the class token is dropped.

    Raises:
        UsageError: the shapes differ.
    """
    from ..data.synthetic import shapes as _shapes

    tower = model.model.vision_tower
    if hasattr(tower, "vision_model"):
        tower = tower.vision_model
    src = vit.state_dict()
    prefix = vit.num_prefix_tokens
    dim = int(src["pos_embed"].shape[-1])
    clip = hasattr(tower.embeddings, "class_embedding")
    state: dict[str, torch.Tensor] = {
        "embeddings.patch_embedding.weight": src["patch_embed.proj.weight"],
        "post_layernorm.weight": src["norm.weight"], "post_layernorm.bias": src["norm.bias"],
    }
    if clip:
        pos = src["pos_embed"][0].clone()
        pos[prefix:] += src["patch_embed.proj.bias"]
        state["embeddings.class_embedding"] = src["cls_token"].reshape(dim)
        state["embeddings.position_embedding.weight"] = pos
        with torch.no_grad():  # the embeddings' typical scale (timm: patches + bias + positions, class token)
            x = vit.patch_embed(_shapes(16, seed=MAX_TRAIN_SEED - 1).tensor)
            x = vit._pos_embed(x)
        state["pre_layrnorm.weight"] = torch.full((dim,), float(x.std(-1).mean()))
        state["pre_layrnorm.bias"] = torch.zeros(dim)
    else:
        state["embeddings.patch_embedding.bias"] = src["patch_embed.proj.bias"]
        state["embeddings.position_embedding.weight"] = src["pos_embed"][0, prefix:]
    for i in range(len(tower.encoder.layers)):
        b, o = f"blocks.{i}.", f"encoder.layers.{i}."
        for name, part in zip(("q_proj", "k_proj", "v_proj"), range(3)):
            state[o + f"self_attn.{name}.weight"] = src[b + "attn.qkv.weight"][part * dim:(part + 1) * dim]
            state[o + f"self_attn.{name}.bias"] = src[b + "attn.qkv.bias"][part * dim:(part + 1) * dim]
        pairs = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
                 "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
        for dst, orig in pairs.items():
            for kind in ("weight", "bias"):
                state[o + f"{dst}.{kind}"] = src[b + f"{orig}.{kind}"]
    expected = tower.state_dict()
    bad = [k for k in expected if k not in state or state[k].shape != expected[k].shape]
    if bad or set(state) - set(expected):
        raise UsageError(f"the ViT does not match the vision tower: {bad[:5] or sorted(set(state) - set(expected))[:5]}")
    tower.load_state_dict(state, strict=True)


def _num_image_tokens(model: nn.Module) -> int:
    return int(model.config.image_seq_length)


def peak_on_object(maps: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the grid cell with the highest value overlaps the object.

    A training-time check (the zoo sits below :mod:`vitexplain.metrics` in the package's layers);
    ``vx.metrics.pointing_game`` (peak of the bilinearly upsampled map within 4 px of the mask) is
    what the tests and benchmarks report.

    Args:
        maps: (gh, gw) scores; mask: (H, W) bool, H and W multiples of gh and gw.
    """
    gh, gw = maps.shape
    cells = mask.reshape(gh, mask.shape[0] // gh, gw, mask.shape[1] // gw).any(3).any(1)  # (gh, gw)
    return bool(cells.flatten()[int(maps.flatten().argmax())])


@torch.no_grad()
def attention_pointing(model: nn.Module, processor: Any, n: int = 200, seed: int = POINTING_SEED) -> dict[str, Any]:
    """Per-word pointing of raw attention on held-out two-object images (eager copy of the model).

    For each colour / shape word of the reference caption (teacher-forced), the attention of the
    row that predicts it over the image columns, averaged over layers and heads (and the last
    layer's alone), is an 8 x 8 map; a hit if its highest cell overlaps the word's object
    (:func:`peak_on_object`).

    Returns:
        ``{"seed", "n_images", "n_words", "pointing", "pointing_last_layer"}``.
    """
    eager = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    eager.eval()
    batch = shapes(n, seed=seed, num_objects=2)
    n_img = _num_image_tokens(model)
    g = int(math.isqrt(n_img))
    content = set(COLORS) | set(SHAPES)
    hits: list[bool] = []
    hits_last: list[bool] = []
    for s in range(0, n, 50):
        sub = batch[s: s + 50]
        inp = teacher_inputs(processor.tokenizer, sub.captions, PROMPT, n_img, model.config.image_token_index)
        start = inp.pop("answer_start")
        inp.pop("labels")
        out = eager(pixel_values=sub.tensor, output_attentions=True, **inp)
        att = torch.stack(out.attentions, 1)  # (B, L, H, T, T)
        img = slice(1, 1 + n_img)
        for i, caption in enumerate(sub.captions):
            for w, (word, obj) in enumerate(zip(caption.split(), sub.word_objects[i])):
                if word not in content:
                    continue
                row = int(start[i]) + w - 1  # the position whose output predicts word w
                a = att[i, :, :, row, img]  # (L, H, n_img)
                mask = sub.masks[i][obj]
                hits.append(peak_on_object(a.mean((0, 1)).reshape(g, g), mask))
                hits_last.append(peak_on_object(a[-1].mean(0).reshape(g, g), mask))
    return {"seed": seed, "n_images": n, "n_words": len(hits), "pointing": sum(hits) / len(hits),
            "pointing_last_layer": sum(hits_last) / len(hits_last)}


def train_vlm(out: str | Path, *, steps: int = 2000, batch_size: int = 32, lr: float = 2e-3, seed: int = 0,
              aux_weight: float = 0.5, weight_decay: float = 0.05, warmup: int = 100, eval_images: int = 500,
              pointing_images: int = 200, init_vision: Optional[str] = "shapes-vit", resume: Optional[str] = None,
              qa_every: int = 0, label_smoothing: float = 0.0, log_every: int = 50, log: Callable[[str], Any] = print) -> Path:
    """Train shapes-vlm and write ``<out>/shapes-vlm.safetensors`` and ``.json``.

    Returns:
        Path of the JSON config.
    """
    from .hub import save_checkpoint

    if not 0 <= seed < MAX_TRAIN_SEED:
        raise UsageError(f"training seeds are 0..{MAX_TRAIN_SEED - 1} (higher seeds are held out)")
    torch.manual_seed(seed)
    model = build_llava(VLM_ARGS)
    processor = build_processor(VLM_ARGS)
    previous = None
    qa_gen = torch.Generator().manual_seed(seed)
    if resume:
        from safetensors.torch import load_file

        with open(Path(resume).with_suffix(".json"), encoding="utf-8") as f:
            previous = json.load(f)
        if previous.get("model_args") != VLM_ARGS:
            raise UsageError(f"{resume} is not a shapes-vlm checkpoint of the current architecture")
        model.load_state_dict(load_file(str(Path(resume).with_suffix(".safetensors"))), strict=True)
        log(f"[{NAME}] resumed from {resume}")
        init_vision = None
    if init_vision:
        from .hub import load, load_checkpoint, names

        init_vision_from_vit(model, load(init_vision) if init_vision in names() else load_checkpoint(init_vision))
        log(f"[{NAME}] vision tower starts from {init_vision}'s trunk")
    vcfg = model.config.vision_config
    aux = AuxHeads(int(vcfg.hidden_size), len(SHAPES), len(COLORS))
    grabbed: dict[str, torch.Tensor] = {}

    def grab(_m: nn.Module, _i: Any, output: Any) -> None:
        grabbed["tokens"] = output if isinstance(output, torch.Tensor) else output[0]

    # the last CLIP layer's output is LLaVA's image feature (vision_feature_layer=-1)
    handle = vision_layers(model)[-1].register_forward_hook(grab)
    groups = param_groups(model, weight_decay)
    groups[0]["params"] += list(aux.parameters())
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98))
    n_img = _num_image_tokens(model)
    image_token = model.config.image_token_index
    warm = min(warmup, max(1, steps // 10))
    model.train()
    log(f"[{NAME}] {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params, {steps} steps x "
        f"{batch_size} images, lr {lr:g}, seed {seed}, {torch.get_num_threads()} threads")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    running = 0.0
    try:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warm)
            if qa_every and step % qa_every == qa_every - 1:  # a batch of questions about one object each
                batch = shapes(batch_size, seed=seed, start=QA_START + step * batch_size, distinct_classes=True,
                               distinct_colors=True)
                prompts, answers = qa_pairs(batch, qa_gen)
                inp = teacher_inputs(processor.tokenizer, answers, prompts, n_img, image_token)
            else:
                batch = shapes(batch_size, seed=seed, start=step * batch_size)
                inp = teacher_inputs(processor.tokenizer, batch.captions, PROMPTS[step % len(PROMPTS)], n_img,
                                     image_token)
            inp.pop("answer_start")
            labels = inp.pop("labels")
            logits = model(pixel_values=batch.tensor, **inp).logits[:, :-1]  # position t predicts token t + 1
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                                   label_smoothing=label_smoothing)
            if aux_weight > 0:
                tokens = grabbed["tokens"][:, -n_img:]  # the patch tokens (a CLIP tower's class token comes first)
                loss = loss + aux_weight * aux(tokens, patch_targets(batch, int(vcfg.patch_size)))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
            opt.step()
            running = loss.item() if step == 0 else 0.95 * running + 0.05 * loss.item()
            if (step + 1) % log_every == 0 or step + 1 == steps:
                log(f"[{NAME}] step {step + 1}/{steps} loss {running:.4f} wall {time.perf_counter() - wall0:.0f}s")
    finally:
        handle.remove()
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    model.eval()
    metrics = _metrics(model, processor, eval_images, pointing_images)
    log(f"[{NAME}] metrics {json.dumps(metrics)}")
    import transformers

    config: dict[str, Any] = {
        "name": NAME, "arch": "llava", "model_args": VLM_ARGS,
        "training": {
            "command": f"python -m vitexplain.zoo.train_vlm --out DIR --seed {seed} --steps {steps} "
                       f"--batch-size {batch_size} --lr {lr:g} --aux-weight {aux_weight:g} --init-vision {init_vision or 'none'}"
                       f" --qa-every {qa_every} --label-smoothing {label_smoothing:g}" + (f" --resume {Path(resume).name}" if resume else ""),
            "seed": seed, "steps": steps, "batch_size": batch_size, "images_seen": steps * batch_size, "lr": lr,
            "weight_decay": weight_decay, "warmup": warm, "aux_weight": aux_weight, "init_vision": init_vision,
            "qa_every": qa_every, "label_smoothing": label_smoothing,
            "qa": "every qa_every-th batch: one question per image, '<image> what is the SHAPE ?' -> colour or "
                  "'<image> what is COLOUR ?' -> shape (distinct shapes and colours)" if qa_every else None,
            "aux_loss": "token labeling of the vision tower's last-layer patch tokens (training-only head)",
            "objective": "next-token cross-entropy on the caption and </s> after '<s> <image>x64 PROMPT'",
            "prompts": list(PROMPTS), "optimizer": "AdamW, cosine schedule, grad clip 1.0",
            "train_data": f"vx.data.shapes(batch_size, seed={seed}, start=step*batch_size)",
            "cpu_time_s": round(cpu_s, 1), "wall_time_s": round(wall_s, 1), "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "torch": torch.__version__, "transformers": transformers.__version__,
        },
        "metrics": metrics,
    }
    if previous is not None:
        config["training"]["previous"] = previous["training"]
        config["training"]["cpu_time_s_total"] = round(cpu_s + float(
            previous["training"].get("cpu_time_s_total", previous["training"]["cpu_time_s"])), 1)
    path = save_checkpoint(model, config, out)
    log(f"[{NAME}] done: CPU {cpu_s:.0f}s, wall {wall_s:.0f}s; wrote {path}")
    return path


def _metrics(model: nn.Module, processor: Any, eval_images: int, pointing_images: int) -> dict[str, Any]:
    return {"eval": caption_accuracy(model, processor, eval_images),
            "pointing_raw_attention": attention_pointing(model, processor, n=pointing_images)}


def measure(path: str | Path, *, eval_images: int = 500, pointing_images: int = 200,
            log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Measure a written checkpoint again and store the figures in its JSON (``metrics``).

    Returns:
        The metrics.
    """
    from .hub import load_checkpoint

    path = Path(path).with_suffix(".json")
    model = load_checkpoint(path)
    metrics = _metrics(model, model.vx_processor, eval_images, pointing_images)
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["metrics"] = metrics
    path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    log(f"[{NAME}] metrics {json.dumps(metrics)} written to {path}")
    return metrics


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m vitexplain.zoo.train_vlm", description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (required unless --measure)")
    p.add_argument("--measure", metavar="CKPT", help="only measure this checkpoint (.json) again and update its metrics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--aux-weight", type=float, default=0.5)
    p.add_argument("--eval-images", type=int, default=500)
    p.add_argument("--pointing-images", type=int, default=200, help="two-object images of the pointing check")
    p.add_argument("--init-vision", default="shapes-vit",
                   help="start the vision tower from this trained ViT (zoo name or checkpoint .json; 'none': random)")
    p.add_argument("--resume", default=None, help="a further stage: start from this shapes-vlm checkpoint (.json)")
    p.add_argument("--qa-every", type=int, default=0, help="every N-th batch is a batch of questions (0: none)")
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="of the answer's cross-entropy: keeps the model from certainty, whose log-probability "
                        "gradients (what gradient-weighted methods read) vanish")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.measure:
        measure(a.measure, eval_images=a.eval_images, pointing_images=a.pointing_images)
        return 0
    if not a.out:
        p.error("--out is required")
    train_vlm(a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed, aux_weight=a.aux_weight,
              eval_images=a.eval_images, pointing_images=a.pointing_images, log_every=a.log_every,
              init_vision=None if a.init_vision.lower() == "none" else a.init_vision, resume=a.resume,
              qa_every=a.qa_every, label_smoothing=a.label_smoothing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
