"""The batch commands fuzzed as a careless and a hostile user would run them (fourth round of
hostile runs): empty file arguments from unset shell variables, devices torch was not built
for, a distributed environment without its rendezvous, an earlier run's output folder among
the inputs, a closed stderr, repeated warnings, captioners and VLMs whose outputs are NaN, files
of other programs in --out, thread and batch counts past the machine, ** patterns through
symbolic link loops, --min-side with overlays at their original size.

Offline and small: a 1-block ViT of the zoo architecture (random weights), 32-64 px images;
the NaN captioner is a 1-block random one, the NaN VLM the bundled shapes-vlm with its output
layer filled with NaN.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image

from batch_helpers import export, images, manifest, run, save_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("flag", ["--checkpoint", "--labels"])
def test_an_empty_file_argument_is_a_usage_error(flag, ckpt, tmp_path, capsys) -> None:
    # `--checkpoint "$CKPT"` with CKPT unset: the flag was read as not given, so the run went on
    # silently (a timm model with random weights, a model without its label names), exit 0.
    src = images(tmp_path / "in", ["a.png"])
    assert export(src, tmp_path / "out", ckpt, flag, "") == 2
    err = capsys.readouterr().err
    assert f"{flag} is empty" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--model", "--family"])
def test_methods_with_an_empty_model_or_family_is_a_usage_error(flag, capsys) -> None:
    # `vitexplain methods --model "$MODEL"` with MODEL unset listed every family's methods, exit 0,
    # as if the methods of the model had been asked for.
    assert run("methods", flag, "") == 2
    captured = capsys.readouterr()
    assert f"{flag} is empty" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_a_device_this_torch_cannot_use_is_a_usage_error(ckpt, tmp_path, capsys) -> None:
    # --device mps on Linux (or xla, ipu, ... without their backends): a traceback from moving the
    # model ("PyTorch is not linked with support for mps devices"), exit 1.
    import torch

    device = next((d for d in ("mps", "ipu", "xla") if not _usable(torch, d)), None)
    if device is None:  # pragma: no cover - every candidate backend is present
        pytest.skip("mps, ipu and xla are all usable here")
    src = images(tmp_path / "in", ["a.png"])
    assert export(src, tmp_path / "out", ckpt, "--device", device) == 2
    err = capsys.readouterr().err
    assert f"--device {device}" in err and "--device cpu" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _usable(torch, device: str) -> bool:
    try:
        torch.empty(0, device=device)
        return True
    except (RuntimeError, AssertionError):
        return False


def test_a_distributed_environment_without_its_rendezvous_is_a_usage_error(ckpt, tmp_path, monkeypatch,
                                                                           capsys) -> None:
    # WORLD_SIZE=2 left in the environment (or set by hand) without torchrun's MASTER_ADDR: a
    # ValueError traceback from torch.distributed, exit 1.
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    src = images(tmp_path / "in", ["a.png"])
    assert export(src, tmp_path / "out", ckpt) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2" in err and "MASTER_ADDR" in err and "torchrun" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_a_later_run_does_not_explain_an_earlier_run_s_outputs(ckpt, tmp_path, capsys) -> None:
    # `export photos --out photos/maps` (allowed: the walk skips --out), then `export photos --out
    # photos/maps2`: the second run walked into photos/maps and explained the first run's overlays
    # as inputs (a.png.rollout.png -> maps2/maps/a.png.rollout.png.rollout.png), silently, exit 0.
    photos = images(tmp_path / "photos", ["a.png", "sub/b.png"])
    assert export(photos, photos / "maps", ckpt) == 0
    capsys.readouterr()
    for i, arg in enumerate([photos, str(photos / "**" / "*.png")]):  # a folder, a recursive glob
        out = tmp_path / f"maps{i}"
        assert export(arg, out, ckpt) == 0
        assert sorted(manifest(out)) == ["a.png", "sub/b.png"]
        err = capsys.readouterr().err
        assert f"skipping {photos / 'maps'}" in err and "earlier run" in err
    # named itself, the folder is an input like any other
    assert export(photos / "maps", tmp_path / "again", ckpt) == 0
    assert sorted(manifest(tmp_path / "again")) == ["a.png.rollout.png", "sub/b.png.rollout.png"]


class _GoneReader:
    """A stderr whose reader went away: every write fails as a pipe's does (EPIPE)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False


