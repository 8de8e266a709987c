"""The export gallery names the explained target under every overlay and keeps small inputs crisp."""

from __future__ import annotations

from vitexplain.viz.gallery import render_gallery


def test_gallery_labels_each_overlay_with_its_target(tmp_path) -> None:
    records = [
        {"key": "a.png", "status": "ok", "width": 64, "height": 64, "source": {"path": str(tmp_path / "a.png")},
         "target": {"index": 0, "label": "circle"},
         "files": {"generic": {"overlay": "a.png.generic.png"}, "cdam": {"overlay": "a.png.cdam.png"}}},
        {"key": "b.png", "status": "ok", "width": 640, "height": 480, "source": {"path": str(tmp_path / "b.png")},
         "target": {"index": 7, "label": None}, "files": {"generic": {"overlay": "b.png.generic.png"}}},
    ]
    page = render_gallery(records, folder=tmp_path, methods=["generic", "cdam"])
    assert '<div class="cap">generic: circle</div>' in page and '<div class="cap">cdam: circle</div>' in page
    assert '<div class="cap">generic: 7</div>' in page  # no label name: the index
    assert page.count('class="small"') == 1  # the 64 px input (thumbnails are 256 px), not the 640 px one
    assert "--w:256px" in page
