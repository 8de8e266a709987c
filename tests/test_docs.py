"""The package cites only documents that ship in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (the package may be installed elsewhere)
PACKAGE = ROOT / "vitexplain"


def test_every_cited_document_is_in_the_repository():
    cited: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        assert "references.md" not in text, f"{path} cites references.md, which is not in the repository"
        for doc in re.findall(r"\b(docs/[\w./-]+\.md)\b", text):
            cited.setdefault(doc, []).append(str(path.relative_to(ROOT)))
    assert "docs/methods.md" in cited
    missing = {doc: files for doc, files in cited.items() if not (ROOT / doc).is_file()}
    assert not missing, missing
