"""A patch's undo list: what install() changed, put back newest first by remove()."""
from typing import Any, Callable, List

ABSENT = object()


class Patch:
    """One concern's patch on the probe's behalf: install() changes things through replace()
    and on_remove(), and remove() undoes them newest first, leaving torch as it was."""

    def __init__(self, probe: Any = None) -> None:
        self.probe = probe  # the StepProbe the patch reports to
        self._undo: List[Callable[[], None]] = []

    def install(self) -> None:
        """Put the patch in place (each concern's own; some patch only when asked)."""

    def replace(self, owner: object, name: str, replacement: object) -> None:
        """Set owner.name; remove() puts back owner's own, or deletes it where it was inherited."""
        own = owner.__dict__.get(name, ABSENT)
        setattr(owner, name, replacement)
        self._undo.append(lambda: delattr(owner, name) if own is ABSENT else setattr(owner, name, own))

    def on_remove(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
