"""Run a function on a module right after it is first imported, wherever and by whom it is imported.

pled's seams (``safetensors.safe_open``, vLLM's loader functions) must be wrapped before any caller takes a
reference with ``from safetensors import safe_open``. One finder at the front of ``sys.meta_path`` wraps
the loader of the modules named here; a module already imported is handled at once. Cheap to install:
nothing is imported until the program imports it.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_lock = threading.RLock()
_after: dict[str, list[Callable]] = {}


def after_import(name: str, callback: Callable) -> None:
    """Call ``callback(module)`` once module ``name`` is imported (now, if it already is)."""
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
        if callback in _after.get(name, ()):
            return
        _after.setdefault(name, []).append(callback)
    module = sys.modules.get(name)
    if module is not None:
        _call(callback, module)


def _call(callback, module) -> None:
    """A fault in pled's own wrapping never breaks the program's import: one line, and the module as it was; except
    an error that says it must (``fatal_to_import``: a seam pled needs does not fit, and going on would quietly give
    vLLM's private copies of tables pled serves)."""
    try:
        callback(module)
    except Exception as err:
        if getattr(err, "fatal_to_import", False):
            raise
        sys.stderr.write(f"pled: could not wrap {module.__name__} ({type(err).__name__}: {err}); "
                         "files are read from disk there\n")


class _Finder:  # a meta path finder (duck-typed: importlib.abc costs 60 ms to import at start-up)
    def find_spec(self, fullname, path, target=None):
        if fullname not in _after:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader:
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        for callback in list(_after.get(module.__name__, ())):
            _call(callback, module)
