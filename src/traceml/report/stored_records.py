"""A run's stored records as plain rows, for `traceml export`: steps, spans and scalars between
two steps, read from its store a row at a time rather than the run loaded whole."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator, List

import msgspec

from traceml import rundir
from traceml.collector.store import Store
from traceml.records import StepRecord

STEP_FIELDS = list(StepRecord.__struct_fields__)  # a step row's keys, in the store's order


class StoredRecords:
    """One run directory's records, read-only; close() when done."""

    def __init__(self, store: Store):
        self.store = store

    @classmethod
    def open(cls, run_dir: Path) -> "StoredRecords":
        """Raises rundir.RunDirError when run_dir holds no run."""
        return cls(Store(os.fspath(rundir.finished_store(run_dir)), readonly=True))

    def steps(self, first: int, last: int) -> Iterator[Dict[str, Any]]:
        for step in self.store.steps_between(first, last):
            yield msgspec.structs.asdict(step)

    def spans(self, first: int, last: int) -> List[Dict[str, Any]]:
        return [msgspec.structs.asdict(span) for span in self.store.spans_between(first, last)]

    def scalars(self, first: int, last: int) -> List[Dict[str, Any]]:
        return [msgspec.structs.asdict(scalar) for scalar in self.store.scalars_between(first, last)]

    def close(self) -> None:
        self.store.close()
