"""``vitexplain caption``: per-word figures, maps and JSON end to end, resume, given captions,
usage errors, help.

Offline and small: a one-layer random captioner of the zoo architecture saved as a zoo-format
checkpoint (the trained ``shapes-captioner`` weights may not be installed), 64 px images, at
most 3 generated tokens. Every run calls ``cli.main`` in-process with ``-j 0``; DataLoader
workers, torchrun and the export-specific options are covered by ``tests/test_cli.py`` (the
same driver runs both commands).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from vitexplain import cli

METHODS = ("cross", "cross_generic")
GOOD = (
    "a.png",
    "nested/deep/b c.png",
    "nested/ünïcode ✓.png",
    "-leading dash.png",
    "x#?%.jpg",
    "a<b>&'.png",
)
BAD = ("zero.png", "corrupt.png")
MAX_LEN = ("--max-len", "3")


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
def _save_tiny(folder: Path, name: str, zoo_name: str, **model_args) -> str:
    from vitexplain.zoo.models import DEFAULT_CONFIGS, build

    cfg = copy.deepcopy(DEFAULT_CONFIGS[zoo_name])
    cfg["name"] = name
    cfg["model_args"].update(model_args)
    torch.manual_seed(0)
    model = build(cfg)
    if zoo_name == "shapes-captioner":
        with torch.no_grad():  # sharper cross-attention than a random init gives
            for layer in model.layers:
                layer.cross_attn.q.weight.mul_(6.0)
    return str(vx.zoo.save_checkpoint(model, cfg, folder))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random captioner (zoo architecture and vocabulary) as a zoo-format checkpoint."""
    return _save_tiny(tmp_path_factory.mktemp("ckpt"), "tiny-captioner", "shapes-captioner",
                      enc_dim=32, enc_depth=1, enc_heads=2, dec_dim=32, dec_depth=1, dec_heads=2)


@pytest.fixture(scope="module")
def vit_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save_tiny(tmp_path_factory.mktemp("vit"), "tiny-vit", "shapes-vit", depth=1, embed_dim=32, num_heads=2)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("inputs") / "in"
    batch = vx.data.shapes(len(GOOD), seed=11)
    for i, rel in enumerate(GOOD):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(batch.images[i])).save(path, quality=95)
    png = (root / GOOD[0]).read_bytes()
    (root / "zero.png").write_bytes(b"")
    (root / "corrupt.png").write_bytes(png[:16] + bytes(range(256)) * 4)
    (root / "notes.txt").write_text("ignored: not an image extension")
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest(out: Path) -> dict[str, dict]:
    lines = (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["key"]: r for r in map(json.loads, lines)}


def _counts(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))["counts"]


def _run(*args) -> int:
    return cli.main([str(a) for a in args])


