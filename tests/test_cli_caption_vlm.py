"""``vitexplain caption`` with vision-language models: a Hugging Face model folder (model +
processor, ``save_pretrained``) and the bundled ``shapes-vlm``, with ``--prompt``.

Offline and small: a tiny random-init LLaVA of the shapes-vlm architecture (2 vision and 2 language
layers) saved with ``save_pretrained`` in a temporary folder; 64 and 80 px images; at most 3 new
tokens. Every run calls ``cli.main`` in-process with ``-j 0``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from peers import require
from vitexplain import cli

transformers = require("transformers", "pip install -e '.[test]' (the caption command's VLM folders)")

METHODS = ["cross", "cross_generic"]
PROMPT = "what is in the image ?"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA and its processor, written with save_pretrained."""
    from vitexplain.zoo.vlm import VLM_ARGS, build_llava, build_processor

    args = copy.deepcopy(VLM_ARGS)
    args["vision"].update(num_hidden_layers=2)
    args["text"].update(num_hidden_layers=2)
    torch.manual_seed(0)
    model = build_llava(args).eval()
    with torch.no_grad():  # a random LM may end its answer at once (an empty answer fails its image): it speaks
        model.lm_head.weight[model.config.text_config.eos_token_id] = 0.0
    path = tmp_path_factory.mktemp("llava") / "tiny llava"
    model.save_pretrained(path)
    build_processor(args).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("in") / "in"
    root.mkdir()
    batch = vx.data.shapes(2, seed=10_777, num_objects=2)
    Image.fromarray(batch.images[0]).save(root / "a.png")
    big = vx.data.shapes(1, seed=10_778, size=80)  # another size: maps come back at each image's own size
    Image.fromarray(big.images[0]).save(root / "b c.png")
    return root


def _run(*args) -> int:
    return cli.main([str(a) for a in args])


def _manifest(out: Path) -> dict[str, dict]:
    return {r["key"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines())}


