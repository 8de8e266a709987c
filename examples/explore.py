"""Interactive explorer: one self-contained HTML page per model, opened from disk.

Writes ``explore_vit.html`` (shapes-vit on the bundled samples) and ``explore_caption.html``
(shapes-captioner); open them in a browser, hover or click a patch::

    python examples/explore.py --out out/explore
    python examples/explore.py --out out/explore --screenshot assets/figures/explorer.png
    python examples/explore.py --out /tmp/ex --quick        # CI smoke mode (one image each)

``--screenshot`` needs Playwright (``pip install playwright``) and a chromium on PATH (Debian:
``apt-get install chromium``); it pins a patch in the first layer and saves the first card.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import vitexplain as vx

SAMPLES = Path(__file__).resolve().parent.parent / "assets" / "samples"


def screenshot(page: Path, png: Path) -> None:
    """Open ``page`` in headless chromium, pin patch (5, 2) at layer 0 and save the first card."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("--screenshot needs chromium on PATH (Debian: apt-get install chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True, args=flags, viewport={"width": 1360, "height": 900}
        )
        tab = context.new_page()
        tab.goto(page.resolve().as_uri())
        tab.wait_for_selector("body[data-vx-ready='1']")
        tab.select_option('select[data-vx="layer"] >> nth=0', "0")
        view = tab.locator('.vx-view:has(canvas[data-vx="attn"])').first
        box = view.bounding_box()
        view.click(position={"x": 2.5 * box["width"] / 8, "y": 5.5 * box["height"] / 8})
        png.parent.mkdir(parents=True, exist_ok=True)
        tab.locator(".vx-card").first.screenshot(path=str(png))
        context.close()
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/explore", help="output folder")
    parser.add_argument("--screenshot", type=Path, help="also save a PNG of the first card (needs chromium)")
    parser.add_argument("--quick", action="store_true", help="CI smoke mode")
    args = parser.parse_args()
    vx.threads.limit()  # leave a core to other jobs: threads that outnumber free cores only wait (docs/benchmarks.md)

    images = sorted(SAMPLES.glob("*.png"))
    images = images[3:4] if args.quick else images[3:6]
    out = Path(args.out)
    vit = vx.explore(vx.zoo.load("shapes-vit"), images, out / "explore_vit.html", title="shapes-vit explorer")
    print(f"wrote {vit} ({vit.stat().st_size / 1e6:.2f} MB)")
    cap = vx.explore(vx.zoo.load("shapes-captioner"), images[:2], out / "explore_caption.html",
                     title="shapes-captioner explorer")
    print(f"wrote {cap} ({cap.stat().st_size / 1e6:.2f} MB)")
    if args.screenshot:
        screenshot(vit, args.screenshot)


if __name__ == "__main__":
    main()
