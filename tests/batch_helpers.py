"""Helpers shared by the batch CLI tests: a tiny zoo checkpoint, shapes images on disk, running
the CLI in-process or as a subprocess, and reading its manifest and summary back (strict UTF-8)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from PIL import Image

import vitexplain as vx
from vitexplain import cli


def save_tiny(folder: Path, zoo_name: str = "shapes-vit", edit: Optional[Callable[[torch.nn.Module], object]] = None,
              **model_args) -> str:
    """A 1-block random-init zoo model of ``zoo_name``'s architecture, changed by ``edit(model)`` (under no_grad)
    when given; returns its ``.json``."""
    from vitexplain.zoo.models import DEFAULT_CONFIGS, build

    cfg = copy.deepcopy(DEFAULT_CONFIGS[zoo_name])
    cfg["name"] = "tiny"
    cfg["model_args"].update(model_args or dict(depth=1, embed_dim=32, num_heads=2))
    torch.manual_seed(0)
    model = build(cfg)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    return str(vx.zoo.save_checkpoint(model, cfg, folder))


#: a 1-layer shapes-captioner's size (``save_tiny(folder, "shapes-captioner", **TINY_CAPTIONER)``)
TINY_CAPTIONER = dict(enc_dim=32, enc_depth=1, enc_heads=2, dec_dim=32, dec_depth=1, dec_heads=2)


def images(root: Path, names, size: int = 64, seed: int = 3) -> Path:
    """Write one shapes image per name (str or bytes, relative to root)."""
    batch = vx.data.shapes(len(names), seed=seed, size=size)
    for i, name in enumerate(names):
        path = os.path.join(os.fsencode(root), os.fsencode(name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(np.ascontiguousarray(batch.images[i])).save(os.fsdecode(path), format="PNG")
    return root


def run(*args) -> int:
    """``vitexplain ARGS...`` in this process; returns the exit status."""
    return cli.main([os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args])


def export(src, out, ckpt, *extra) -> int:
    """A small, quiet ``rollout`` export without DataLoader workers."""
    return run("export", src, "--out", out, "--model", ckpt, "--method", "rollout", "-q", "-j", "0", *extra)


def manifest(out: Path) -> dict[str, dict]:
    data = (Path(out) / "manifest.jsonl").read_bytes().decode("utf-8")  # strict: valid UTF-8
    return {r["key"]: r for r in map(json.loads, data.splitlines())}


def summary(out: Path) -> dict:
    return json.loads((Path(out) / "summary.json").read_bytes().decode("utf-8"))


def env() -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout first on the path, one thread."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    root = str(Path(vx.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli_process(code: str, *args, **kwargs) -> subprocess.Popen:
    """Run ``python -c code ARGS...`` in its own session (signals go to its process group)."""
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True, **kwargs)


def wait_for(condition: Callable[[], bool], proc: Optional[subprocess.Popen] = None, timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; fails if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) first: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {condition}")
        time.sleep(0.02)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux: parent pids read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != b"Z":
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def unreadable_folder(monkeypatch, folder) -> None:
    """Make ``folder`` impossible to list, as ``chmod 000`` would (tests run as root, which reads
    through permission bits, so ``os.scandir`` is patched)."""
    import errno

    locked = os.fspath(folder).rstrip("/")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fsdecode(path).rstrip("/") == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)


def read_only_below(monkeypatch, folder) -> None:
    """Make every open for writing below ``folder`` fail with EROFS (a read-only file system)."""
    import errno

    root = os.fspath(folder)
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if os.fsdecode(path).startswith(root) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
