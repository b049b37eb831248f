"""The run's store: every record in one SQLite file (WAL), the single source every view reads."""
from __future__ import annotations

import json
import sqlite3
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import msgspec

from traceml import rundir
from traceml.collector.rollup import RolledStep
from traceml.records import (CompileRecord, Finding, GpuSample, LayerCapture, LayerReport, OomRecord, RankEnd, RankHello,
                             ScalarRecord, SpanRecord, StepRecord, SystemSample)

STEP_COLUMNS = msgspec.structs.fields(StepRecord)
ROLLED_COLUMNS = msgspec.structs.fields(RolledStep)
_ROLLED_NAMES = [field.name for field in ROLLED_COLUMNS]
_STEP_NAMES = [field.name for field in STEP_COLUMNS]
WAL_PAGES = 64
CHUNK_RECORDS = 64  # after a failed commit, records are written again this many at a time
_SYSTEM_NAMES = [field.name for field in msgspec.structs.fields(SystemSample) if field.name != "gpus"]


def _sql_type(field: Any) -> str:
    kind = field.type
    text = str(kind)
    if kind is float or "float" in text:
        return "REAL"
    if kind is bool or kind is int or "int" in text:
        return "INTEGER"
    return "TEXT"


_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS steps ({", ".join(f"{f.name} {_sql_type(f)}" for f in STEP_COLUMNS)},
                                  PRIMARY KEY (rank, step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rolled ({", ".join(f"{f.name} {_sql_type(f)}" for f in ROLLED_COLUMNS)},
                                   PRIMARY KEY (step)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS system ({", ".join(_SYSTEM_NAMES)}, gpus TEXT);
CREATE TABLE IF NOT EXISTS ranks (rank INTEGER PRIMARY KEY, hello TEXT, end_record TEXT);
CREATE TABLE IF NOT EXISTS findings (kind TEXT, severity TEXT, rank INTEGER, finding TEXT);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS ooms (rank INTEGER, step INTEGER, oom TEXT);
CREATE TABLE IF NOT EXISTS layer_reports (rank INTEGER PRIMARY KEY, report TEXT);
CREATE TABLE IF NOT EXISTS captures (rank INTEGER, step INTEGER, reason TEXT, capture TEXT);
CREATE TABLE IF NOT EXISTS compiles (rank INTEGER, step INTEGER, compile TEXT);
CREATE TABLE IF NOT EXISTS spans (rank INTEGER, step INTEGER, name TEXT, start_unix_s REAL,
                                  duration_ms REAL, count INTEGER);
CREATE TABLE IF NOT EXISTS scalars (rank INTEGER, step INTEGER, name TEXT, value REAL);
CREATE INDEX IF NOT EXISTS spans_by_step ON spans (step);
CREATE INDEX IF NOT EXISTS spans_by_name ON spans (name, step);
CREATE INDEX IF NOT EXISTS scalars_by_name ON scalars (name, step);
"""


class StoreFull(Exception):
    """Some records did not fit in the store (a full disk); the rest were kept."""


class Store:
    """A thread-safe wrapper around one SQLite connection; ":memory:" when no file can be written.

    The collector holds the one writing Store of a run. Views open their own with
    readonly=True: a separate connection, so their reads never wait on the writer's lock, and
    one that cannot write even by mistake.
    """

    def __init__(self, path: str, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        self._lock = threading.Lock()
        self._pending: List[Tuple[Callable[[list], None], list]] = []
        self._replay_needed = False
        self._reserve: Optional[Path] = None  # room held for folding the log when the disk fills
        if readonly:
            self._db = _connect_readonly(path)
            return
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        if path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Each commit appends every page it touched to the log again: fold the log into the
            # file every WAL_PAGES and keep its file that small, so that a filling disk holds
            # records, not old copies of pages.
            self._db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
            self._db.execute(f"PRAGMA journal_size_limit={WAL_PAGES * 4096}")
            reserve = Path(path + "-reserve")
            self._reserve = reserve if rundir.hold_room(reserve, WAL_PAGES * 4096) else None
        self._db.executescript(_SCHEMA)
        self._db.execute("BEGIN")
        self._step_insert = (f"INSERT OR REPLACE INTO steps ({', '.join(_STEP_NAMES)}) "
                             f"VALUES ({', '.join('?' * len(_STEP_NAMES))})")
        self._system_insert = (f"INSERT INTO system ({', '.join(_SYSTEM_NAMES)}, gpus) "
                               f"VALUES ({', '.join('?' * (len(_SYSTEM_NAMES) + 1))})")

    # -- writing ----------------------------------------------------------------------------
    # Everything written since the last commit is also kept in memory, in chunks of at most
    # CHUNK_RECORDS. When a commit fails (a full disk) it is rolled back and the chunks are
    # written again one transaction each: every chunk that fits is kept, whatever the size of
    # the one transaction that did not fit.
    def write(self, records: Iterable[Any]) -> None:
        records = list(records)
        for start in range(0, len(records), CHUNK_RECORDS):
            self._apply(self._insert_records, records[start:start + CHUNK_RECORDS])

    def write_rolled(self, rolled: List[RolledStep]) -> None:
        """Steps rolled up across ranks (by the collector as they complete); a step rolled
        again replaces its earlier row."""
        for start in range(0, len(rolled), CHUNK_RECORDS):
            self._apply(self._insert_rolled, rolled[start:start + CHUNK_RECORDS])

    def write_findings(self, findings: List[Finding]) -> None:
        self._apply(self._replace_findings, findings)

    def set_meta(self, values: Dict[str, Any]) -> None:
        self._apply(self._insert_meta, list(values.items()))

    def commit(self) -> None:
        """Make what was written durable. When that fails, keep every chunk that still fits
        and raise StoreFull saying how many records were lost; writing carries on either way."""
        with self._lock:
            if not self._replay_needed:
                try:
                    self._db.execute("COMMIT")
                    self._pending.clear()
                    return
                except sqlite3.Error:
                    pass
                finally:
                    if not self._db.in_transaction:
                        self._db.execute("BEGIN")
            lost, first_error = self._replay_pending()
        if lost:
            raise StoreFull(f"{lost} records did not fit ({first_error})")

    def _apply(self, action: Callable[[list], None], items: list) -> None:
        with self._lock:
            self._pending.append((action, items))
            if self._replay_needed:  # the open transaction is in doubt: the commit rewrites it
                return
            try:
                action(items)
            except sqlite3.Error:
                self._replay_needed = True
                raise

    def _replay_pending(self) -> Tuple[int, Optional[Exception]]:
        """Roll back, then write each pending chunk in a transaction of its own. Lock held."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        # The log file keeps the size the failed transaction gave it, and only a fold of its
        # committed pages into the file lets it shrink: the reserve makes room for that fold.
        self._release_reserve()
        self._checkpoint()
        lost, first_error = 0, None
        for action, items in self._pending:
            for attempt in range(2):
                try:
                    self._db.execute("BEGIN")
                    action(items)
                    self._db.execute("COMMIT")
                    break
                except sqlite3.Error as exc:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    if attempt == 0:  # fold the log into the file: its pages are free again
                        self._checkpoint()
                        continue
                    lost += len(items)
                    first_error = first_error or exc
        self._pending.clear()
        self._replay_needed = False
        self._db.execute("BEGIN")
        return lost, first_error

    def _release_reserve(self) -> None:
        if self._reserve is not None:
            rundir.give_room_back(self._reserve)
            self._reserve = None

    def _checkpoint(self) -> None:
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass

    def _insert_records(self, records: List[Any]) -> None:
        steps: List[tuple] = []
        samples: List[list] = []
        spans: List[tuple] = []
        scalars: List[tuple] = []
        for record in records:
            if type(record) is StepRecord:
                steps.append(msgspec.structs.astuple(record))
            elif type(record) is SystemSample:
                values = [getattr(record, name) for name in _SYSTEM_NAMES]
                values.append(msgspec.json.encode(record.gpus).decode())
                samples.append(values)
            elif type(record) is RankHello:
                self._db.execute(
                    "INSERT INTO ranks (rank, hello) VALUES (?, ?) "
                    "ON CONFLICT(rank) DO UPDATE SET hello = excluded.hello",
                    (record.rank, msgspec.json.encode(record).decode()))
            elif type(record) is LayerReport:  # cumulative: the latest replaces the rest
                self._db.execute("INSERT OR REPLACE INTO layer_reports VALUES (?, ?)", (
                    record.rank, msgspec.json.encode(record).decode()))
            elif type(record) is LayerCapture:
                self._db.execute("INSERT INTO captures VALUES (?, ?, ?, ?)", (
                    record.rank, record.step, record.reason, msgspec.json.encode(record).decode()))
            elif type(record) is CompileRecord:
                self._db.execute("INSERT INTO compiles VALUES (?, ?, ?)", (
                    record.rank, record.step, msgspec.json.encode(record).decode()))
            elif type(record) is OomRecord:
                self._db.execute("INSERT INTO ooms VALUES (?, ?, ?)", (
                    record.rank, record.step, msgspec.json.encode(record).decode()))
            elif type(record) is RankEnd:
                self._db.execute(
                    "INSERT INTO ranks (rank, end_record) VALUES (?, ?) "
                    "ON CONFLICT(rank) DO UPDATE SET end_record = excluded.end_record",
                    (record.rank, msgspec.json.encode(record).decode()))
            elif type(record) is SpanRecord:
                spans.append(msgspec.structs.astuple(record))
            elif type(record) is ScalarRecord:
                scalars.append(msgspec.structs.astuple(record))
        if spans:
            self._db.executemany("INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?)", spans)
        if scalars:
            self._db.executemany("INSERT INTO scalars VALUES (?, ?, ?, ?)", scalars)
        if steps:
            self._db.executemany(self._step_insert, steps)
        if samples:
            self._db.executemany(self._system_insert, samples)

    def _insert_rolled(self, rolled: List[RolledStep]) -> None:
        self._db.executemany(
            f"INSERT OR REPLACE INTO rolled ({', '.join(_ROLLED_NAMES)}) "
            f"VALUES ({', '.join('?' * len(_ROLLED_NAMES))})",
            [msgspec.structs.astuple(step) for step in rolled])

    def _replace_findings(self, findings: List[Finding]) -> None:
        self._db.execute("DELETE FROM findings")
        self._db.executemany(
            "INSERT INTO findings VALUES (?, ?, ?, ?)",
            [(f.kind, f.severity, f.rank, msgspec.json.encode(f).decode()) for f in findings])

    def _insert_meta(self, items: List[Tuple[str, Any]]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                             [(key, json.dumps(value)) for key, value in items])

    def close(self) -> None:
        """Commit what is left (raising StoreFull for what did not fit) and close."""
        try:
            if not self.readonly:
                self.commit()
        finally:
            with self._lock:
                self._db.close()
                self._release_reserve()

    # -- reading ----------------------------------------------------------------------------
    def query(self, sql: str, params: Sequence[Any] = ()) -> List[tuple]:
        """Rows of one read-only statement (the web views' downsampling queries)."""
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def steps(self) -> List[StepRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_STEP_NAMES)} FROM steps ORDER BY step, rank").fetchall()
        return [StepRecord(*row) for row in rows]

    def rolled_steps(self) -> List[RolledStep]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_ROLLED_NAMES)} FROM rolled ORDER BY step").fetchall()
        return [RolledStep(*row) for row in rows]

    def steps_where(self, condition: str, params: Sequence[Any] = ()) -> List[StepRecord]:
        """Step records matching an SQL condition on the steps table, in step then rank order."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_STEP_NAMES)} FROM steps WHERE {condition} "
                                    f"ORDER BY step, rank", params).fetchall()
        return [StepRecord(*row) for row in rows]

    def hellos(self) -> List[RankHello]:
        return [msgspec.json.decode(text, type=RankHello) for text in self._column("hello")]

    def ends(self) -> List[RankEnd]:
        return [msgspec.json.decode(text, type=RankEnd) for text in self._column("end_record")]

    def _column(self, name: str) -> List[str]:
        with self._lock:
            rows = self._db.execute(f"SELECT {name} FROM ranks WHERE {name} IS NOT NULL ORDER BY rank")
            return [row[0] for row in rows.fetchall()]

    def system_samples(self) -> List[SystemSample]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_SYSTEM_NAMES)}, gpus FROM system ORDER BY unix_s").fetchall()
        return [SystemSample(**dict(zip(_SYSTEM_NAMES, row[:-1])),
                             gpus=msgspec.json.decode(row[-1], type=List[GpuSample]))
                for row in rows]

    def layer_reports(self) -> List[LayerReport]:
        with self._lock:
            rows = self._db.execute("SELECT report FROM layer_reports ORDER BY rank").fetchall()
        return [msgspec.json.decode(row[0], type=LayerReport) for row in rows]

    def captures(self) -> List[LayerCapture]:
        with self._lock:
            rows = self._db.execute("SELECT capture FROM captures ORDER BY step, rank").fetchall()
        return [msgspec.json.decode(row[0], type=LayerCapture) for row in rows]

    def compiles(self) -> List[CompileRecord]:
        """torch.compile's compilations, in the order they happened (an older store: none)."""
        with self._lock:
            try:
                rows = self._db.execute("SELECT compile FROM compiles ORDER BY rowid").fetchall()
            except sqlite3.OperationalError:
                return []
        return [msgspec.json.decode(row[0], type=CompileRecord) for row in rows]

    def ooms(self) -> List[OomRecord]:
        with self._lock:
            rows = self._db.execute("SELECT oom FROM ooms ORDER BY step, rank").fetchall()
        return [msgspec.json.decode(row[0], type=OomRecord) for row in rows]

    def findings(self) -> List[Finding]:
        with self._lock:
            rows = self._db.execute("SELECT finding FROM findings ORDER BY rowid").fetchall()
        return [msgspec.json.decode(row[0], type=Finding) for row in rows]

    def meta(self) -> Dict[str, Any]:
        with self._lock:
            rows = self._db.execute("SELECT key, value FROM meta").fetchall()
        return {key: json.loads(value) for key, value in rows}



def _connect_readonly(path: str) -> sqlite3.Connection:
    """Open a run's store for reading only. A finished run in a directory we may not write
    (SQLite would create its WAL index there) is opened as immutable: it no longer changes."""
    uri = "file:" + urllib.parse.quote(path)
    for flags in ("?mode=ro", "?mode=ro&immutable=1"):
        db = sqlite3.connect(uri + flags, uri=True, check_same_thread=False, isolation_level=None)
        try:
            db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return db
        except sqlite3.OperationalError:
            db.close()
            if flags.endswith("immutable=1"):
                raise
    raise AssertionError("unreachable")
