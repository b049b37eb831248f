"""Patches applied at a module's first import: modules a run may never use (torch.distributed.
checkpoint, a trainer, torch._dynamo) are patched when the script imports them, never imported
by TraceML."""
import logging
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence

from traceml.probe.patches.patch import Patch

log = logging.getLogger("traceml")
WhenImported = Callable[[str, Callable[[ModuleType], None]], None]  # ImportHooks.when_imported


class ImportHooks(Patch):
    """A sys.meta_path finder, there while a patch waits for its module's first import."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: Dict[str, List[Callable[[ModuleType], None]]] = {}

    def when_imported(self, module_name: str, patch: Callable[[ModuleType], None]) -> None:
        """Run patch(module) now if the module is imported, else right after its first import."""
        module = sys.modules.get(module_name)
        if module is not None:
            _apply_patch(patch, module)
            return
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
            self.on_remove(self._leave)
        self.waiting.setdefault(module_name, []).append(patch)

    def _leave(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self.waiting.clear()  # patches still waiting are dropped with the finder

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None) -> Optional[ModuleSpec]:
        if name not in self.waiting:
            return None  # every other import: one dict lookup
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec, waiting = loader.exec_module, self.waiting

        def exec_module(module: ModuleType) -> None:
            try:
                original_exec(module)
            finally:
                del loader.exec_module  # the loader as it was
            for patch in waiting.pop(name, ()):
                _apply_patch(patch, module)

        loader.exec_module = exec_module
        return spec


def _apply_patch(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        patch(module)
    except Exception:  # a library version we do not know: less telemetry, never the user's run
        log.debug("traceml: could not patch %s", getattr(module, "__name__", module), exc_info=True)
