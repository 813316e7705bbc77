"""Everything about the package is in pyproject.toml; this file only ships pled's start-up hook.

``pled-autoload.pth`` must sit in site-packages itself (the site module runs the ``import`` lines of the
.pth files it finds there at every interpreter start), not inside the package. A wheel gets it from the
top of the build tree, which is installed into purelib; an editable install (``pip install -e``) gets it
written beside setuptools' own ``__editable__`` .pth, which sorts, and so runs, before it. Should a future
setuptools change the editable machinery, the editable install still works, only without the hook.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PTH = "pled-autoload.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": build_py_with_pth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # a setuptools without PEP 660 editable wheels
    editable_wheel = None


class _StrategyWithPth:
    """setuptools' editable strategy, plus the start-up hook written into the editable wheel."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(os.path.join(HERE, PTH), "rb") as f:
            wheel.writestr(PTH, f.read())


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class editable_wheel_with_pth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = editable_wheel_with_pth

setup(cmdclass=cmdclass)
