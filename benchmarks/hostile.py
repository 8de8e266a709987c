"""Replay the hostile cases of the batch CLI against `vitexplain` in temporary folders.

One line per case: what is expected, what was observed, PASS or FAIL, so the next round of
hostile runs starts from them. Each case runs the real command line in a subprocess (a tiny
random-init zoo ViT, 64 px shapes images); faults that need root-proof permissions or a full
disk are simulated by a wrapper that patches the OS call, as the tests do.

    python benchmarks/hostile.py                 # every case, a 96 MP 16-bit RGBA PNG for memory
    python benchmarks/hostile.py --big-mp 12     # a smaller memory case (quicker, less RAM)
    python benchmarks/hostile.py --only lock,memory

Exit status: 0 when every case passes, 1 otherwise. Nothing is written outside the temporary
folder (the printed lines are the report).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable
from urllib.parse import unquote_to_bytes

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from batch_helpers import alive, children, env, images, save_tiny, wait_for  # noqa: E402

# patches applied before the CLI runs (the wrapper's argv[1] names one)
_PATCHES = {
    "none": "",
    # workers stuck decoding image 4 and after (the DataLoader's own parent check never runs there)
    "hang": """
from vitexplain.batch.decoding import ImageDataset
_get = ImageDataset.__getitem__
def _hang(self, i):
    if i >= 4:
        threading.Event().wait()
    return _get(self, i)
ImageDataset.__getitem__ = _hang
""",
    # images past the eighth wait for $VX_RELEASE: the run is mid-way when signalled
    "gate": """
from vitexplain.batch.decoding import ImageDataset
_get = ImageDataset.__getitem__
def _gate(self, i):
    while i >= 8 and not os.path.exists(os.environ["VX_RELEASE"]):
        time.sleep(0.01)
    return _get(self, i)
ImageDataset.__getitem__ = _gate
""",
    # the disk fills up when the explorer page is moved into place
    "full-disk": """
