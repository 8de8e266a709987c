"""Explanation methods: pure functions from a captured forward (+ target) to maps.

``vx.methods.names()`` lists every method, ``vx.methods.names("cnn")`` those of one family;
which apply to a given model is its plan's answer: ``vx.Explainer(model).methods()``.
Definitions: docs/methods.md; each function's docstring says which paper (or which peer
implementation) it follows. Importing this package registers every built-in method, in the
order below (which is the order of every listing).
"""

from .families import CAPTION, CNN, HIER, SWIN, VIT, VLM, Family, families, family, register_family
from .options import Option
from .registry import CAPABILITIES, MethodSpec, check_options, get, names, register, specs

# built-in methods, registered on import, in listing order
from . import attention, gradients, tokens, legrad, captum_methods, swin, hier, hier_legrad, hier_cdam, lrp, lrp_hier, cnn, caption, lrp_caption, vlm, lrp_vlm  # noqa: E402,F401

__all__ = [
    "MethodSpec", "Option", "Family", "names", "get", "register", "specs", "check_options", "families", "family",
    "register_family", "CAPABILITIES", "VIT", "SWIN", "HIER", "CNN", "CAPTION", "VLM",
]
