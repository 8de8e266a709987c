"""Every example runs (CI smoke mode) and writes what it promises."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.parametrize(
    "script, outputs",
    [
        ("quickstart.py", ["quickstart.png"]),
        ("compare_methods.py", ["compare_methods.png"]),
        ("captioning.py", ["caption_0.png", "caption_1.png"]),
        ("cnn_attention.py", None),
        ("own_timm_model.py", ["own_model.png"]),
        ("alignment.py", ["alignment.png"]),
    ],
)
def test_python_example(tmp_path, script, outputs):
    out = tmp_path / "out"
    extra = ["--offline"] if script == "own_timm_model.py" else []
    result = run([sys.executable, str(EXAMPLES / script), "--out", str(out), "--quick", *extra], tmp_path)
    written = sorted(p.name for p in out.rglob("*.png"))
    assert written, f"{script} wrote no PNG:\n{result.stdout}"
    for name in outputs or []:
        assert name in written, (name, written)


def test_explore_example_writes_both_pages(tmp_path):
    out = tmp_path / "out"
    run([sys.executable, str(EXAMPLES / "explore.py"), "--out", str(out), "--quick"], tmp_path)
    for name in ("explore_vit.html", "explore_caption.html"):
        assert 'id="vx-data"' in (out / name).read_text()


def test_batch_export_script(tmp_path):
    assert shutil.which("vitexplain"), "the vitexplain console script is not on PATH: pip install -e ."
    out = tmp_path / "batch"
    run(["bash", str(EXAMPLES / "batch_export.sh"), str(out)], tmp_path, QUICK="1")
    assert (out / "vit" / "index.html").exists()
    assert list((out / "vit").rglob("*.cdam.png")) and list((out / "cnn").rglob("*.spatial.png"))
