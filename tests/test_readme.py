"""The README's "Your own model" example runs as written and does what it says."""

from __future__ import annotations

from pathlib import Path

import torch

import vitexplain as vx
from vitexplain.adapters import base

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text[text.index("### Your own model") :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_own_model_example_registers_an_adapter_and_explains(capsys):
    from vitexplain.adapters import _load_adapters

    _load_adapters()  # the built-in detectors register on first use: snapshot them too, or the restore drops them
    detectors = list(base._DETECTORS)
    namespace: dict = {}
    try:
        exec(compile(_example(), "README.md", "exec"), namespace)
        model = namespace["model"]
        adapter = vx.adapters.adapter_for(model)
        assert type(adapter).__name__ == "TinyViTAdapter"
        assert vx.methods.names(model) == vx.methods.names("vit")  # every ViT method applies
        assert "'legrad'" in capsys.readouterr().out
        generic, smooth, legrad = namespace["maps"]
        for e in (generic, smooth, legrad):
            assert e.maps.shape == (2, 4, 4) and torch.isfinite(e.maps).all() and float(e.maps.std()) > 0
        # the example's tail really is the model's: re-running it reproduced the logits (else
        # smooth CDAM would have raised); a wrong head is refused
        namespace["TinyViTAdapter"].head = lambda self, tokens: self.model.head(tokens[:, 0])
        try:
            vx.Explainer(model).explain(torch.randn(1, 3, 32, 32), method="cdam_smooth")
        except vx.UnsupportedModelError as err:
            assert "does not reproduce" in str(err)
        else:
            raise AssertionError("a head that does not match the model was not refused")
    finally:
        base._DETECTORS[:] = detectors
