"""The user guide's "Your own model" example runs as written and does what it says, and the
README quotes no figure that its benchmarks did not produce.

It registers an adapter for the whole process, so it runs in a child process: the registry
of this test session is never changed, whatever order the tests run in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"

CHECKS = '''
import json
assert type(vx.adapters.adapter_for(model)).__name__ == "TinyViTAdapter"
listed = vx.Explainer(model).methods()
report = {"listed": listed, "vit": vx.methods.names("vit")}
report["maps"] = [[list(e.maps.shape), bool(torch.isfinite(e.maps).all()), float(e.maps.std())] for e in maps]
# the example's head really is the model's (smooth CDAM re-ran it and was not refused); a wrong head is refused
TinyViTAdapter.head = lambda self, tokens: self.model.head(tokens[:, 0])
try:
    vx.Explainer(model).explain(torch.randn(1, 3, 32, 32), method="cdam_smooth")
    report["wrong_head"] = "accepted"
except vx.UnsupportedModelError as err:
    report["wrong_head"] = str(err)
print("REPORT " + json.dumps(report))
'''


def _example() -> str:
    text = GUIDE.read_text()
    section = text[text.index("## Your own model") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_own_model_example_registers_an_adapter_and_explains():
    result = subprocess.run([sys.executable, "-c", _example() + CHECKS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    printed, report_line = result.stdout.strip().splitlines()[-2:]
    report = json.loads(report_line.removeprefix("REPORT "))
    assert report["listed"] == report["vit"]  # every ViT method applies, and the example prints them
    assert printed == str(report["listed"]) and "'legrad'" in printed
    for shape, finite, std in report["maps"]:
        assert shape == [2, 4, 4] and finite and std > 0
    assert "does not reproduce" in report["wrong_head"]


def test_every_figure_in_the_readme_comes_from_the_benchmarks():
    """A measured figure (a decimal such as 0.989 or 1.08x) in the README's prose must appear in
    docs/benchmarks.md, which only the benchmark scripts write: hand-copied numbers drift."""
    import re

    readme = (ROOT / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)  # code blocks hold calls, not measurements
    prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets
    figures = set(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", prose)) - {"3.9"}  # 3.9: the Python version
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert figures, "the README quotes no measured figure: this test would check nothing"
    missing = sorted(f for f in figures if f not in benchmarks)
    assert not missing, f"README figures not in docs/benchmarks.md: {missing}"