_replace = os.replace
def _full(src, dst, *a, **k):
    if str(dst).endswith(".html"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _replace(src, dst, *a, **k)
os.replace = _full
""",
    # one input folder cannot be listed (root reads through chmod 000, so refuse it here)
    "locked-folder": """
_scandir = os.scandir
def _locked(path="."):
    if os.fsdecode(path).rstrip("/").endswith("/locked"):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
    return _scandir(path)
os.scandir = _locked
""",
}
# the run signals itself while it merges the manifest (every image done)
for _sig in ("SIGINT", "SIGTERM"):
    _PATCHES[f"{_sig.lower()}-finish"] = f"""
from vitexplain.batch import driver
_merge = driver.merge_manifest
def _merge_signalled(*a, **k):
    os.kill(os.getpid(), signal.{_sig})
    return _merge(*a, **k)
driver.merge_manifest = _merge_signalled
"""

_WRAPPER = """
import errno, os, signal, sys, threading, time
exec(PATCHES[sys.argv[1]])
from vitexplain import cli
cli.run(sys.argv[2:])
"""


def cli(patch: str, *args, extra_env: dict | None = None, wait: bool = True, **popen):
    """Run ``vitexplain ARGS`` with a patch; returns (exit code, stderr), or the process."""
    code = f"PATCHES = {_PATCHES!r}\n" + _WRAPPER
    proc = subprocess.Popen([sys.executable, "-c", code, patch, *map(str, args)], stderr=subprocess.PIPE,
                            text=True, env={**env(), **(extra_env or {})}, start_new_session=True, **popen)
    if not wait:
        return proc
    _, err = proc.communicate(timeout=600)
    return proc.returncode, err


class Case:
    """One hostile case: its folder, the tiny model and a place for the result line."""

    def __init__(self, root: Path, ckpt: str, name: str) -> None:
        self.dir = root / name
        self.dir.mkdir()
        self.ckpt = ckpt

    def export(self, patch: str, src: Path, out: Path, *extra, **kw):
        return cli(patch, "export", src, "--out", out, "--model", self.ckpt, "--method", "rollout", "-q",
                   "-j", "0", *extra, **kw)

    def explore(self, patch: str, src: Path, page: Path, *extra):
        return cli(patch, "explore", src, "--out", page, "--model", self.ckpt, "--method", "rollout", "-q", *extra)


def _summary(out: Path) -> dict:
    try:
        return json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def case_symlinked_lock(c: Case):
    src, out = images(c.dir / "in", ["a.png"]), c.dir / "out"
    out.mkdir()
    victim = c.dir / "victim.txt"
    victim.write_text("precious\n")
    (out / ".vitexplain.lock").symlink_to(victim)
    code, err = c.export("none", src, out)
    kept = victim.read_text() == "precious\n"
    return ("exit 2 naming the link, target untouched",
            f"exit {code}, target {'untouched' if kept else 'OVERWRITTEN'}, "
            f"{'names the link' if 'symbolic link' in err else 'no mention of the link'}",
            code == 2 and kept and "symbolic link" in err)


def case_symlinked_subfolder(c: Case):
    src, out = images(c.dir / "in", ["a.png", "sub/b.png"]), c.dir / "out"
    out.mkdir()
    elsewhere = c.dir / "elsewhere"
    elsewhere.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    code, err = c.export("none", src, out)
    leaked = sorted(p.name for p in elsewhere.iterdir())
    return ("exit 1, sub/b.png failed (symbolic link), nothing outside --out",
            f"exit {code}, files outside --out: {leaked or 'none'}, "
            f"{'link reported' if 'symbolic link' in err else 'link not reported'}",
            code == 1 and not leaked and "symbolic link" in err)


def case_kill9_then_rerun(c: Case):
    src, out = images(c.dir / "in", [f"i{i}.png" for i in range(12)]), c.dir / "out"
    proc = cli("hang", "export", src, "--out", out, "--model", c.ckpt, "--method", "rollout", "-q", "-j", "2",
               "-b", "2", wait=False)
    workers: list[int] = []
    try:
        wait_for(lambda: len(list(out.glob("*.rollout.png"))) >= 4, proc)
        workers = children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            wait_for(lambda: not any(alive(w) for w in workers), timeout=30)
            left = []
        except AssertionError:
            left = [w for w in workers if alive(w)]
        code, err = c.export("none", src, out)
    finally:
        for pid in [*(workers or children(proc.pid)), proc.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    busy = "in use" in err
    return ("workers die with the run; the rerun starts and resumes (exit 0)",
            f"{len(workers)} workers, {len(left)} alive 30 s later; rerun exit {code}"
            + (" (refused: in use)" if busy else ""),
            not left and code == 0 and len(workers) > 0)


def _signal_in_finishing(c: Case, sig: str, code_expected: int):
    src, out = images(c.dir / "in", ["a.png", "b.png", "c.png"]), c.dir / "out"
    code, _ = c.export(f"{sig}-finish", src, out, "--html")
    summary = _summary(out)
    have = [n for n in ("summary.json", "manifest.jsonl", "index.html") if (out / n).is_file()]
    ok = (code == code_expected and len(have) == 3 and summary.get("status") == "interrupted"
          and summary.get("manifest_records") == 3)
    return (f"exit {code_expected}; summary.json (interrupted), manifest.jsonl (3 records), index.html",
            f"exit {code}; files: {', '.join(have) or 'none'}; status {summary.get('status')}, "
            f"records {summary.get('manifest_records')}", ok)


def case_sigint_in_finishing(c: Case):
    return _signal_in_finishing(c, "sigint", 130)


def case_sigterm_in_finishing(c: Case):
    return _signal_in_finishing(c, "sigterm", 143)


def _signal_mid_run(c: Case, sig: int, workers: str):
    src, out = images(c.dir / "in", [f"i{i:02d}.png" for i in range(16)]), c.dir / "out"
    release = c.dir / "release"
    proc = cli("gate", "export", src, "--out", out, "--model", c.ckpt, "--method", "rollout", "-q", "-j", workers,
               "-b", "4", extra_env={"VX_RELEASE": str(release)}, wait=False)
    try:
        wait_for(lambda: len(list(out.glob("*.rollout.png"))) >= 8, proc)
        t = time.monotonic()
        os.killpg(proc.pid, sig)
        release.touch()
        proc.communicate(timeout=120)
        seconds = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = _summary(out)
    code = 128 + sig
    return (f"exit {code} within about a second (README), summary interrupted with the 8 images done",
            f"exit {proc.returncode} after {seconds:.2f} s, status {summary.get('status')}, "
            f"ok {summary.get('counts', {}).get('ok')}",
            proc.returncode == code and seconds < 2.0 and summary.get("status") == "interrupted"
            and summary.get("counts", {}).get("ok") == 8)


def case_sigterm_mid_run(c: Case):
    return _signal_mid_run(c, signal.SIGTERM, "0")


def case_sigint_mid_run_with_workers(c: Case):
    return _signal_mid_run(c, signal.SIGINT, "2")


def case_explore_thin_image(c: Case):
    from PIL import Image

    src = images(c.dir / "in", ["a.png"])
    Image.fromarray(np.full((1, 300_000, 3), 90, np.uint8)).save(src / "strip.png")
    page = c.dir / "p.html"
    code, err = c.explore("none", src, page)
    return ("exit 1, strip.png skipped (aspect ratio), page written, no --no-crop advice",
            f"exit {code}, page {'written' if page.is_file() else 'missing'}, "
            f"{'skip reported' if 'skipped' in err and 'aspect ratio' in err else 'skip not reported'}"
            + (", advises --no-crop" if "--no-crop" in err else ""),
            code == 1 and page.is_file() and "aspect ratio" in err and "--no-crop" not in err)


def case_explore_unwritable_out(c: Case):
    src = images(c.dir / "in", ["a.png"])
    (c.dir / "page.html").mkdir()
    (c.dir / "file").write_text("x")
    results = []
    for page, what in ((c.dir / "page.html", "a folder"), (c.dir / "file" / "p.html", "under a file")):
        code, err = c.explore("none", src, page)
        results.append((what, code, "Traceback" in err))
    code, err = c.explore("full-disk", src, c.dir / "full.html")
    results.append(("full disk", code, "Traceback" in err))
    return ("folder / under a file: exit 2; full disk at the end: exit 74; no traceback",
            "; ".join(f"{w}: exit {code}{' TRACEBACK' if tb else ''}" for w, code, tb in results),
            [code for _, code, _ in results] == [2, 2, 74] and not any(tb for *_, tb in results))


def case_explore_unreadable_folder(c: Case):
    src = images(c.dir / "in", ["a.png", "locked/b.png"])
    page = c.dir / "p.html"
    code, err = c.explore("locked-folder", src, page)
    return ("exit 1, the folder reported", f"exit {code}, "
            f"{'reported' if 'cannot read folder' in err else 'not reported'}",
            code == 1 and "cannot read folder" in err)


def case_folder_named_manifest(c: Case):
    src = images(c.dir / "in", ["a.png"])
    results = []
    for name in ("manifest.jsonl", "summary.json", "index.html"):
        out = c.dir / f"out-{name}"
        (out / name).mkdir(parents=True)
        code, err = c.export("none", src, out, "--html")
        results.append((name, code, "Traceback" in err))
    return ("exit 2 (usage error naming it), no traceback",
            "; ".join(f"{n}: exit {code}{' TRACEBACK' if tb else ''}" for n, code, tb in results),
            all(code == 2 and not tb for _, code, tb in results))


def case_non_utf8_names(c: Case):
    names = [b"caf\xe9.png", b"sub\xff/na\xefve.png"]
    src, out = images(c.dir / "in", names), c.dir / "out"
    code, _ = c.export("none", src, out, "--html")
    try:
        page = (out / "index.html").read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        page = ""
    links = [unquote_to_bytes(h) for h in re.findall(r'<img src="([^"]+)" alt="input"', page)]
    reached = sum(os.path.isfile(os.path.join(os.fsencode(out), link)) for link in links)
    return ("exit 0, valid UTF-8 gallery whose 2 input links reach the files",
            f"exit {code}, {len(links)} input links, {reached} reach a file", code == 0 and reached == 2 == len(links))


_PEAK = """
import json, sys
from vitexplain.data.images import load_image
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
before = peak()
out = load_image(sys.argv[1], max_pixels=None)
print(json.dumps({"grew": peak() - before, "result": out.nbytes}))
"""


def case_big_16bit_png_memory(c: Case, megapixels: float):
    import cv2

    w = int(round((megapixels * 1e6 * 1.5) ** 0.5))
    h = int(round(megapixels * 1e6 / w))
    y = np.linspace(0, 65535, h, dtype=np.float32)[:, None]
    x = np.linspace(0, 65535, w, dtype=np.float32)[None, :]
    bgra = np.empty((h, w, 4), np.uint16)
    bgra[..., 0] = (y + x) / 2
    bgra[..., 1] = y
    bgra[..., 2] = x
    bgra[..., 3] = 65535 - (y + x) / 4
    path = c.dir / "big.png"
    cv2.imwrite(str(path), bgra)
    del bgra, y, x
    done = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, env=env())
    if done.returncode:
        return ("peak <= 3x the result", f"failed: {done.stderr.strip().splitlines()[-1:]}", False)
    got = json.loads(done.stdout)
    ratio = got["grew"] / got["result"]
    return (f"{h * w / 1e6:.0f} MP 16-bit RGBA PNG: peak <= 3x the result (decoded RGBA + result = 2.33x)",
            f"peak {got['grew'] / 1e9:.2f} GB for a {got['result'] / 1e6:.0f} MB result = {ratio:.2f}x", ratio <= 3.0)


CASES: dict[str, Callable[..., tuple[str, str, bool]]] = {
    "lock": case_symlinked_lock,
    "subfolder": case_symlinked_subfolder,
    "kill9": case_kill9_then_rerun,
    "sigint-finish": case_sigint_in_finishing,
    "sigterm-finish": case_sigterm_in_finishing,
    "sigterm-run": case_sigterm_mid_run,
    "sigint-run": case_sigint_mid_run_with_workers,
    "explore-thin": case_explore_thin_image,
    "explore-out": case_explore_unwritable_out,
    "explore-folder": case_explore_unreadable_folder,
    "own-names": case_folder_named_manifest,
    "non-utf8": case_non_utf8_names,
    "memory": case_big_16bit_png_memory,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help=f"comma-separated cases: {', '.join(CASES)}")
    parser.add_argument("--big-mp", type=float, default=96.0, help="megapixels of the memory case (default 96)")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in chosen if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="vx-hostile-") as tmp:
        root = Path(tmp)
        ckpt = save_tiny(root / "ckpt")
        for name in chosen:
            c = Case(root, ckpt, name)
            t = time.perf_counter()
            try:
                run = CASES[name]
                expected, observed, ok = run(c, args.big_mp) if name == "memory" else run(c)
            except Exception as e:  # a case that crashes is a FAIL with its reason
                expected, observed, ok = "(see the case)", f"crashed: {type(e).__name__}: {e}", False
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {name:<15} expected: {expected} | observed: {observed} "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    print(f"{len(chosen) - failed} of {len(chosen)} cases pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
