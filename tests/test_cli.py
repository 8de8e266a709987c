"""The ``vitexplain`` command line: export end to end, resume, gallery, usage errors, torchrun.

Offline and small: a 2-block ViT of the zoo architecture (random weights) saved as a zoo-format
checkpoint, 64 px images. Most runs call ``cli.main`` in-process; one runs ``python -m
vitexplain`` and one ``torchrun`` (two CPU processes, gloo) as subprocesses.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import torch
from PIL import Image

import vitexplain as vx
from vitexplain import cli
from vitexplain.batch.inputs import discover_inputs
from vitexplain.errors import UsageError

METHODS = ("rollout", "cdam")
DEFAULTS = ("generic", "legrad")  # export's default methods for ViTs
GOOD = (
    "a.png",
    "nested/deep/b c.png",
    "nested/ünïcode ✓.png",
    "-leading dash.png",
    "x#?%.jpg",
    "a<b>&'.png",
)
BAD = ("zero.png", "text.png", "corrupt.png", "nested/trunc.png", "dangling.png")


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vitexplain.zoo.models import DEFAULT_CONFIGS, build

    cfg = copy.deepcopy(DEFAULT_CONFIGS["shapes-vit"])
    cfg["name"] = "tiny-vit"
    cfg["model_args"].update(depth=2, embed_dim=48, num_heads=2)
    torch.manual_seed(0)
    return str(vx.zoo.save_checkpoint(build(cfg), cfg, tmp_path_factory.mktemp("ckpt")))


def _make_tree(root: Path, good=GOOD, bad=BAD) -> Path:
    batch = vx.data.shapes(len(good) + 1, seed=7)
    for i, rel in enumerate(good):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(batch.images[i])).save(path, quality=95)
    png = (root / good[0]).read_bytes()
    writers = {
        "zero.png": lambda p: p.write_bytes(b""),
        "text.png": lambda p: p.write_text("this is not an image\n"),
        "corrupt.png": lambda p: p.write_bytes(png[:16] + bytes(range(256)) * 4),
        "nested/trunc.png": lambda p: p.write_bytes(png[: len(png) // 2]),
        "dangling.png": lambda p: os.symlink(root / "missing-target.png", p),
    }
    for rel in bad:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        writers[rel](path)
    (root / "notes.txt").write_text("ignored: not an image extension")
    (root / ".hidden.png").write_bytes(png)  # hidden entries are skipped while walking
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_tree(tmp_path_factory.mktemp("inputs") / "in")


def _snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha1 (or link target) of everything under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = "link:" + os.readlink(p) if p.is_symlink() else hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def _manifest(out: Path) -> dict[str, dict]:
    lines = (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    return {r["key"]: r for r in records}


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def _outputs(out: Path) -> set[str]:
    return {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}


def _run(*args: str) -> int:
    return cli.main([str(a) for a in args])


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
def test_export_end_to_end_resume_overwrite(tree: Path, ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = _snapshot(tree)
    common = ("export", tree, "--out", out, "--model", ckpt, "--method", "rollout,cdam", "-q", "-b", "3")

    # workers=2: bad files are decoded (and fail) inside DataLoader worker processes
    assert _run(*common, "--workers", "2", "--save-maps", "--html") == 1
    manifest = _manifest(out)
    assert set(manifest) == set(GOOD) | set(BAD)
    for rel in GOOD:
        rec = manifest[rel]
        assert rec["status"] == "ok", rec
        assert (rec["width"], rec["height"]) == (64, 64)
        assert len(rec["predictions"]) == 5 and rec["predictions"][0]["label"] in vx.data.SHAPES
        assert rec["target"]["index"] == rec["predictions"][0]["index"]
        assert set(rec["files"]) == set(METHODS)
        for method in METHODS:
            png = out / f"{rel}.{method}.png"
            assert rec["files"][method] == {"overlay": f"{rel}.{method}.png", "map": f"{rel}.{method}.npy"}
            shape = vx.load_image(png).shape  # 64 px inputs are drawn enlarged 4x (--min-side 256)
            assert shape[1:] == (256, 3) and (shape[0] > 256 if method == "cdam" else shape[0] == 256)  # cdam: colour bar
            assert np.load(out / f"{rel}.{method}.npy").shape == (8, 8)
    for rel in BAD:
        rec = manifest[rel]
        assert rec["status"] == "failed" and rec["files"] == {}
        assert os.path.basename(rel) in rec["error"]
    summary = _summary(out)
    assert summary["counts"] == {"images": len(GOOD) + len(BAD), "ok": len(GOOD), "failed": len(BAD), "skipped": 0}
    assert summary["versions"]["vitexplain"] == vx.__version__ and "timm" in summary["versions"]
    assert summary["timings"]["images_per_s"] > 0 and summary["arguments"]["methods"] == list(METHODS)
    assert not list(out.glob("manifest.rank*.jsonl")) and not list(out.rglob(".*.tmp"))
    # inputs untouched, nothing written next to them
    assert _snapshot(tree) == before

    # a second run skips every good image (bad ones are retried and fail again)
    inodes = {p: p.stat().st_ino for p in out.rglob("*.png")}
    assert _run(*common, "--save-maps") == 1
    assert _summary(out)["counts"] == {"images": len(GOOD) + len(BAD), "ok": 0, "failed": len(BAD), "skipped": len(GOOD)}
    assert {p: p.stat().st_ino for p in out.rglob("*.png")} == inodes
    assert set(_manifest(out)) == set(GOOD) | set(BAD)

    # --overwrite redoes everything (files are replaced; inode numbers can be recycled, so a
    # sentinel modification time tells a new file from the old one)
    for p in inodes:
        os.utime(p, ns=(1, 1))
    assert _run(*common, "--save-maps", "--overwrite") == 1
    assert _summary(out)["counts"]["ok"] == len(GOOD)
    assert all(p.stat().st_mtime_ns != 1 for p in inodes)

    # a changed setting makes the outputs stale: everything is redone
    assert _run(*common, "--alpha", "0.3", "--option", "rollout.discard_ratio=0.5") == 1
    assert _summary(out)["counts"]["ok"] == len(GOOD)
    assert _snapshot(tree) == before


def test_resume_redoes_changed_inputs(ckpt: str, tmp_path: Path) -> None:
    src = _make_tree(tmp_path / "in", good=GOOD[:3], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "-q", "-j", "0")
    assert _run(*args) == 0
    # a modified input and a deleted output are redone; the rest is skipped
    target = src / GOOD[0]
    Image.fromarray(np.full((64, 64, 3), 200, np.uint8)).save(target)
    os.utime(target, ns=(1, 1))
    (out / f"{GOOD[1]}.{DEFAULTS[-1]}.png").unlink()
    assert _run(*args) == 0
    assert _summary(out)["counts"] == {"images": 3, "ok": 2, "failed": 0, "skipped": 1}


@pytest.mark.parametrize("damage", ["truncated overlay", "same-size map", "emptied overlay"])
def test_resume_redoes_damaged_outputs_and_says_so(damage: str, ckpt: str, tmp_path: Path, capsys) -> None:
    """An output damaged after the run (a PNG cut short, bytes of a map overwritten in place, a file
    emptied) made its image count as current on resume: it was skipped and the damage stayed. Now it is
    redone (as first written, up to float rounding), the other images' files are left as they are, and the run
    says so."""
    src = _make_tree(tmp_path / "in", good=GOOD[:3], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "--save-maps", "-q", "-j", "0")
    assert _run(*args) == 0
    victim_key = GOOD[1]
    victim = out / f"{victim_key}.rollout.{'npy' if damage == 'same-size map' else 'png'}"
    original = victim.read_bytes()
    others = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*.rollout.*")
              if not p.name.startswith(f"{Path(victim_key).name}.")}  # the other images' files
    assert len(others) == 4
    if damage == "truncated overlay":
        victim.write_bytes(original[: len(original) // 2])
    elif damage == "same-size map":
        victim.write_bytes(original[:-4] + bytes(b ^ 0xFF for b in original[-4:]))  # the last float flipped
    else:
        victim.write_bytes(b"")
    capsys.readouterr()
    assert _run(*args) == 0
    assert _summary(out)["counts"] == {"images": 3, "ok": 1, "failed": 0, "skipped": 2}
    if victim.suffix == ".npy":  # redone alone, not in a batch of 3: equal up to float rounding
        np.testing.assert_allclose(np.load(victim), np.load(io.BytesIO(original)), rtol=1e-4, atol=1e-6)
    else:
        redone = vx.load_image(victim).astype(int) - vx.load_image(io.BytesIO(original)).astype(int)
        assert np.abs(redone).max() <= 2
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in others} == others
    (entry,) = _summary(out)["damaged_outputs"]
    assert entry["input"] == str(src / victim_key) and entry["file"] == victim.relative_to(out).as_posix()
    err = capsys.readouterr().err
    assert victim.relative_to(out).as_posix() in err and "redo" in err
    # the redone image is trusted again: a third run skips everything
    assert _run(*args) == 0
    assert _summary(out)["counts"]["skipped"] == 3 and _summary(out)["damaged_outputs"] == []


def _age_manifest(out: Path) -> None:
    """Date ``manifest.jsonl`` a second after the newest output, as a run that wrote its outputs before
    merging its manifest leaves it (a tiny test run can do both within one tick of a coarse file clock)."""
    newest = max(p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file())
    os.utime(out / "manifest.jsonl", ns=(newest + 10**9, newest + 10**9))


def _opened_outputs(monkeypatch, outputs: set[str]) -> list[str]:
    """The paths among ``outputs`` that ``open`` is called with from now on (in call order)."""
    import builtins

    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) in outputs:
            opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    return opened


def test_resume_of_an_untouched_run_reads_no_output(ckpt: str, tmp_path: Path, monkeypatch) -> None:
    """Resuming re-read every output file it skipped to hash it (GBs for a 100k-image run). Now a file
    whose size and modification time are as recorded is trusted without being opened; one rewritten
    to the same size (a new mtime) is still hashed, found and redone."""
    src = _make_tree(tmp_path / "in", good=GOOD[:3], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "--save-maps", "-q", "-j", "0")
    assert _run(*args) == 0
    outputs = {str(p) for p in out.rglob("*.rollout.*")}
    assert len(outputs) == 6
    _age_manifest(out)
    opened = _opened_outputs(monkeypatch, outputs)
    assert _run(*args) == 0
    assert _summary(out)["counts"]["skipped"] == 3 and opened == []
    # a same-size rewrite gets a new mtime: that file (only) is read, found changed and redone
    victim = out / f"{GOOD[2]}.rollout.npy"
    data = victim.read_bytes()
    opened.clear()
    _age_manifest(out)
    victim.write_bytes(data[:-4] + bytes(b ^ 0xFF for b in data[-4:]))
    os.utime(victim, ns=(1, 1))  # unmistakably another mtime, even on a coarse file clock
    assert _run(*args) == 0
    assert _summary(out)["counts"] == {"images": 3, "ok": 1, "failed": 0, "skipped": 2}
    assert opened == [str(victim)]
    assert [d["file"] for d in _summary(out)["damaged_outputs"]] == [victim.relative_to(out).as_posix()]


def test_resume_rereads_outputs_with_new_mtimes_once(ckpt: str, tmp_path: Path, monkeypatch) -> None:
    """Outputs copied without their times (``cp -r``: every mtime new, the content the same) are read and hashed
    once; their records then note the new mtimes, so the next resume reads none again (it re-read them all on
    every resume)."""
    src = _make_tree(tmp_path / "in", good=GOOD[:3], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "--save-maps", "-q", "-j", "0")
    assert _run(*args) == 0
    outputs = {str(p) for p in out.rglob("*.rollout.*")}
    for i, path in enumerate(sorted(outputs)):
        os.utime(path, ns=(10**9 * (i + 1), 10**9 * (i + 1)))  # as a copy leaves them: other times, same bytes
    _age_manifest(out)
    opened = _opened_outputs(monkeypatch, outputs)
    assert _run(*args) == 0
    assert _summary(out)["counts"]["skipped"] == 3 and sorted(opened) == sorted(outputs)
    assert _summary(out)["damaged_outputs"] == []
    opened.clear()
    _age_manifest(out)
    assert _run(*args) == 0
    assert _summary(out)["counts"]["skipped"] == 3 and opened == []
    for rec in _manifest(out).values():  # the records, refreshed, still list every file's digest
        assert sorted(rec["checksums"]) == sorted(rec["files"]["rollout"].values())


def test_resume_trusts_records_of_an_older_version_and_says_so(ckpt: str, tmp_path: Path, capsys) -> None:
    """Records written before the checksums (no ``"checksums"``) were all redone and reported as damaged.
    Now they are trusted as that version did (each file there, a regular file), counted under
    ``unverified_outputs`` and named once on stderr with the way to redo them; a missing file is still redone."""
    src = _make_tree(tmp_path / "in", good=GOOD[:3], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "-q", "-j", "0")
    assert _run(*args) == 0
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]
    for r in records:
        del r["checksums"]
    (out / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (out / f"{GOOD[0]}.rollout.png").unlink()
    capsys.readouterr()
    assert _run(*args) == 0
    summary = _summary(out)
    assert summary["counts"] == {"images": 3, "ok": 1, "failed": 0, "skipped": 2}
    assert summary["unverified_outputs"] == 2
    assert [d["file"] for d in summary["damaged_outputs"]] == [f"{GOOD[0]}.rollout.png"]
    err = capsys.readouterr().err
    assert err.count("without checksums") == 1 and "2 images" in err and "--overwrite" in err
    # the redone image has checksums now; the others stay unverified until redone
    assert _run(*args) == 0
    assert _summary(out)["unverified_outputs"] == 2 and _summary(out)["damaged_outputs"] == []
    assert _run(*args, "--overwrite") == 0
    assert _run(*args) == 0
    assert _summary(out)["unverified_outputs"] == 0 and _summary(out)["counts"]["skipped"] == 3


def test_save_maps_equal_explainer(tree: Path, ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _run("export", tree / "nested", "--out", out, "--model", ckpt, "--save-maps", "-q", "-j", "0") == 1
    model = vx.zoo.load_checkpoint(ckpt)
    paths = [tree / "nested/deep/b c.png", tree / "nested/ünïcode ✓.png"]
    explanations = vx.Explainer(model).explain([str(p) for p in paths], method=list(DEFAULTS))
    for e in explanations:
        for i, key in enumerate(["deep/b c.png", "ünïcode ✓.png"]):
            saved = np.load(out / f"{key}.{e.method}.npy")
            np.testing.assert_allclose(saved, e.maps[i].numpy(), rtol=1e-4, atol=1e-6)
    rec = _manifest(out)["deep/b c.png"]
    assert rec["target"]["index"] == int(explanations[0].targets[0])


def test_html_gallery(tree: Path, ckpt: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _run("export", tree, "--out", out, "--model", ckpt, "--html", "-q", "-j", "0", "--target", "square") == 1
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "a&lt;b&gt;&amp;&#x27;.png" in page and "<b>" not in page
    links = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert links
    for link in links:
        assert not link.startswith(("/", "file:", "http")), link
        target = out / unquote(link)  # relative to the page, percent-encoded
        assert target.is_file() or target.name == "dangling.png", link
    for rel in GOOD:
        assert f'src="{_quote(rel)}.generic.png"' in page
    assert "square" in page  # the target label
    assert page.count('class="failed"') == len(BAD)
    assert all(r["target"]["label"] == "square" for r in _manifest(out).values() if r["status"] == "ok")


def _quote(rel: str) -> str:
    from urllib.parse import quote

    return quote(rel, safe="/")


def test_interrupt_leaves_no_partial_files_and_resumes(ckpt: str, tmp_path: Path, monkeypatch) -> None:
    from vitexplain.batch import decoding as export_mod

    src = _make_tree(tmp_path / "in", good=GOOD[:5], bad=())
    out = tmp_path / "out"
    args = ("export", src, "--out", out, "--model", ckpt, "-q", "-j", "0", "-b", "2")
    original = export_mod.ImageDataset.__getitem__

    def interrupting(self, i):
        if i == 3:
            raise KeyboardInterrupt
        return original(self, i)

    monkeypatch.setattr(export_mod.ImageDataset, "__getitem__", interrupting)
    assert _run(*args) == 130
    assert not list(out.rglob(".*.tmp"))
    done = _manifest(out)
    assert len(done) == 2 and all(r["status"] == "ok" for r in done.values())
    monkeypatch.setattr(export_mod.ImageDataset, "__getitem__", original)
    assert _run(*args) == 0
    assert _summary(out)["counts"] == {"images": 5, "ok": 3, "failed": 0, "skipped": 2}


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_timm_model_with_checkpoint(fmt: str, tree: Path, tmp_path: Path, capsys) -> None:
    import timm

    kwargs = dict(img_size=64, patch_size=16, num_classes=3, depth=2)
    torch.manual_seed(1)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    path = tmp_path / f"weights.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:  # a training checkpoint: the weights under "model", DDP prefix, extra entries
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    out = tmp_path / "out"
    args = ["export", tree / "a.png", "--out", out, "--model", "vit_tiny_patch16_224", "--checkpoint", path,
            "--model-arg", "img_size=64", "--model-arg", "depth=2", "--method", "rollout", "--save-maps", "-q", "-j", "0"]
    assert _run(*args) == 0  # num_classes (3) comes from the checkpoint's head
    # timm keeps the 224 px pretrained_cfg for img_size=64 (the CLI corrects it the same way)
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, 64, 64)}
    expected = vx.Explainer(model).explain([str(tree / "a.png")], method="rollout").maps[0].numpy()
    np.testing.assert_allclose(np.load(out / "a.png.rollout.npy"), expected, rtol=1e-4, atol=1e-6)
    assert _run(*args, "--num-classes", "7") == 2  # the head does not fit
    assert "does not fit the model" in capsys.readouterr().err


def test_readme_first_command_default_model(tmp_path: Path) -> None:
    """The README's first command: the bundled shapes-vit on the bundled samples. Both ship with the
    repository, so a missing one fails this test (it is not skipped)."""
    samples = Path(__file__).resolve().parent.parent / "assets" / "samples"
    assert samples.is_dir(), f"{samples} is missing: the sample images ship with the repository"
    out = tmp_path / "maps"
    assert _run("export", samples, "--out", out, "--html", "-q", "-j", "0") == 0
    records = _manifest(out)
    assert records and all(r["status"] == "ok" and set(r["files"]) == set(DEFAULTS) for r in records.values())
    # readable at a glance: 64 px samples drawn at 256 px, each overlay labelled with its target
    assert all(vx.load_image(out / f["overlay"]).shape == (256, 256, 3) for r in records.values() for f in r["files"].values())
    page = (out / "index.html").read_text(encoding="utf-8")
    assert all(f'<div class="cap">generic: {r["target"]["label"]}</div>' in page for r in records.values())


# ---------------------------------------------------------------------------------------------
# input discovery
# ---------------------------------------------------------------------------------------------
def test_discover_inputs_keys_globs_and_safety(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for rel in ("a/x.png", "a/sub/y.JPG", "b/x.png", "a/[odd].png", "a/skip.txt", "out/old.png"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    keys = [it.key for it in discover_inputs(["a", "b"], "out")]
    # a collision prefixes every colliding key with its input folder's name, whatever the order
    assert keys == ["[odd].png", "a/x.png", "b/x.png", "sub/y.JPG"]
    assert [it.key for it in discover_inputs(["b", "a"], "out")] == keys
    # globs: the fixed prefix is the root; .. never escapes; out is skipped
    items = discover_inputs(["*/../a/**/*.png", "a/[odd].png"], "out")  # same files: listed once,
    assert [it.key for it in items] == ["[odd].png", "a/x.png"]  # under their shortest key
    items = discover_inputs(["a/../b/x.png", "**/*.png"], "out")
    assert [it.key for it in items] == ["a/[odd].png", "a/x.png", "x.png"]
    for it in items:
        assert ".." not in it.key.split("/") and not it.path.startswith("out")
    assert {it.key for it in discover_inputs(["."], "out")} == {"a/x.png", "a/sub/y.JPG", "b/x.png", "a/[odd].png"}
    # names differing only by case in one folder: told apart by a hash of the file, not the folder
    for name in ("c/Q.png", "c/q.png"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    keys = sorted(it.key for it in discover_inputs(["c"], "out"))
    assert len(keys) == 2 and len({k.casefold() for k in keys}) == 2
    assert all(re.fullmatch(r"[Qq]~[0-9a-f]{8}\.png", k) for k in keys), keys
    with pytest.raises(UsageError, match="next to the"):
        discover_inputs(["a"], "a")
    with pytest.raises(UsageError, match="no such file"):
        discover_inputs(["nope"], "out")
    with pytest.raises(UsageError, match="no file matches"):
        discover_inputs(["nope/*.png"], "out")


# ---------------------------------------------------------------------------------------------
# usage errors and help
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, message",
    [
        (("--method", "rollout,nope"), "unknown method 'nope'"),
        (("--model", "no_such_model_xyz"), "unknown model 'no_such_model_xyz'"),
        (("--amp", "bf16", "--device", "cpu"), "needs a CUDA device"),
        (("--target", "hexagon"), "unknown label"),
        (("--batch-size", "0"), "positive integer"),
        (("--checkpoint", "missing.safetensors"), "no such file"),
        (("--checkpoint", "."), "is a folder; pass the weights file in it"),
        (("--model", "vit_tiny_patch16_224", "--model-arg", "pretrained=True"), "cannot be downloaded"),
        (("--model", "vit_tiny_patch16_224", "--model-arg", "num_classes=0", "--model-arg", "depth=1",
          "--model-arg", "img_size=64"), "has no classifier head (its output is an embedding)"),
        (("--method", "rollout", "--option", "rollout.nope=1"), "rollout has no option 'nope'"),
        (("--option", "cdam"), "METHOD.KEY=VALUE"),
        (("--method", "rollout", "--option", "rollout.discard_ratio=0.5", "--option", "rollout.discard_ratio=0.7"),
         "--option rollout.discard_ratio is given twice, as 0.5 and 0.7"),
        (("--model", "vit_tiny_patch16_224", "--model-arg", "depth=1", "--model-arg", "depth=2"),
         "--model-arg depth is given twice"),
    ],
)
def test_usage_errors_exit_2(extra, message, tree: Path, ckpt: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = ["export", tree, "--out", out, "-q"]
    if "--model" not in extra:
        args += ["--model", ckpt]
    assert _run(*args, *extra) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing written before the arguments are known to be good


def test_labels_file_names_the_classes_and_must_have_one_name_per_class(tree: Path, ckpt: str, tmp_path: Path,
                                                                       capsys) -> None:
    classes = vx.zoo.load_checkpoint(ckpt).num_classes
    names = [f"class {i}" for i in range(classes)]
    short = tmp_path / "short.txt"
    short.write_text("\n".join(names[:2]) + "\n", encoding="utf-8")
    out = tmp_path / "short"
    # fewer names than classes: the other classes would get no name and the file's order is in doubt
    assert _run("export", tree / "a.png", "--out", out, "--model", ckpt, "--labels", short, "-q") == 2
    assert f"has 2 names (non-empty lines) but the model has {classes} classes" in capsys.readouterr().err
    assert not out.exists()
    good = tmp_path / "labels.txt"
    good.write_text("\n".join(names) + "\n", encoding="utf-8")
    out = tmp_path / "good"
    assert _run("export", tree / "a.png", "--out", out, "--model", ckpt, "--labels", good, "-q") == 0
    record = json.loads((out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert record["predictions"] and all(p["label"] == f"class {p['index']}" for p in record["predictions"])


def test_overlays_enlarged_for_legibility_still_respect_max_side(ckpt: str, tmp_path: Path) -> None:
    # --min-side (default 256) enlarges small regions; --max-side bounds the longer side of every overlay:
    # a 64 px crop with --max-side 100, and a thin strip whose whole-factor enlargement would be 6000 px long
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "square.png")
    Image.fromarray(rng.integers(0, 256, (40, 900, 3), dtype=np.uint8)).save(tmp_path / "strip.png")
    for name, extra, limit in (("square.png", ("--max-side", "100"), 100), ("strip.png", ("--no-crop",), 512)):
        out = tmp_path / f"out-{name}"
        assert _run("export", tmp_path / name, "--out", out, "--model", ckpt, "--method", "rollout", "-q", *extra) == 0
        with Image.open(out / f"{name}.rollout.png") as im:
            assert max(im.size) <= limit, (name, im.size)


def test_a_checkpoint_holding_a_whole_pickled_model_is_refused_with_what_to_save_instead(tree: Path, tmp_path: Path,
                                                                                         capsys) -> None:
    path = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(2, 3), path)  # the module object itself, not its state dict
    out = tmp_path / "out"
    assert _run("export", tree / "a.png", "--out", out, "--model", "vit_tiny_patch16_224", "--checkpoint", path,
                "-q") == 2
    err = capsys.readouterr().err
    assert "holds pickled Python objects" in err and "model.state_dict()" in err
    assert "weights_only" not in err  # torch's advice (load with weights_only=False) is not an option here
    assert not out.exists()


def test_out_inside_inputs(tree: Path, ckpt: str, capsys) -> None:
    assert _run("export", tree, "--out", tree, "--model", ckpt, "-q") == 2
    assert "next to the inputs" in capsys.readouterr().err


def test_help_methods_models(capsys, ckpt: str) -> None:
    assert _run("--help") == 0
    assert "export" in capsys.readouterr().out
    assert _run("export", "--help") == 0
    text = capsys.readouterr().out
    assert "--out" in text and "--save-maps" in text and "manifest.jsonl" in text
    assert _run("methods") == 0
    text = capsys.readouterr().out
    assert "vit methods:" in text and re.search(r"^\s+cdam\s+.*signed", text, re.M)
    assert _run("methods", "--model", ckpt) == 0
    assert "is a vit model" in capsys.readouterr().out
    assert _run("models") == 0
    assert "shapes-vit" in capsys.readouterr().out
    assert _run() == 2  # no command


def test_help_is_light() -> None:
    code = "import sys, vitexplain.cli as c; c.build_parser(); print(sorted(m for m in ('torch','timm','cv2') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------
# subprocesses: python -m vitexplain, torchrun
# ---------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    root = str(Path(vx.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_m_vitexplain_exit_codes(tmp_path: Path) -> None:
    # Quick: neither --help nor an argparse error imports torch. The torchrun test below runs
    # a whole export through ``-m vitexplain`` in subprocesses (exit status 1: bad files).
    ok = subprocess.run([sys.executable, "-m", "vitexplain", "export", "--help"],
                        capture_output=True, text=True, env=_env(), timeout=120)
    assert ok.returncode == 0 and "--out" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "vitexplain", "export", str(tmp_path)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert bad.returncode == 2 and "--out" in bad.stderr


def test_torchrun_two_processes_match_one(tree: Path, ckpt: str, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["export", str(tree), "--model", ckpt, "--save-maps", "--html", "-q", "-j", "0", "-b", "2"]
    assert _run(*args, "--out", one) == 1
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "vitexplain", *args, "--out", str(two)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert (two / "summary.json").is_file(), res.stderr[-3000:]
    assert res.returncode == 1  # bad files: every rank exits 1, after rank 0 has merged
    assert "failed: cannot load image" in res.stderr and "text.png" in res.stderr
    assert _outputs(one) == _outputs(two)
    assert not list(two.glob("manifest.rank*.jsonl"))
    m1, m2 = _manifest(one), _manifest(two)
    assert set(m1) == set(m2)
    assert {r["rank"] for r in m2.values()} == {0, 1}
    for key in m1:
        a, b = m1[key], m2[key]
        for field in ("status", "files", "input", "source", "width", "height", "box", "config_hash"):
            assert a.get(field) == b.get(field), (key, field)
        if a["status"] == "ok":
            assert a["target"] == b["target"]
            assert [p["index"] for p in a["predictions"]] == [p["index"] for p in b["predictions"]]
            for m in DEFAULTS:
                np.testing.assert_allclose(np.load(one / a["files"][m]["map"]), np.load(two / b["files"][m]["map"]),
                                           rtol=1e-4, atol=1e-6)
    s1, s2 = _summary(one), _summary(two)
    assert s1["counts"] == s2["counts"] and s2["world_size"] == 2


# ---------------------------------------------------------------------------------------------
# the options base: one declaration per option
# ---------------------------------------------------------------------------------------------
def _flags(parser_action_groups) -> set[str]:
    return {s for a in parser_action_groups for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_cli_flags_and_resume_key_derive_from_the_options() -> None:
    import argparse
    import dataclasses

    from vitexplain.batch.caption import CaptionOptions
    from vitexplain.batch.export import ExportOptions
    from vitexplain.batch.options import add_arguments, option, output_settings, specs
    from vitexplain.batch.setup import config_hash

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, cls in (("export", ExportOptions), ("caption", CaptionOptions)):
        declared = {flag for _, spec in specs(cls) for flag in spec.flags if flag.startswith("--")}
        assert _flags(sub.choices[command]._actions) == declared, command
        outputs = {f.name for f, spec in specs(cls) if spec.outputs}
        assert set(output_settings(cls(inputs=["x"], out="o"))) == outputs
    assert {"model", "methods", "method_options", "alpha", "crop", "save_maps"} <= {
        f.name for f, s in specs(ExportOptions) if s.outputs}
    assert not {"batch_size", "workers", "quiet", "overwrite", "html"} & {
        f.name for f, s in specs(ExportOptions) if s.outputs}

    # a new output option is one field: it gets its flag, its help and its place in the resume key
    @dataclasses.dataclass
    class WithGamma(ExportOptions):
        gamma: float = option(1.0, flags="--gamma", metavar="G", outputs=True, group="overlays",
                              help="overlay gamma (default {default})")

    p = argparse.ArgumentParser()
    add_arguments(p, WithGamma, {"model": "m", "explanation": "e", "overlays": "o", "running": "r"})
    assert "overlay gamma (default 1.0)" in p.format_help()
    from vitexplain.batch.options import from_args

    opts = from_args(WithGamma, p.parse_args(["in", "--out", "o", "--gamma", "2.2"]))
    assert opts.gamma == 2.2
    assert config_hash(opts, {})[1] != config_hash(dataclasses.replace(opts, gamma=1.0), {})[1]
    assert config_hash(opts, {})[1] == config_hash(dataclasses.replace(opts, batch_size=7), {})[1]


def test_build_loaded_equals_ordinary_loading_or_declines() -> None:
    from torch import nn

    from vitexplain.zoo.hub import build_loaded

    def net() -> nn.Module:  # 4.2M parameters: above the size where the meta device pays off
        return nn.Sequential(nn.Linear(3, 2048), nn.LayerNorm(2048), nn.Linear(2048, 2048))

    torch.manual_seed(0)
    ref = net().eval()
    state = {k: v.half() for k, v in ref.state_dict().items()}  # a half-precision checkpoint
    loaded = build_loaded(net, state).eval()
    expected = net().eval()
    expected.load_state_dict(state)  # what ordinary loading gives (cast to float32)
    x = torch.randn(5, 3)
    assert all(p.dtype == torch.float32 and not p.is_meta for p in loaded.parameters())
    assert torch.equal(loaded(x), expected(x))
    small = {k: v for k, v in nn.Linear(3, 4).state_dict().items()}  # tiny: the ordinary path is quicker
    assert build_loaded(lambda: nn.Linear(3, 4), small) is None

    class WithBuffer(nn.Module):  # a buffer not in the state dict would stay on the meta device
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2048, 2048)
            self.register_buffer("table", torch.arange(3.0), persistent=False)

    class Tied(nn.Module):  # assigning would untie the weights
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2048, 2048)
            self.b = nn.Linear(2048, 2048)
            self.b.weight = self.a.weight

    assert build_loaded(WithBuffer, WithBuffer().state_dict()) is None
    assert build_loaded(Tied, Tied().state_dict()) is None
    assert build_loaded(net, {k: v for k, v in state.items() if k != "0.bias"}) is None
    assert build_loaded(net, None) is None
