"""Every record type in one table: the store's table that keeps it, what the collector keeps of it
for the live views, and the order the store reads it back in. A new record type is a class in
records.py and one entry here: the wire, the store and the collector read the rest from it."""
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Type, TypeVar

import msgspec

from traceml.records import (CodeSample, CompileRecord, Finding, HostSyncSample, LayerCapture, LayerReport, LoaderSample,
                             MemoryLedger, OomRecord, RankEnd, RankHello, RankPulse, RolledStep, ScalarRecord,
                             SpanRecord, StepRecord, SystemSample)

R = TypeVar("R", bound=msgspec.Struct)  # a record of some type
RecordsByType = Mapping[Type[msgspec.Struct], Sequence[msgspec.Struct]]  # each type's records, as kept


@dataclass(frozen=True)
class RecordType:
    """Where one record type is kept."""

    record: Type[msgspec.Struct]  # the record's class
    table: str  # the store's table; "": not stored
    # The fields kept as columns of their own before the record, and with `latest` the table's
    # key; a table without `document` has a column per field (a field that is not a scalar holds JSON).
    keys: Tuple[str, ...] = ()
    document: str = ""  # the column that holds the whole record as JSON
    latest: bool = False  # a record replaces the stored one with the same keys (cumulative records)
    order: str = "rowid"  # the order the store reads the table back in
    indexes: Tuple[Tuple[str, ...], ...] = ()  # the table's indexes, by their columns
    # How many the collector keeps for the live views and the rules (None: all, 0: none), of
    # each value of the `per` fields.
    recent: Optional[int] = None
    per: Tuple[str, ...] = ()
    sent: bool = True  # travels on the wire


RANK = ("rank",)
RECORD_TYPES: Dict[Type[msgspec.Struct], RecordType] = {kind.record: kind for kind in (
    RecordType(RankHello, "ranks", RANK, "hello", latest=True, order="rank", recent=1, per=RANK),
    RecordType(StepRecord, "steps", ("rank", "step"), latest=True, order="step, rank", recent=512, per=RANK),
    RecordType(RankEnd, "ranks", RANK, "end_record", latest=True, order="rank", recent=1, per=RANK),
    RecordType(SystemSample, "system", order="unix_s", recent=900),  # the node's, one a second: 15 minutes
    RecordType(OomRecord, "ooms", ("rank", "step"), "oom", order="step, rank"),
    RecordType(LayerReport, "layer_reports", RANK, "report", latest=True, order="rank", recent=1, per=RANK),
    RecordType(LayerCapture, "captures", ("rank", "step", "reason"), "capture", order="step, rank"),
    RecordType(SpanRecord, "spans", indexes=(("step",), ("name", "step")), recent=0),
    RecordType(ScalarRecord, "scalars", indexes=(("name", "step"),), recent=0),
    RecordType(CompileRecord, "compiles", ("rank", "step"), "compile"),
    RecordType(HostSyncSample, "host_syncs", ("rank", "first_step"), "sample"),
    # Every rank's DataLoader figures, two a second each; its memory ledger, when a figure moves.
    RecordType(LoaderSample, "loaders", ("rank", "loader", "unix_s"), "sample", order="rank, rowid", recent=1024),
    RecordType(MemoryLedger, "ledgers", ("rank", "step"), "ledger", order="rank, rowid", recent=4096),
    RecordType(RankPulse, "", recent=1, per=RANK),  # the hang watch reads each rank's latest
    RecordType(CodeSample, "code_sites", ("rank", "part"), "sample", latest=True, order="rank, part", recent=1,
               per=("rank", "part")),
    # The collector's own: steps rolled up across ranks, and the run's findings.
    RecordType(RolledStep, "rolled", ("step",), latest=True, order="step", recent=0, sent=False),
    RecordType(Finding, "findings", ("kind", "severity", "rank"), "finding", recent=0, sent=False),
)}
