"""``vitexplain caption`` for vision-language models: the prompt, whole images, maps per image.

A vision-language model (LLaVA, ... : :data:`vitexplain.methods.families.VLM`) takes the images
themselves, which its processor resizes and tiles, plus a prompt (``--prompt``); its maps come
back per image at the image's resolution (:class:`vitexplain.results.VLMCaptionExplanation`).
So the run hands each batch's decoded images (not the driver's preprocessed tensor) to
``Explainer.explain_caption(images, prompt=...)``; the files are those of every captioner
(:mod:`vitexplain.batch.caption`), with the maps stored at the image's resolution capped at
:data:`MAX_MAP_SIDE` pixels on the longer side.

``--model`` is then a zoo VLM (``shapes-vlm``) or a folder written by ``model.save_pretrained(DIR)``
and ``processor.save_pretrained(DIR)`` (:func:`vitexplain.batch.models.load_model`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import UsageError
from .checks import empty_caption_error

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["MAX_MAP_SIDE", "check_prompt", "probe_vlm", "vlm_process"]

#: Longest side, in pixels, of the maps a VLM run stores (``KEY.METHOD.npz``).
MAX_MAP_SIDE = 512


def check_prompt(prompt: Optional[str], family: str, model: str) -> None:
    """``--prompt`` is for vision-language models, and not empty.

    Raises:
        UsageError: a prompt for another family, or an empty one.
    """
    if prompt is None:
        return
    if family != "vlm":
        raise UsageError(f"--prompt is for vision-language models; {model!r} is a {family} model, which takes "
                         "no prompt: leave --prompt out")
    if not prompt.strip():
        raise UsageError("--prompt is empty; give the question or instruction, or leave it out for the model's default")


def probe_vlm(explain: Callable[[list["np.ndarray"]], Any], what: str, size: tuple[int, int]) -> Any:
    """Explain one grey image before writing anything (a prompt or method the model cannot take
    is then a usage error, exit 2, not the same failure for every image).

    Raises:
        UsageError: ``explain`` failed.
    """
    import numpy as np

    h, w = size
    try:
        return explain([np.full((int(h), int(w), 3), 128, dtype=np.uint8)])
    except Exception as e:
        raise UsageError(f"cannot explain {what} (tried on a grey {h}x{w} image): {type(e).__name__}: {e}") from None


def _capped(maps: "torch.Tensor") -> "np.ndarray":
    """(T, H, W) maps as float32 numpy, area-downsampled so the longer side is at most MAX_MAP_SIDE."""
    import torch.nn.functional as F

    t, h, w = maps.shape
    scale = MAX_MAP_SIDE / max(h, w)
    if scale < 1:
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        maps = F.interpolate(maps[None].float(), size=size, mode="area")[0]
    return maps.float().cpu().numpy()


def vlm_process(
    ex: Any, *, methods: list[str], per_method: dict[str, dict[str, Any]], caption: Optional[str],
    prompt: Optional[str], max_len: int, generated: bool, paths: dict[str, str],
    make_item: Callable[..., Any], write: Callable[..., Any],
) -> Callable[["torch.Tensor", list[dict[str, Any]]], list[tuple[dict[str, Any], Any]]]:
    """The driver's ``process(x, good)`` for a VLM: explains ``good``'s decoded images, not ``x``.

    Args:
        ex: the Explainer (with the model's processor).
        methods: the methods to run; per_method: their options.
        caption: answer words to explain (teacher-forced) or None to generate.
        prompt: the prompt (None: the adapter's default).
        max_len: most tokens generated.
        generated: whether captions are generated.
        paths: output key -> input path.
        make_item: builds the write job's item (``caption._Caption``) from keyword fields.
        write: the write job (``caption._write_caption`` with the run's settings bound).

    Returns:
        ``process(x, good) -> [(manifest fields, write job or error text)]``.
    """
    import numpy as np

    def process(x: "torch.Tensor", good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        """The batch explained together; when that fails, each image alone (the images are explained
        independently: one the processor or the model refuses must not fail the others)."""
        del x  # the processor preprocesses the images itself
        try:
            return explained(good)
        except Exception:
            if len(good) == 1:
                raise  # (the run records it)
        jobs: list[tuple[dict[str, Any], Any]] = []
        for s in good:
            try:
                jobs.extend(explained([s]))
            except Exception as e:  # noqa: BLE001 - recorded as this image's failure, as the run records a batch's
                jobs.append(({}, f"explaining {paths[s['key']]} failed: {type(e).__name__}: {e}"))
        return jobs

    def explained(good: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
        images = [s["region"] for s in good]
        results = ex.explain_caption(images, method=methods, caption=caption, prompt=prompt, max_len=max_len,
                                     **per_method)
        first = results[0]
        ids = first.ids.cpu().tolist()
        jobs: list[tuple[dict[str, Any], Any]] = []
        for b, s in enumerate(good):
            tokens = list(first.tokens[b])
            t = len(tokens)
            maps = {r.method: _capped(r.image_maps[b][:t]) for r in results}
            bad = [m for m, v in maps.items() if not np.isfinite(v).all()]
            fields = {"caption": first.captions[b], "tokens": tokens, "ids": [int(v) for v in ids[b][:t]],
                      "generated": generated, "prompt": first.prompts[b] if getattr(first, "prompts", None) else prompt}
            item = make_item(
                key=s["key"], region=s["region"], caption=fields["caption"], tokens=tokens, ids=fields["ids"],
                generated=generated, maps=maps,
                record={"input": paths[s["key"]], "width": s["width"], "height": s["height"], "box": s["box"],
                        "prompt": fields["prompt"]},
            )
            empty = empty_caption_error(s["key"], t, generated)
            if empty:
                job: Any = empty
            elif bad:
                job = (f"{s['key']}: the {', '.join(bad)} map is not finite (NaN or inf): the method broke down "
                       "numerically on this image")
            else:
                job = functools.partial(write, item=item)
            jobs.append((fields, job))
        return jobs

    return process
