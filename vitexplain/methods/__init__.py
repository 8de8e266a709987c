"""Explanation methods: pure functions from a captured forward (+ target) to maps.

``vx.methods.names()`` lists every method; ``vx.methods.names(model)`` those that apply to
a model. Definitions: docs/methods.md; each function's docstring says which paper (or which
peer implementation) it follows. Importing this package registers every built-in method, in
the order below (which is the order of every listing).
"""

from .options import Option
from .registry import MethodSpec, check_options, get, names, register, specs

# built-in methods, registered on import, in listing order
from . import attention, gradients, tokens, legrad, captum_methods, swin, cnn, caption  # noqa: E402,F401

__all__ = ["MethodSpec", "Option", "names", "get", "register", "specs", "check_options"]
