"""Explanation methods: pure functions from a captured forward (+ target) to maps.

``vx.methods.names()`` lists every method; ``vx.methods.names(model)`` those that apply to
a model. Definitions follow references.md; each function's docstring says which paper (or
which peer implementation) it follows.
"""

from .registry import MethodSpec, get, names, register, specs

__all__ = ["MethodSpec", "names", "get", "register", "specs"]
