"""Every error a user can see from the batch engine, the image data and the figure writers is a
VitexplainError (and still the built-in exception it was before)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import vitexplain as vx
from vitexplain.errors import VitexplainError


def _no_encoder(monkeypatch) -> None:
    import cv2

    monkeypatch.setattr(cv2, "imencode", lambda *args, **kwargs: (False, None))


def test_a_png_opencv_cannot_encode_is_a_usage_error(monkeypatch, tmp_path) -> None:
    from vitexplain.files import encode_png

    _no_encoder(monkeypatch)
    rgb = np.zeros((4, 4, 3), np.uint8)
    with pytest.raises(VitexplainError, match="could not encode") as caught:
        encode_png(rgb)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(vx.UsageError, match="could not encode"):
        vx.viz.save_png(tmp_path / "x.png", rgb)
    assert not (tmp_path / "x.png").exists()


def test_an_index_past_a_shapes_batch_is_an_index_error_and_iteration_stops_there() -> None:
    batch = vx.data.shapes(3, seed=0, size=32)
    with pytest.raises(VitexplainError, match="out of range") as caught:
        batch[3]
    assert isinstance(caught.value, IndexError)
    assert [len(b) for b in batch] == [1, 1, 1]  # iterating by index stops at the IndexError


class _TwoRanks:
    """Rank 0 of a two-process run whose rank 1 crashed (gather returns its report)."""

    rank, world = 0, 2

    def init(self, device) -> None: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...

    def gather(self, value):
        if "run_id" in value or "usage" in value:
            return [value, {}]
        return [value, {"crashed": "rank 1: RuntimeError: CUDA error: out of memory"}]


def test_another_rank_failing_is_a_vitexplain_error(tmp_path) -> None:
    import torch

    from vitexplain.batch.driver import drive
    from vitexplain.batch.inputs import InputItem
    from vitexplain.batch.run import Command, RankFailedError, Run

    image = tmp_path / "a.png"
    vx.viz.save_png(image, np.zeros((8, 8, 3), np.uint8))
    run = Run(command="export", out=tmp_path / "out", items=[InputItem(str(image), "a.png")], unreadable=[],
              dist=_TwoRanks(), device=torch.device("cpu"), autocast_dtype=None,
              pre_kwargs=dict(input_size=(8, 8), mean=(0, 0, 0), std=(1, 1, 1)), config_hash="x", crop=True,
              max_side=0, batch_size=1, workers=0, write_threads=1, overwrite=False, quiet=True)
    command = Command(process=lambda x, good: [({}, "not explained") for _ in good], fields={})
    with pytest.raises(VitexplainError, match="failed on another rank: rank 1: RuntimeError") as caught:
        drive(run, command, 0.0)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, RankFailedError)
    assert not Path(tmp_path / "out" / ".vitexplain.lock").exists()  # released