def test_a_closed_stderr_does_not_stop_the_run(ckpt, tmp_path, monkeypatch) -> None:
    # `vitexplain export ... 2>&1 | head` (or a log reader that went away): the progress bar's first
    # write raised BrokenPipeError, which ended the run with a traceback before any image, without
    # a summary (its manifest part left unmerged). Measured with a real closed pipe too (a
    # subprocess whose stderr was closed: exit 1, one file in --out).
    import sys

    from batch_helpers import summary

    src = images(tmp_path / "in", ["a.png", "b.png", "c.png"])
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "stderr", _GoneReader())
    assert run("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "-b", "1", "-j", "0") == 0
    assert summary(out)["status"] == "ok" and summary(out)["counts"]["ok"] == 3
    assert sorted(manifest(out)) == ["a.png", "b.png", "c.png"]
    # a usage error is still an exit status 2, its message lost with the reader
    assert run("export", src, "--out", tmp_path / "o2", "--model", ckpt, "--method", "bogus") == 2


def test_a_warning_is_shown_once_per_run_without_the_package_s_source(ckpt, tmp_path, capsys) -> None:
    # --target with rollout (which does not depend on the class): the UnusedTargetWarning was
    # printed once per batch (4 images in batches of 1: 6 times), each with the package's file,
    # line number and source line ("return process(x, good)").
    src = images(tmp_path / "in", [f"{i}.png" for i in range(4)])
    assert export(src, tmp_path / "out", ckpt, "-b", "1", "--target", "1") == 0
    err = capsys.readouterr().err
    assert err.count("does not depend on the target class") == 1, err
    assert "vitexplain: warning: UnusedTargetWarning: rollout does not depend" in err
    assert "setup.py" not in err and "return " not in err
    assert len(manifest(tmp_path / "out")) == 4


def _nan_captioner(folder: Path) -> str:
    """A tiny random captioner whose output layer holds NaN: every next-word logit is NaN."""
    from batch_helpers import TINY_CAPTIONER, save_tiny

    return save_tiny(folder, "shapes-captioner", edit=lambda m: m.head.weight.fill_(float("nan")), **TINY_CAPTIONER)


@pytest.mark.parametrize("given", [None, "red circle"])
def test_a_captioner_whose_outputs_are_nan_is_a_usage_error(given, tmp_path, capsys) -> None:
    # With an attention-only method (cross) nothing looked at the decoder's outputs: greedy decoding
    # of NaN logits generated "<pad> <pad> ... <pad>" for every image, written with its maps, exit 0
    # (with --caption, the given words were "explained" by a model that computes nothing).
    ckpt = _nan_captioner(tmp_path / "ckpt")
    src = images(tmp_path / "in", ["a.png"])
    extra = ["--caption", given] if given else []
    assert run("caption", src, "--out", tmp_path / "out", "--model", ckpt, "--method", "cross", "-q", "-j", "0",
               *extra) == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "--model" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_explore_refuses_a_captioner_whose_outputs_are_nan(tmp_path, capsys) -> None:
    # The explorer page of the same model showed '<pad> <pad> ...' captions with their maps, exit 0.
    ckpt = _nan_captioner(tmp_path / "ckpt")
    src = images(tmp_path / "in", ["a.png"])
    assert run("explore", src, "--out", tmp_path / "page.html", "--model", ckpt, "-q") == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "Traceback" not in err
    assert not (tmp_path / "page.html").exists()


def test_a_vision_language_model_whose_outputs_are_nan_is_a_usage_error(tmp_path, capsys) -> None:
    # shapes-vlm saved with a NaN output layer: greedy decoding picked token 0 at every step, so each
    # image's answer was 16 '<pad>' tokens (an empty caption string), written with its maps, exit 0.
    import torch

    import vitexplain as vx

    model = vx.zoo.load("shapes-vlm")
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    folder = tmp_path / "nan-vlm"
    model.save_pretrained(folder)
    model.vx_processor.save_pretrained(folder)
    src = images(tmp_path / "in", ["a.png"])
    assert run("caption", src, "--out", tmp_path / "out", "--model", folder, "--method", "cross", "-q", "-j",
               "0") == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


_FOREIGN = {
    "manifest.jsonl": b'{"audio_filepath": "a.wav", "duration": 1.5, "text": "hello"}\n',  # a dataset's manifest
    "summary.json": b'{"experiment": "baseline", "accuracy": 0.93}\n',
    "index.html": b"<!DOCTYPE html><html><head><title>My photos</title></head><body></body></html>\n",
}


@pytest.mark.parametrize("name", sorted(_FOREIGN))
def test_a_file_of_another_program_where_the_run_writes_its_own_is_a_usage_error(name, ckpt, tmp_path,
                                                                                 capsys) -> None:
    # --out pointed at a folder already holding a dataset manifest.jsonl (or a summary.json, an
    # index.html of another program): the run replaced it with its own, silently, exit 0.
    src = images(tmp_path / "in", ["a.png"])
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_bytes(_FOREIGN[name])
    assert export(src, out, ckpt, "--html") == 2
    err = capsys.readouterr().err
    assert name in err and "not written by vitexplain" in err and "Traceback" not in err
    assert (out / name).read_bytes() == _FOREIGN[name]
    assert sorted(os.listdir(out)) == [name]
    # the run's own files are replaced as before: a rerun of a finished run into the same folder
    out2 = tmp_path / "out2"
    assert export(src, out2, ckpt, "--html") == 0
    assert export(src, out2, ckpt, "--html", "--overwrite") == 0


@pytest.mark.parametrize("flag", ["--threads", "--write-threads"])
def test_a_thread_count_far_past_the_machine_is_a_usage_error(flag, ckpt, tmp_path, capsys) -> None:
    # --threads 100000: torch's OpenMP pool of 100000 threads exhausted the memory, and the run
    # ended with "--model 'shapes-vit': cannot load it (ImportError: liblzma...: failed to map
    # segment from shared object)", exit 2, naming the model instead of the flag.
    from vitexplain.batch.setup import max_workers

    limit = max_workers()
    src = images(tmp_path / "in", ["a.png"])
    assert export(src, tmp_path / "out", ckpt, flag, str(limit + 1)) == 2
    err = capsys.readouterr().err
    assert f"{flag} {limit + 1}" in err and f"at most {limit}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_batch_size_past_the_machine_word_takes_every_image_in_one_batch(ckpt, tmp_path, capsys) -> None:
    # --batch-size 10**23 (a typo'd number of zeros): "ValueError: Stop argument for islice() must be
    # None or an integer: 0 <= x <= sys.maxsize." from the DataLoader's sampler, a traceback, exit 1.
    src = images(tmp_path / "in", ["a.png", "b.png", "c.png"])
    out = tmp_path / "out"
    assert export(src, out, ckpt, "-b", str(10**23)) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(manifest(out)) == ["a.png", "b.png", "c.png"]
    assert all(r["status"] == "ok" for r in manifest(out).values())


def test_a_timm_model_that_cannot_be_built_is_one_line_of_error(tmp_path, capsys) -> None:
    # --num-classes 10**23: torch's overflow error, with its 50-frame C++ backtrace, was the message.
    src = images(tmp_path / "in", ["a.png"])
    assert run("export", src, "--out", tmp_path / "out", "--model", "vit_tiny_patch16_224", "--model-arg",
               "img_size=32", "--num-classes", str(10**23), "-q", "-j", "0") == 2
    err = capsys.readouterr().err
    assert err.startswith("vitexplain export: error: cannot create timm model 'vit_tiny_patch16_224'")
    assert len(err.strip().splitlines()) == 1 and "frame #" not in err, err


def _looped_tree(root: Path, loops: int) -> Path:
    """``root`` with a.png, sub/b.png, ``loops`` links sub/upN -> .. and a linked folder ext -> ../outside."""
    images(root, ["a.png", "sub/b.png"])
    images(root.parent / "outside", ["c.png"])
    for i in range(loops):
        (root / "sub" / f"up{i}").symlink_to("..")
    (root / "ext").symlink_to(root.parent / "outside")
    return root


def test_a_recursive_glob_through_a_symlink_loop_lists_each_image_once(ckpt, tmp_path) -> None:
    # 'photos/**/*.png' with photos/sub/up -> ..: Python's glob followed the loop until the path
    # was too long, so a.png was explained dozens of times (sub/up/a.png, sub/up/sub/up/a.png, ...),
    # written under ever deeper folders, while the folder itself (`export photos`) listed it once.
    root = _looped_tree(tmp_path / "photos", loops=1)
    out = tmp_path / "out"
    assert export(str(root / "**" / "*.png"), out, ckpt) == 0
    assert sorted(manifest(out)) == ["a.png", "ext/c.png", "sub/b.png"]
    assert export(root, tmp_path / "walked", ckpt) == 0  # the same images as the folder walk
    assert sorted(manifest(tmp_path / "walked")) == sorted(manifest(out))
    # the other glob forms keep their meaning: a folder pattern is walked, a one-level * stays one level
    from vitexplain.batch.inputs import discover_inputs

    assert sorted(i.key for i in discover_inputs([str(root / "**")], out)) == ["a.png", "ext/c.png", "sub/b.png"]
    assert sorted(i.key for i in discover_inputs([str(root / "*.png")], out)) == ["a.png"]
    assert sorted(i.key for i in discover_inputs([str(root / "**" / "b.png")], out)) == ["sub/b.png"]


def test_a_recursive_glob_through_two_symlink_loops_ends(tmp_path) -> None:
    # Two links back up: Python's glob explored 2**40 paths (it never ended); run in a subprocess
    # so that a regression fails on its timeout instead of hanging the test session.
    import subprocess
    import sys

    from batch_helpers import env

    root = _looped_tree(tmp_path / "photos", loops=2)
    code = ("import sys; from vitexplain.batch.inputs import discover_inputs; "
            "print(sorted(i.key for i in discover_inputs([sys.argv[1]], sys.argv[2])))")
    done = subprocess.run([sys.executable, "-c", code, str(root / "**" / "*.png"), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['a.png', 'ext/c.png', 'sub/b.png']"


def test_min_side_with_overlays_at_original_size_is_bounded(ckpt, tmp_path, capsys, monkeypatch) -> None:
    # --max-side 0 (original size) lifted the only bound on --min-side: --min-side 100000 enlarged
    # each 64 px region to 100000 px a side, and every image failed with OpenCV's "Failed to
    # allocate 30000000000 bytes" (where memory is overcommitted, the machine swaps instead).
    # As with --max-side N (tests/test_cli_fuzz.py), the enlargement stops at the bound (4096 px;
    # 512 here, to draw and encode less).
    from vitexplain.batch import export as export_module

    assert export_module.MAX_MIN_SIDE == 4096
    monkeypatch.setattr(export_module, "MAX_MIN_SIDE", 512)
    src = images(tmp_path / "in", ["a.png"], size=32)
    out = tmp_path / "out"
    assert export(src, out, ckpt, "--max-side", "0", "--min-side", "100000") == 0
    rec = manifest(out)["a.png"]
    assert rec["status"] == "ok", rec["error"]
    with Image.open(out / rec["files"]["rollout"]["overlay"]) as im:
        assert im.size == (512, 512)  # the 32 px region, enlarged 16 times
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_while_the_command_line_is_built_is_an_interrupt_not_a_traceback(monkeypatch, capsys) -> None:
    # Ctrl-C within the first ~0.3 s of `vitexplain export ...` (while building the parser imports the
    # batch options): a KeyboardInterrupt traceback ending in an import line. Measured with a real
    # SIGINT 0.3 s after start.
    from vitexplain import cli

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["export", "in", "--out", "out"])
    except KeyboardInterrupt:  # (caught here: escaping, it would end the whole test session)
        pytest.fail("the KeyboardInterrupt left cli.main (a traceback for the user)")
    assert code == 130
    err = capsys.readouterr().err
    assert err == "vitexplain: interrupted\n"
