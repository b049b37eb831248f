"""What the collector asks of the analysis the run hands it (collector.server.Collector's `live`,
`run_time` and `hang_watch`), and what the live views read of them: the collector imports no
analysis, the analysis none of the collector's sockets."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Collection, Dict, Iterable, List, Optional, Protocol

from traceml.records import RolledStep, StepRecord

if TYPE_CHECKING:
    from traceml.analysis.goodput import Goodput
    from traceml.collector.server import Collector
    from traceml.diagnose.hangs import Hang


class StepRollup(Protocol):
    """Rolls each step up across ranks as its records come (analysis.rollup.LiveRollup)."""

    world_size: int
    newest_step: int
    rolled_out: List[RolledStep]  # rolled since the collector last took them, for the store

    @property
    def recent(self) -> Collection[RolledStep]:
        """The latest rolled steps, oldest first."""

    def add(self, records: Iterable[StepRecord]) -> None: ...

    def take_rolled(self) -> List[RolledStep]: ...

    def finish(self, steps_at: Callable[[List[int]], List[StepRecord]]) -> List[RolledStep]: ...


class WallTimeTally(Protocol):
    """Every rank's wall time by part, from each record (analysis.goodput.RunTime)."""

    def add(self, record: object) -> None: ...

    def goodput(self, now_unix_s: Optional[float]) -> Optional[Goodput]: ...

    def to_builtins(self) -> List[Dict[str, object]]: ...


class HangCheck(Protocol):
    """Looks at the ranks every HANG_CHECK_S (report.live.HangWatch): `hang` while one holds."""

    hang: Optional[Hang]

    def check(self, collector: Collector, now_unix_s: float) -> None: ...