def _check_outputs(out: Path, tree: Path, ckpt: str, keys: tuple[str, ...], caption=None) -> None:
    """Every listed image's figure, .npz and JSON against ``Explainer.explain_caption``."""
    model = vx.zoo.load_checkpoint(ckpt)
    paths = [str(tree / k) for k in keys]
    expected = vx.Explainer(model).explain_caption(paths, method=list(METHODS), caption=caption, max_len=3)
    manifest = _manifest(out)
    for i, key in enumerate(keys):
        rec = manifest[key]
        tokens = expected[0].tokens[i]
        t = len(tokens)
        assert rec["status"] == "ok" and rec["error"] is None, rec
        assert rec["caption"] == expected[0].captions[i] == " ".join(tokens)
        assert rec["tokens"] == tokens and rec["ids"] == expected[0].ids[i, :t].tolist()
        assert rec["generated"] is (caption is None)
        assert (rec["width"], rec["height"], rec["box"]) == (64, 64, [0, 0, 64, 64])
        assert rec["files"]["caption"] == {"json": f"{key}.caption.json"}
        doc = json.loads((out / f"{key}.caption.json").read_text(encoding="utf-8"))
        assert doc["caption"] == rec["caption"] and doc["tokens"] == tokens and doc["ids"] == rec["ids"]
        assert doc["input"] == rec["input"] and doc["methods"] == list(METHODS)
        name = key.rsplit("/", 1)[-1]
        for e in expected:
            m = e.method
            assert rec["files"][m] == {"figure": f"{key}.{m}.png", "maps": f"{key}.{m}.npz"}
            assert doc["files"][m] == {"figure": f"{name}.{m}.png", "maps": f"{name}.{m}.npz"}
            with np.load(out / f"{key}.{m}.npz") as z:
                assert z["maps"].dtype == np.float32 and z["maps"].shape == (t, 8, 8)
                np.testing.assert_allclose(z["maps"], e.maps[i, :t].numpy(), rtol=1e-4, atol=1e-5)
                assert z["tokens"].tolist() == tokens and z["ids"].tolist() == rec["ids"]
            figure = vx.load_image(out / f"{key}.{m}.png")
            reference = e.figure(i)  # the same region (64 px), words and maps
            assert figure.shape == reference.shape
            assert np.abs(figure.astype(int) - reference.astype(int)).mean() < 0.5


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
def test_caption_resume_redoes_a_half_written_caption_json(ckpt: str, tmp_path: Path) -> None:
    """A caption JSON cut short after the run (a half-written copy) was trusted on resume; now that image
    is redone, its JSON whole again, and the summary names the file."""
    from batch_helpers import images

    src = images(tmp_path / "in", ["a.png", "b.png"])
    out = tmp_path / "out"
    common = ("caption", src, "--out", out, "--model", ckpt, *MAX_LEN, "-q", "-j", "0", "--method", "cross")
    assert _run(*common) == 0
    doc = out / "b.png.caption.json"
    whole = json.loads(doc.read_text(encoding="utf-8"))
    keep = (out / "a.png.caption.json").stat().st_ino
    doc.write_bytes(doc.read_bytes()[: len(doc.read_bytes()) // 2])
    assert _run(*common) == 0
    assert _counts(out) == {"images": 2, "ok": 1, "failed": 0, "skipped": 1}
    assert json.loads(doc.read_text(encoding="utf-8"))["caption"] == whole["caption"]
    assert (out / "a.png.caption.json").stat().st_ino == keep
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert [d["file"] for d in summary["damaged_outputs"]] == ["b.png.caption.json"]


def test_caption_end_to_end_resume_overwrite(tree: Path, ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = _snapshot(tree)
    common = ("caption", tree, "--out", out, "--model", ckpt, *MAX_LEN, "-q", "-j", "0", "-b", "4")

    assert _run(*common, "--html") == 1  # bad files: reported, the others are captioned
    manifest = _manifest(out)
    assert set(manifest) == set(GOOD) | set(BAD)
    for rel in BAD:
        rec = manifest[rel]
        assert rec["status"] == "failed" and rec["files"] == {} and rel in rec["error"]
    _check_outputs(out, tree, ckpt, GOOD)
    assert _counts(out) == {"images": len(GOOD) + len(BAD), "ok": len(GOOD), "failed": len(BAD), "skipped": 0}
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "a&lt;b&gt;&amp;&#x27;.png" in page and ".cross_generic.png" in page
    assert manifest["a.png"]["caption"] in page
    assert not list(out.glob("manifest.rank*.jsonl")) and not list(out.rglob(".*.tmp"))
    assert _snapshot(tree) == before  # inputs byte-identical, nothing written next to them

    # a rerun skips every good image (the bad ones are retried and fail again)
    inodes = {p: p.stat().st_ino for p in out.rglob("*") if p.suffix in (".png", ".npz", ".json")
              and p.name not in ("summary.json",)}
    assert _run(*common) == 1
    assert _counts(out) == {"images": len(GOOD) + len(BAD), "ok": 0, "failed": len(BAD), "skipped": len(GOOD)}
    assert {p: p.stat().st_ino for p in inodes} == inodes

    # a deleted output is redone alone; --overwrite redoes everything (new files)
    (out / f"{GOOD[1]}.cross.npz").unlink()
    assert _run(*common) == 1
    assert _counts(out)["ok"] == 1 and _counts(out)["skipped"] == len(GOOD) - 1
    for p in inodes:  # a sentinel time: a file replaced by --overwrite has a fresh one
        os.utime(p, ns=(1, 1))
    assert _run(*common, "--overwrite") == 1
    assert _counts(out)["ok"] == len(GOOD)
    assert all(p.stat().st_mtime_ns != 1 for p in inodes)
    assert set(_manifest(out)) == set(GOOD) | set(BAD)
    assert _snapshot(tree) == before


def test_given_caption_is_teacher_forced(tree: Path, ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ("caption", tree / "nested", "--out", out, "--model", ckpt, *MAX_LEN, "-q", "-j", "0")
    assert _run(*args, "--caption", "red circle") == 0
    keys = ("deep/b c.png", "ünïcode ✓.png")
    assert set(_manifest(out)) == set(keys)
    assert all(r["tokens"] == ["red", "circle"] for r in _manifest(out).values())
    _check_outputs(out, tree / "nested", ckpt, keys, caption="red circle")
    # another caption (or none) is another setting: the outputs are redone, not skipped
    assert _run(*args) == 0
    assert _counts(out) == {"images": 2, "ok": 2, "failed": 0, "skipped": 0}
    assert all(r["generated"] for r in _manifest(out).values())


# ---------------------------------------------------------------------------------------------
# usage errors and help
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (("--method", "cross,rollout"), "method 'rollout' is for vit/swin/hier models"),
        (("--method", "nope"), "unknown method 'nope'"),
        (("--caption", "red hexagon"), "'hexagon' is not in the vocabulary"),
        (("--caption", " "), "--caption is empty"),
        (("--option", "cross.nope=1"), "cross has no option 'nope'"),
        (("--option", "cross_generic.x=1", "--method", "cross"), "not among the methods run"),
        (("--max-len", "0"), "positive integer"),
        (("--amp", "bf16", "--device", "cpu"), "needs a CUDA device"),
    ],
)
def test_usage_errors_exit_2(extra, message, tree: Path, ckpt: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert _run("caption", tree / "a.png", "--out", out, "--model", ckpt, "-q", *extra) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing written before the arguments are known to be good


def test_classifier_is_refused_and_export_refuses_captioner(tree: Path, ckpt: str, vit_ckpt: str,
                                                             tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert _run("caption", tree / "a.png", "--out", out, "--model", vit_ckpt, "-q") == 2
    err = capsys.readouterr().err
    assert "is a vit model" in err and "vitexplain caption` does not explain it" in err and "vitexplain export" in err
    assert _run("export", tree / "a.png", "--out", out, "--model", ckpt, "-q") == 2
    assert "vitexplain caption" in capsys.readouterr().err
    assert not out.exists()


def test_help_lists_caption(capsys) -> None:
    assert _run("--help") == 0
    assert "caption" in capsys.readouterr().out
    assert _run("caption", "--help") == 0
    text = capsys.readouterr().out
    for word in ("--out", "--caption", "--max-len", "--method", "KEY.METHOD.npz", "KEY.caption.json",
                 "manifest.jsonl", "summary.json", "resume:", "--overwrite", "exit status:", "130"):
        assert word in text, word
    assert _run("caption", "--out", "x") == 2  # no input


# ---------------------------------------------------------------------------------------------
# the default model (the bundled shapes-captioner: missing weights fail the test)
# ---------------------------------------------------------------------------------------------
def test_default_model_shapes_captioner(tmp_path: Path) -> None:
    from vitexplain.zoo.models import caption_words

    src = tmp_path / "in"
    src.mkdir()
    batch = vx.data.shapes(3, seed=123)
    for i, image in enumerate(batch.images):
        Image.fromarray(np.ascontiguousarray(image)).save(src / f"{i}.png")
    out = tmp_path / "out"
    assert _run("caption", src, "--out", out, "-q", "-j", "0") == 0
    records = _manifest(out)
    assert len(records) == 3
    for rec in records.values():
        assert rec["status"] == "ok" and rec["tokens"], rec
        assert set(rec["tokens"]) <= set(caption_words())
        assert set(rec["files"]) == {*METHODS, "caption"}