def _reference(folder: Path, paths: list[Path], caption=None):
    """The same explanation through the Python API, from the folder loaded independently."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, attn_implementation="sdpa").eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    ex = vx.Explainer(model, processor=processor)
    return ex.explain_caption([str(p) for p in paths], method=METHODS, caption=caption, prompt=PROMPT, max_len=3)


def _check(out: Path, folder: Path, images: Path, caption=None) -> None:
    keys = ["a.png", "b c.png"]
    expected = _reference(folder, [images / k for k in keys], caption)
    manifest = _manifest(out)
    for i, key in enumerate(keys):
        rec = manifest[key]
        assert rec["status"] == "ok", rec
        tokens = expected[0].tokens[i]
        t = len(tokens)
        assert rec["tokens"] == tokens and rec["caption"] == expected[0].captions[i]
        assert rec["generated"] is (caption is None)
        doc = json.loads((out / f"{key}.caption.json").read_text(encoding="utf-8"))
        assert doc["prompt"] == PROMPT and doc["methods"] == METHODS
        size = 64 if key == "a.png" else 80
        assert (rec["width"], rec["height"]) == (size, size)
        for e in expected:
            with np.load(out / f"{key}.{e.method}.npz") as z:
                assert z["maps"].shape == (t, size, size)  # at the image's own resolution
                np.testing.assert_allclose(z["maps"], e.image_maps[i][:t].numpy(), rtol=1e-4, atol=1e-6)
                assert z["tokens"].tolist() == tokens
            assert vx.load_image(out / f"{key}.{e.method}.png").shape[0] > 0


def test_model_folder_with_prompt_generates_explains_and_resumes(folder: Path, images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    common = ("caption", images, "--out", out, "--model", folder, "--prompt", PROMPT, "--max-len", "3",
              "--method", ",".join(METHODS), "-q", "-j", "0")
    assert _run(*common) == 0
    _check(out, folder, images)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["model"]["family"] == "vlm" and summary["prompt"] == PROMPT
    assert _run(*common) == 0  # a rerun skips both
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["counts"]["skipped"] == 2
    assert _run(*common[:-2], "--prompt", "describe the image", "-q", "-j", "0") == 0  # another prompt: redone
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["counts"]["ok"] == 2


def test_model_folder_teacher_forces_a_given_answer(folder: Path, images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _run("caption", images, "--out", out, "--model", folder, "--prompt", PROMPT, "--caption", "red star",
                "--method", ",".join(METHODS), "-q", "-j", "0") == 0
    assert all(r["tokens"] == ["red", "star"] and not r["generated"] for r in _manifest(out).values())
    _check(out, folder, images, caption="red star")


def test_bundled_shapes_vlm_names_the_objects(images: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _run("caption", images / "a.png", "--out", out, "--model", "shapes-vlm", "-q", "-j", "0") == 0
    rec = _manifest(out)["a.png"]
    batch = vx.data.shapes(1, seed=10_777, num_objects=2)
    assert rec["status"] == "ok" and rec["files"].keys() >= {"cross", "cross_generic"}
    assert set(rec["tokens"]) <= set(batch.captions[0].split()) | {"and"}  # words of the image's own objects


@pytest.mark.parametrize("case, message", [
    ("no-config", "without config.json"),
    ("vit-folder", "`vitexplain caption` does not explain it"),
    ("prompt-captioner", "--prompt is for vision-language models"),
    ("empty-prompt", "--prompt is empty"),
    ("unknown-word", "hexagon"),
])
def test_usage_errors_exit_2(case: str, message: str, folder: Path, images: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    model, extra = str(folder), []
    if case == "no-config":
        model = str(tmp_path / "empty")
        Path(model).mkdir()
    elif case == "vit-folder":
        model = str(tmp_path / "vit")
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=16)
        transformers.ViTForImageClassification(config).save_pretrained(model)
    elif case == "prompt-captioner":
        model, extra = "shapes-captioner", ["--prompt", PROMPT]
    elif case == "empty-prompt":
        extra = ["--prompt", " "]
    elif case == "unknown-word":
        extra = ["--caption", "red hexagon"]
    assert _run("caption", images / "a.png", "--out", out, "--model", model, "-q", *extra) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_empty_generated_answer_fails_its_image_saying_so(images: Path, tmp_path: Path) -> None:
    """A VLM that ends its answer at once (every logit equal, its end token the first id) leaves no word to explain:
    each image is recorded as failed, saying so and what to do (was: counted captioned, with empty maps)."""
    from vitexplain.zoo.vlm import VLM_ARGS, build_llava, build_processor

    args = copy.deepcopy(VLM_ARGS)
    args["vision"].update(num_hidden_layers=1)
    args["text"].update(num_hidden_layers=1)
    model = build_llava(args).eval()
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy decoding picks id 0 ...
    model.generation_config.eos_token_id = 0  # ... which ends the answer
    folder, out = tmp_path / "mute", tmp_path / "out"
    model.save_pretrained(folder)
    build_processor(args).save_pretrained(folder)
    assert _run("caption", images, "--out", out, "--model", folder, "--prompt", PROMPT, "-q", "-j", "0") != 0
    records = _manifest(out)
    assert set(records) == {"a.png", "b c.png"}
    for rec in records.values():
        assert rec["status"] == "failed" and "empty caption" in rec["error"] and "--caption" in rec["error"], rec
    assert not list(out.glob("*.npz"))


def test_explore_command_with_a_model_folder_and_prompt(folder: Path, images: Path, tmp_path: Path) -> None:
    import re

    out = tmp_path / "page.html"
    assert _run("explore", images, "--out", out, "--model", folder, "--prompt", PROMPT, "--max-len", "2", "-q") == 0
    data = json.loads(re.search(r'<script type="application/json" id="vx-data">(.*?)</script>',
                                out.read_text(encoding="utf-8"), re.S).group(1))
    assert [d["name"] for d in data["images"]] == ["a.png", "b c.png"]
    expected = _reference(folder, [images / "a.png"])
    for d in data["images"]:
        assert d["family"] == "vlm" and d["vlm"]["prompt"] == PROMPT
    assert data["images"][0]["vlm"]["words"] == expected[0].tokens[0][:2]
    assert _run("explore", images, "--out", tmp_path / "x.html", "--model", "shapes-captioner", "--prompt", "hi") == 2


def test_an_image_the_processor_refuses_fails_alone(tmp_path: Path) -> None:
    """Qwen2-VL's processor refuses an image with an aspect ratio over 200: that image is recorded as failed
    with the processor's reason, and the images batched with it are explained (they all failed with its error)."""
    import vlm_helpers

    torch.manual_seed(0)
    model, processor = vlm_helpers.BUILDERS["qwen2_vl"]()
    folder = tmp_path / "qwen"
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    root = tmp_path / "in"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name, size in [("a.png", (64, 64)), ("b.png", (1, 300)), ("c.png", (40, 50))]:
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / name)
    out = tmp_path / "out"
    assert _run("caption", root, "--out", out, "--model", folder, "--prompt", PROMPT, "--max-len", "2",
                "--method", "cross", "-q", "-j", "0") == 1  # (some image failed)
    manifest = _manifest(out)
    assert manifest["a.png"]["status"] == manifest["c.png"]["status"] == "ok"
    assert manifest["b.png"]["status"] == "failed" and "aspect ratio" in manifest["b.png"]["error"]
    assert "b.png" in manifest["b.png"]["error"] and not manifest["a.png"].get("error")
    with np.load(out / "c.png.cross.npz") as z:
        assert z["maps"].shape[1:] == (40, 50)


def test_a_folder_whose_language_model_has_no_sdpa_loads_with_its_own_attention(images: Path, tmp_path: Path) -> None:
    """PaliGemma 2's Gemma 2 refuses SDPA (transformers raises when asked for it): the folder loads with the model's
    own (eager) attention, which the capture records, as the Python API explains it (was: --model DIR failed with
    transformers' error). Oracle: the API on the model and processor as built, the same given answer."""
    from vlm_helpers import paligemma2

    model, proc = paligemma2()
    folder, out = tmp_path / "paligemma2", tmp_path / "out"
    model.save_pretrained(folder)
    proc.save_pretrained(folder)
    keys = ["a.png", "b c.png"]
    assert _run("caption", images, "--out", out, "--model", folder, "--prompt", PROMPT, "--caption", "red circle",
                "--method", "cross", "-q", "-j", "0") == 0
    expected = vx.Explainer(model, processor=proc).explain_caption(
        [str(images / k) for k in keys], method="cross", prompt=PROMPT, caption="red circle")
    records = _manifest(out)
    for i, key in enumerate(keys):
        assert records[key]["status"] == "ok" and records[key]["tokens"] == ["red", "circle"]
        with np.load(out / f"{key}.cross.npz") as z:
            np.testing.assert_allclose(z["maps"], expected.image_maps[i].numpy(), rtol=1e-4, atol=1e-6)
