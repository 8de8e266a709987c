"""Write docs/support.md (the support matrix) from tests/support_table.py's table.

Usage: python tools/support_matrix.py [--check]

Runs every method on a tiny random-init build of every family (about 30 s on 2 CPU cores),
then rewrites docs/support.md. ``--check`` only reports whether it is up to date (exit status 1
if not).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    doc_path = ROOT / "docs" / "support.md"
    doc = support.support_doc(results) + "\n"
    if args.check:
        stale = not doc_path.exists() or doc_path.read_text() != doc
        print("out of date: docs/support.md" if stale else "up to date")
        return 1 if stale else 0
    doc_path.write_text(doc)
    print(f"wrote docs/{doc_path.name} ({len(results)} rows, {time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
