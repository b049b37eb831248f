"""A patch's undo list: what install() changed, put back newest first by remove()."""
from __future__ import annotations

from typing import Any, Callable, List


class Patch:
    """One concern's patch: install() changes things through replace() and on_remove(), and
    remove() undoes them newest first, leaving torch (and the rest) as it was."""

    def __init__(self) -> None:
        self._undo: List[Callable[[], None]] = []

    def install(self) -> None:
        """Put the patch in place (each concern's own; some patch only when asked)."""

    def replace(self, owner: Any, name: str, replacement: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        self._undo.append(lambda: setattr(owner, name, original))

    def on_remove(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
