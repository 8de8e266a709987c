"""The bundled ``shapes-vlm``: a standard Hugging Face LLaVA with an offline processor, trained on the
shapes data; its captions and where its language model looks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import vitexplain as vx
from peers import require

transformers = require("transformers", "pip install -e '.[test]' (shapes-vlm is a Hugging Face LLaVA)")

from vitexplain.zoo import train_vlm  # noqa: E402
from vitexplain.zoo.hub import WEIGHTS_DIR  # noqa: E402
from vitexplain.zoo.vlm import IMAGE_TOKEN, PROMPT, PROMPTS, VLM_ARGS  # noqa: E402

HELD_OUT = 30_000  # fresh images: training uses seeds < 9_000, the config's own figures 10_000 / 20_000


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return vx.zoo.load("shapes-vlm")


def test_is_a_plain_llava_on_sdpa_with_its_processor(model) -> None:
    assert type(model) is transformers.LlavaForConditionalGeneration
    assert not model.training and model.zoo_name == "shapes-vlm"
    assert model.config._attn_implementation == "sdpa"
    assert model.config.text_config._attn_implementation == "sdpa"
    assert (WEIGHTS_DIR / "shapes-vlm.safetensors").stat().st_size <= 3 * 2**20
    info = vx.zoo.info("shapes-vlm")
    assert info["arch"] == "llava" and info["num_params"] == sum(p.numel() for p in model.parameters())
    proc = vx.zoo.processor("shapes-vlm")
    assert isinstance(proc, transformers.LlavaProcessor)
    assert vx.zoo.processor(model) is model.vx_processor
    assert proc.tokenizer.get_vocab() == model.vx_processor.tokenizer.get_vocab()
    with pytest.raises(vx.UsageError, match="not a vision-language model"):
        vx.zoo.processor("shapes-vit")
    with pytest.raises(vx.UsageError, match="carries no processor"):
        vx.zoo.processor(torch.nn.Linear(2, 2))


def test_processor_gives_the_shapes_normalisation_and_64_image_tokens(model) -> None:
    batch = vx.data.shapes(3, seed=HELD_OUT)
    inp = model.vx_processor(images=list(batch.images), text=[PROMPT, PROMPTS[1], PROMPT], return_tensors="pt",
                             padding=True)
    torch.testing.assert_close(inp["pixel_values"], vx.data.normalize(batch.images), atol=1e-6, rtol=0)
    image_id = model.config.image_token_index
    assert model.vx_processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == image_id
    assert ((inp["input_ids"] == image_id).sum(1) == 64).all()
    # left-padded: the shorter prompt's row starts with <pad>, every row ends with the prompt's last word
    words = PROMPT.split()[1:]
    ids = model.vx_processor.tokenizer.convert_tokens_to_ids(words)
    assert inp["input_ids"][0, -len(ids):].tolist() == ids
    assert inp["attention_mask"][0, 0] == 0 and inp["attention_mask"][1].all()


def test_captions_held_out_images(model) -> None:
    # the config's own figure is on seed 10_000; this is a fresh draw
    measured = vx.zoo.info("shapes-vlm")["metrics"]["eval"]["caption_acc"]
    from vitexplain.zoo.vlm import caption_accuracy

    n = 100
    got = caption_accuracy(model, model.vx_processor, n=n, seed=HELD_OUT)
    se = (measured * (1 - measured) / n) ** 0.5
    floor = measured - 3 * se - 0.01  # measured on seed 10_000 (500 images) minus 3 SE of 100 images
    print(f"shapes-vlm caption accuracy {got['caption_acc']:.3f} (config {measured:.3f}, floor {floor:.3f})")
    assert got["caption_acc"] >= floor


def test_language_model_attends_to_the_named_object(model) -> None:
    """Raw attention of the row that predicts each colour/shape word, mean over layers and heads,
    read from an eager copy (the model itself stays on SDPA), points at that word's object."""
    measured = vx.zoo.info("shapes-vlm")["metrics"]["pointing_raw_attention"]["pointing"]
    got = train_vlm.attention_pointing(model, model.vx_processor, n=50, seed=HELD_OUT)
    se = (measured * (1 - measured) / got["n_words"]) ** 0.5
    floor = measured - 3 * se  # measured on 800 words of seed 20_000, minus 3 SE of these 200 words
    print(f"shapes-vlm raw attention pointing {got['pointing']:.3f} over {got['n_words']} words, floor {floor:.3f}")
    assert got["n_words"] == 200
    assert got["pointing"] >= floor
    assert model.config._attn_implementation == "sdpa"  # the copy was eager, not the model


