"""The public names are plain functions, whatever submodules were imported first."""

import subprocess
import sys


def test_public_functions_are_functions_not_modules() -> None:
    # importing every submodule first used to bind a module under the function's name
    code = (
        "import inspect, importlib, pkgutil, vitexplain as vx\n"
        "for info in pkgutil.walk_packages(vx.__path__, 'vitexplain.'):\n"
        "    if not info.name.startswith('vitexplain.__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "for value in (vx.capture, vx.data.shapes, vx.viz.overlay, vx.viz.grid, vx.overlay, vx.load_image, vx.explore):\n"
        "    assert inspect.isfunction(value), value\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
