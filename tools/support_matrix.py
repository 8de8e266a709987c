"""Write the README's support matrix and docs/support.md from tests/support_table.py's table.

Usage: python tools/support_matrix.py [--check]

Runs every method on a tiny random-init build of every family (about 30 s on 2 CPU cores),
then replaces the README block between the ``support-matrix`` markers and rewrites
docs/support.md. ``--check`` only reports whether both are up to date (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def readme_with(text: str, table: str) -> str:
    """README text with the block between the markers replaced by ``table``."""
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    return f"{before}{START}\n{table}\n{END}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the files are up to date")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import support_table as support

    import torch

    torch.set_num_threads(1)  # tiny models: one thread is as fast, and fair to other jobs
    start = time.perf_counter()
    results = [support.run(row) for row in support.rows()]
    readme_path, doc_path = ROOT / "README.md", ROOT / "docs" / "support.md"
    readme = readme_with(readme_path.read_text(), support.readme_table(results))
    doc = support.support_doc(results) + "\n"
    if args.check:
        stale = [p.name for p, text in ((readme_path, readme), (doc_path, doc)) if not p.exists() or p.read_text() != text]
        print("out of date: " + ", ".join(stale) if stale else "up to date")
        return 1 if stale else 0
    readme_path.write_text(readme)
    doc_path.write_text(doc)
    print(f"wrote {readme_path.name} and docs/{doc_path.name} ({len(results)} rows, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
