"""Decoding: a DataLoader that reads, preprocesses and crops images, where a bad file is a record.

With ``workers > 0`` the work runs in worker processes that ignore SIGINT and SIGTERM: the
main process decides when to stop (it finishes what it can, writes the summary and shuts
them down), so Ctrl-C in a terminal (which signals the whole process group) neither kills a
worker mid-item nor leaves one blocked at exit on a full result pipe.

A worker never outlives the main process: when it dies without shutting them down (``kill -9``,
the OOM killer), the kernel kills the workers (Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``), and
elsewhere each worker polls its parent's pid and exits when it changes. (The DataLoader's own
check runs only between items, so a worker stuck decoding a huge file lingered with its memory.)
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["ImageDataset", "cap_size", "collate", "make_loader"]


class ImageDataset:
    """Decode + preprocess one image; errors become records instead of exceptions.

    Items are dicts: ``{"i", "x" (3, H, W) float32, "region" (h, w, 3) uint8 RGB (the part the
    model saw, at most ``max_side`` px on its longer side), "width", "height", "box"}`` or
    ``{"i", "error"}``.

    Args:
        paths: image files.
        preprocess_kwargs: the model's :func:`vitexplain.data.images.preprocess` arguments.
        crop: resize + center-crop (False: resize whole).
        max_side: longest side of the returned region (0: no limit).
    """

    def __init__(self, paths: Sequence[str], preprocess_kwargs: dict[str, Any], crop: bool, max_side: int) -> None:
        self.paths = list(paths)
        self.kwargs = dict(preprocess_kwargs)
        self.crop = crop
        self.max_side = int(max_side)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        from ..data.images import crop_region, load_image, preprocess
        from ..errors import ImageLoadError

        path = self.paths[i]
        try:
            image = load_image(path)
        except Exception as e:  # a bad file is a record, never a dead worker
            return {"i": i, "error": str(e) if isinstance(e, ImageLoadError) else
                    f"cannot load image {path}: {type(e).__name__}: {e}"}
        try:
            x, boxes = preprocess([image], crop=self.crop, **self.kwargs)
            region = crop_region(image, boxes[0]) if self.crop else image
            region = cap_size(region, self.max_side)
        except Exception as e:
            return {"i": i, "error": f"cannot preprocess image {path}: {e}"}
        h, w = image.shape[:2]
        return {"i": i, "x": x[0], "region": region, "width": int(w), "height": int(h),
                "box": list(boxes[0].to_int())}


def cap_size(image: "np.ndarray", max_side: int) -> "np.ndarray":
    """Shrink (area averaging) so the longer side is at most ``max_side`` (0: unchanged)."""
    h, w = image.shape[:2]
    if max_side <= 0 or max(h, w) <= max_side or min(h, w) == 0:
        return image
    import cv2

    s = max_side / max(h, w)
    size = (max(1, round(w * s)), max(1, round(h * s)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def collate(samples: list[dict[str, Any]]) -> tuple[Optional["torch.Tensor"], list[dict[str, Any]], list[dict[str, Any]]]:
    """``(x (B, 3, H, W) or None, good samples, bad samples)``."""
    import torch

    good = [s for s in samples if "error" not in s]
    bad = [s for s in samples if "error" in s]
    x = torch.stack([s.pop("x") for s in good]) if good else None
    return x, good, bad


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int) -> None:
    """Make this process exit when ``parent`` does (see the module docstring)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the poll below does it
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="vitexplain-parent-watch", daemon=True).start()


def _init_worker(_worker_id: int, parent: int) -> None:
    """A DataLoader worker: leaves SIGINT/SIGTERM to the main process and dies with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with(parent)


def make_loader(dataset: ImageDataset, *, batch_size: int, workers: int, pin_memory: bool) -> Any:
    """The DataLoader over ``dataset`` (in order; batches from :func:`collate`)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=workers, collate_fn=collate,
        pin_memory=pin_memory, prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=functools.partial(_init_worker, parent=os.getpid()) if workers > 0 else None,
    )
