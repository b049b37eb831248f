"""`traceml_ai`, the seed's package name: an alias of `traceml`. `traceml_ai.X` is the very
module `traceml.X` (one probe, one state), not a copy."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Optional

import traceml

_PREFIX = __name__ + "."


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `traceml_ai.<path>` to the already imported (or now imported) `traceml.<path>`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if not fullname.startswith(_PREFIX):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module("traceml." + spec.name[len(_PREFIX):])

    def exec_module(self, module: Any) -> None:
        pass  # the traceml module is already executed


sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str) -> Any:
    return getattr(traceml, name)