def test_missing_transformers_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(vx.UsageError, match="needs the `transformers`"):
        vx.zoo.load("shapes-vlm")
    with pytest.raises(vx.UsageError, match="pip install"):
        vx.zoo.processor("shapes-vlm")


def test_training_script_runs_and_reloads(tmp_path: Path) -> None:
    assert train_vlm.main(["--out", str(tmp_path), "--steps", "2", "--batch-size", "4", "--qa-every", "2",
                           "--eval-images", "4", "--pointing-images", "2", "--log-every", "1"]) == 0
    cfg = json.loads((tmp_path / "shapes-vlm.json").read_text())
    assert cfg["arch"] == "llava" and cfg["model_args"] == VLM_ARGS and cfg["training"]["steps"] == 2
    assert cfg["metrics"]["pointing_raw_attention"]["n_words"] == 8  # 2 images x (2 colours + 2 shapes)
    reloaded = vx.zoo.load("shapes-vlm", weights_dir=tmp_path)
    assert type(reloaded) is transformers.LlavaForConditionalGeneration and not reloaded.training


#: Per-word pointing on 800 words (200 two-object images, seed 20_000), measured by
#: `python benchmarks/vlm_pointing.py` (docs/benchmarks.md, "VLM per-word pointing (shapes-vlm)").
MEASURED_POINTING = {"cross": 0.988, "cross_generic": 0.963}


def test_vlm_methods_point_at_the_word_s_object(model) -> None:
    """The family's ground truth: each colour / shape word's map (teacher-forced reference caption)
    peaks on the object the word names, on fresh two-object images."""
    from vitexplain.data import COLORS, SHAPES

    ex = vx.Explainer(model, processor=vx.zoo.processor(model))
    batch = vx.data.shapes(50, seed=HELD_OUT, num_objects=2)
    content = set(COLORS) | set(SHAPES)
    hits: dict[str, list[bool]] = {m: [] for m in MEASURED_POINTING}
    for s in range(0, len(batch), 25):
        sub = batch[s: s + 25]
        for e in ex.explain_caption(list(sub.images), method=list(MEASURED_POINTING), caption=sub.captions,
                                    prompt="describe the image"):
            for i, caption in enumerate(sub.captions):
                assert e.tokens[i][: len(caption.split())] == caption.split()
                for w, (word, obj) in enumerate(zip(caption.split(), sub.word_objects[i])):
                    if word in content:
                        hits[e.method].append(bool(vx.metrics.pointing_game(e.maps[i, w][None], sub.masks[i][obj][None])[0]))
    for method, measured in MEASURED_POINTING.items():
        got = sum(hits[method]) / len(hits[method])
        floor = measured - 3 * (measured * (1 - measured) / len(hits[method])) ** 0.5  # measured - 3 SE of 200 words
        print(f"shapes-vlm {method} per-word pointing {got:.3f} over {len(hits[method])} words (floor {floor:.3f})")
        assert len(hits[method]) == 200 and got >= floor, method


def test_explainer_takes_the_zoo_models_own_processor(model) -> None:
    """``vx.Explainer(vx.zoo.load("shapes-vlm"))`` explains with ``model.vx_processor``, as ``explore`` and the
    caption command do (it asked for ``AutoProcessor.from_pretrained(path)``, a path the zoo model has none of)."""
    images = list(vx.data.shapes(2, seed=HELD_OUT + 7, num_objects=2).images)
    got = vx.Explainer(model).explain_caption(images, method="cross", prompt=PROMPT, max_len=4)
    want = vx.Explainer(model, processor=vx.zoo.processor("shapes-vlm")).explain_caption(images, method="cross",
                                                                                         prompt=PROMPT, max_len=4)
    assert got.tokens == want.tokens and all(len(t) for t in got.tokens)
    for a, b in zip(got.image_maps, want.image_maps):
        torch.testing.assert_close(a, b)
