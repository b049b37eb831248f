"""The run's store: every record in one SQLite file (WAL), the single source every view reads."""
from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type, Union

import msgspec
from msgspec.structs import FieldInfo

from traceml import rundir
from traceml.record_types import RECORD_TYPES, R, RecordType
from traceml.records import ALL_PHASES, Finding, GpuSample, RolledStep, ScalarRecord, SpanRecord, StepRecord, SystemSample

# The series each table's rows belong to, indexed with the step: a rank's steps, a span's or a
# scalar's name.
SERIES = {"steps": "rank", "spans": "name", "scalars": "name"}
SeriesKey = Union[int, str]  # a series' value of its SERIES column: a rank, a span's or scalar's name
SqlValue = Union[int, float, str, bytes, None]  # what SQLite stores and takes as a parameter
Row = Tuple[Any, ...]  # a row SQLite returns: each column's value of its own type
# What a bucket of a series' rows holds (Store.bucketed): (SQL aggregate, how two buckets'
# figures merge: "sum", "max" (of the present ones) or "min").
_MEMORY_FIELDS = ("device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes", "host_rss_bytes")
BUCKET_FIGURES: Dict[str, List[Tuple[str, str]]] = {
    "steps": ([("COUNT(*)", "sum"), ("SUM(step_ms)", "sum"), ("MAX(step_ms)", "max")]
              + [(f"SUM({name}_ms)", "sum") for name in ALL_PHASES]
              + [(f"MAX({name})", "max") for name in _MEMORY_FIELDS]),
    "spans": [("SUM(count)", "sum"), ("COUNT(*)", "sum"), ("SUM(duration_ms)", "sum")],
    "scalars": [("MIN(step)", "min"), ("COUNT(*)", "sum"), ("SUM(value)", "sum")],
}
WAL_PAGES = 64
CHUNK_RECORDS = 64  # after a failed commit, records are written again this many at a time


def _held_as_json(field: FieldInfo) -> bool:
    """A field that is no scalar (a list, a dict): its column holds it as JSON."""
    return getattr(field.type, "__origin__", field.type) in (list, dict, tuple)


def _sql_type(field: FieldInfo) -> str:
    text = "" if _held_as_json(field) else str(field.type)  # "<class 'int'>", "typing.Optional[float]"
    return "REAL" if "float" in text else "INTEGER" if "int" in text or "bool" in text else "TEXT"


def _fields(kind: RecordType) -> Dict[str, FieldInfo]:
    return {field.name: field for field in msgspec.structs.fields(kind.record)}


def _create_table(table: str, kinds: List[RecordType]) -> str:
    """A table of one record type (two for `ranks`: a column each), and its indexes."""
    kind, fields = kinds[0], _fields(kinds[0])
    columns = ([f"{key} {_sql_type(fields[key])}" for key in kind.keys] + [f"{k.document} TEXT" for k in kinds]
               if kind.document else [f"{name} {_sql_type(field)}" for name, field in fields.items()])
    key = f", PRIMARY KEY ({', '.join(kind.keys)})) WITHOUT ROWID" if kind.latest else ")"
    indexes = "".join(f"CREATE INDEX IF NOT EXISTS {table}_by_{on[0]} ON {table} ({', '.join(on)});\n"
                      for on in kind.indexes)
    return f"CREATE TABLE IF NOT EXISTS {table} ({', '.join(columns)}{key};\n{indexes}"


def _schema() -> str:
    tables: Dict[str, List[RecordType]] = {}
    for kind in RECORD_TYPES.values():
        if kind.table:
            tables.setdefault(kind.table, []).append(kind)
    return "".join(_create_table(table, kinds) for table, kinds in tables.items()) + \
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);"


def _insert(kind: RecordType) -> str:
    """The statement that writes a record of this type: its row, or its keys and JSON."""
    names = [*kind.keys, kind.document] if kind.document else list(_fields(kind))
    update = ", ".join(f"{name} = excluded.{name}" for name in names if name not in kind.keys)
    return (f"INSERT INTO {kind.table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
            + (f" ON CONFLICT({', '.join(kind.keys)}) DO UPDATE SET {update}" if kind.latest else ""))


# The store's layout, kept in the file (SQLite's user_version). 1: every store before the number
# was kept (0 in the file). 2: the number kept. A record's field is only ever appended, with a
# default (records.py): a store written before a field was added reads it as that default, and a
# column a newer layout dropped is not read. Raise the number when a table's meaning changes.
STORE_LAYOUT = 2


class StoreFull(Exception):
    """Some records did not fit in the store (a full disk); the rest were kept."""


class StoreTooNew(ValueError):
    """The store was written by a newer TraceML, in a layout this one cannot read."""


class Store:
    """A thread-safe wrapper around one SQLite connection; ":memory:" when no file can be written.

    The collector holds the one writing Store of a run. Views open their own with
    readonly=True: a separate connection, so their reads never wait on the writer's lock, and
    one that cannot write even by mistake.
    """

    def __init__(self, path: str, readonly: bool = False):
        self.path, self.readonly = path, readonly
        self._lock = threading.Lock()
        self._pending: List[Tuple[Callable[[list], None], list]] = []
        self._replay_needed = False
        self._reserve: Optional[Path] = None  # room held for folding the log when the disk fills
        if readonly:
            self._db = _connect_readonly(path)
            try:
                self._columns = self._read_layout()
            except StoreTooNew:
                self._db.close()
                raise
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
        self._read_layout()  # a newer TraceML's store is refused before anything is written to it
        self._db.executescript(_schema())
        self._add_new_columns()
        self._db.execute(f"PRAGMA user_version={STORE_LAYOUT}")
        self._columns = self._read_layout()
        self._db.execute("BEGIN")
        self._inserts = {record: (_insert(kind), _row_of(kind)) for record, kind in RECORD_TYPES.items() if kind.table}

    # -- the layout --------------------------------------------------------------------------
    def _read_layout(self) -> Dict[str, Dict[str, str]]:
        """Check the file's layout; per columnar table, each field's SQL: its column, or its
        default where the file has no column for it."""
        layout = self._db.execute("PRAGMA user_version").fetchone()[0] or 1
        if layout > STORE_LAYOUT:
            raise StoreTooNew(f"{self.path} was written by a newer TraceML (store layout {layout}; this "
                              f"TraceML {_version()} reads up to {STORE_LAYOUT}): upgrade TraceML to open it")
        read_as = {}
        for table, fields in _columnar().items():
            present = self._table_columns(table)
            read_as[table] = {name: name if name in present or not present else _sql_literal(field)
                              for name, field in fields.items()}
        return read_as

    def _select(self, table: str) -> str:
        """The SELECT list that gives a columnar table's record fields in order."""
        return ", ".join(sql if sql == name else f"{sql} AS {name}" for name, sql in self._columns[table].items())

    def _table_columns(self, table: str) -> set:
        return {row[1] for row in self._db.execute(f"PRAGMA table_info({table})").fetchall()}

    def _add_new_columns(self) -> None:
        """A store from before a field was added, opened to write: the field's column, empty."""
        for table, fields in _columnar().items():
            present = self._table_columns(table)
            for field in fields.values():
                if field.name not in present:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {field.name} {_sql_type(field)} "
                                     f"DEFAULT {_sql_literal(field)}")

    # -- writing ----------------------------------------------------------------------------
    # Everything written since the last commit is also kept in memory, in chunks of at most
    # CHUNK_RECORDS. When a commit fails (a full disk) it is rolled back and the chunks are
    # written again one transaction each: every chunk that fits is kept, whatever the size of
    # the one transaction that did not fit.
    def write(self, records: Iterable[msgspec.Struct]) -> None:
        records = list(records)
        for start in range(0, len(records), CHUNK_RECORDS):
            self._apply(self._insert_records, records[start:start + CHUNK_RECORDS])

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
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _insert_records(self, records: Sequence[msgspec.Struct]) -> None:
        """Each record type's records in one statement, in the order they came (record_types.py
        says where each is kept; a pulse is not)."""
        by_type: Dict[Type[msgspec.Struct], List[msgspec.Struct]] = {}
        for record in records:
            by_type.setdefault(type(record), []).append(record)
        for record_type, group in by_type.items():
            insert = self._inserts.get(record_type)
            if insert is not None:
                self._db.executemany(insert[0], map(insert[1], group))

    def _replace_findings(self, findings: List[Finding]) -> None:
        self._db.execute("DELETE FROM findings")
        self._insert_records(findings)

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

    # -- reading: typed queries; no SQL of the schema leaves this module ----------------------
    def _rows(self, sql: str, params: Sequence[SqlValue] = ()) -> List[Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def records(self, record_type: Type[R]) -> List[R]:
        """Every stored record of one type, in its table's order (record_types.py)."""
        return self._read(record_type)

    def _read(self, record_type: Type[R], where: str = "1", params: Sequence[SqlValue] = (), order: str = "") -> List[R]:
        """The records of one type where an SQL condition on its table's columns holds, in the
        table's order or `order`; none from a store older than their table."""
        kind = RECORD_TYPES[record_type]
        columns = f"{kind.document} FROM {kind.table} WHERE {kind.document} IS NOT NULL AND" if kind.document \
            else f"{self._select(kind.table)} FROM {kind.table} WHERE"
        with self._lock:
            try:
                rows = self._db.execute(f"SELECT {columns} {where} ORDER BY {order or kind.order}", params).fetchall()
            except sqlite3.OperationalError:
                return []
        if kind.document:
            return [msgspec.json.decode(row[0], type=kind.record) for row in rows]  # type: ignore[misc]  # kind.record is record_type
        as_json = [(index, field.type) for index, field in enumerate(_fields(kind).values()) if _held_as_json(field)]
        for index, field_type in as_json:  # rows made lists only where a column holds JSON
            rows = [[*row[:index], msgspec.json.decode(row[index], type=field_type), *row[index + 1:]] for row in rows]
        return [kind.record(*row) for row in rows]  # type: ignore[misc]  # kind.record is record_type

    def steps(self) -> List[StepRecord]:
        return self._read(StepRecord)

    def rolled_steps(self) -> List[RolledStep]:
        return self._read(RolledStep)

    def steps_at(self, steps: Sequence[int]) -> List[StepRecord]:
        """Every rank's records of these steps, in step then rank order."""
        return self._read(StepRecord, f"step IN ({', '.join('?' * len(steps))})", list(steps))

    def steps_every(self, every: int) -> List[StepRecord]:
        """The records of every `every`-th step (all of them for 1), in step then rank order."""
        return self._read(StepRecord, "step % ? = 0", (every,))

    def steps_between(self, first: int, last: int) -> List[StepRecord]:
        """The records of steps first to last, in rank then step order."""
        return self._read(StepRecord, "step BETWEEN ? AND ?", (first, last), order="rank, step")

    def step_fields(self, rank: int, since_step: int, fields: Sequence[str]) -> List[tuple]:
        """(step, *fields) of one rank's records from since_step on, in step order; fields are
        StepRecord's field names."""
        read_as = self._columns["steps"]
        unknown = set(fields) - set(read_as)
        if unknown:
            raise ValueError(f"not step fields: {sorted(unknown)}")
        return self._rows(f"SELECT step, {', '.join(read_as[name] for name in fields)} FROM steps WHERE rank = ? AND step >= ? "
                          f"ORDER BY step", (rank, since_step))

    def ranks(self) -> List[int]:
        """The ranks that said hello."""
        return [row[0] for row in self._rows("SELECT rank FROM ranks ORDER BY rank")]

    def step_count(self, rank: Optional[int] = None, since_step: int = 0) -> int:
        """How many step records (of one rank, if given) from since_step on."""
        of_rank, params = ("rank = ? AND", (rank, since_step)) if rank is not None else ("", (since_step,))
        return self._rows(f"SELECT COUNT(*) FROM steps WHERE {of_rank} step >= ?", params)[0][0]

    def series_keys(self, table: str) -> Sequence[SeriesKey]:
        """The series a table's rows belong to (see SERIES): the steps' ranks, the spans' and
        scalars' names; found by walking the (series, step) index, not by reading every row."""
        if table == "steps":
            return self.ranks()
        column = SERIES[table]
        keys: List[SeriesKey] = []
        key = self._rows(f"SELECT MIN({column}) FROM {table}")[0][0]
        while key is not None:
            keys.append(key)
            key = self._rows(f"SELECT MIN({column}) FROM {table} WHERE {column} > ?", (key,))[0][0]
        return keys

    def step_bounds(self, table: str, key: SeriesKey) -> Tuple[Optional[int], Optional[int]]:
        """The first and last step of one series (a rank's steps, a span's or scalar's name)."""
        # Two statements: SQLite answers a lone MIN or MAX from the index, not both at once.
        where = f"FROM {table} WHERE {SERIES[table]} = ?"
        low = self._rows(f"SELECT MIN(step) {where}", (key,))[0][0]
        return low, (self._rows(f"SELECT MAX(step) {where}", (key,))[0][0] if low is not None else None)

    def bucketed(self, table: str, key: SeriesKey, first: int, bucket: int, low: int,
                 high: int = 2 ** 62) -> List[tuple]:
        """One series' rows from step low to high summed into buckets of `bucket` steps counted
        from step `first`: (slot, *figures) per bucket, the figures of BUCKET_FIGURES[table]."""
        figures = ", ".join(sql for sql, _ in BUCKET_FIGURES[table])
        if table == "steps":  # an older store's missing column reads as its default
            for name, sql in self._columns["steps"].items():
                if sql != name:
                    figures = figures.replace(f"({name})", f"({sql})")
        return self._rows(f"SELECT (step - ?) / ?, {figures} FROM {table} "
                          f"WHERE {SERIES[table]} = ? AND step BETWEEN ? AND ? GROUP BY 1",
                          (first, bucket, key, low, high))

    def spans_between(self, first: int, last: int, limit: int = -1) -> List[SpanRecord]:
        """User spans of steps first to last, in rank, step and start order."""
        return self._read(SpanRecord, "step BETWEEN ? AND ?", (first, last, limit),
                          order="rank, step, start_unix_s LIMIT ?")

    # A span name's time in each step (of a rank) that has a step record, from since_step on:
    # a call in the unfinished last step, or in a step whose record was lost, is in no step.
    _SPAN_STEPS = ("SELECT spans.name AS name, SUM(spans.count) AS calls, SUM(spans.duration_ms) AS ms "
                   "FROM spans JOIN steps ON steps.rank = spans.rank AND steps.step = spans.step "
                   "WHERE spans.step >= ? GROUP BY spans.name, spans.step, spans.rank")  # the index's order

    def span_totals(self, since_step: int) -> List[Tuple[str, int, int, float]]:
        """Per span name, over the step records from since_step on: (name, calls, the steps of a
        rank it ran in, its summed ms)."""
        return self._rows(f"SELECT name, SUM(calls), COUNT(*), SUM(ms) FROM ({self._SPAN_STEPS}) "
                          "GROUP BY name ORDER BY name", (since_step,))

    def span_step_ms(self, since_step: int, every: int = 1) -> List[Tuple[str, float]]:
        """(name, ms) of each span name in each step of a rank it ran in (as span_totals counts
        them), from since_step on; with `every` > 1, every `every`-th of each name's steps only,
        its first included (counted per name, so sampling never misses a span on a few steps)."""
        return self._rows(f"SELECT name, ms FROM (SELECT name, ms, ROW_NUMBER() OVER (PARTITION BY name) AS nth "
                          f"FROM ({self._SPAN_STEPS})) WHERE (nth - 1) % ? = 0", (since_step, every))

    def step_time_ms(self, since_step: int) -> Tuple[int, float]:
        """(how many step records, their summed step_ms), every rank's, from since_step on."""
        count, total = self._rows("SELECT COUNT(*), SUM(step_ms) FROM steps WHERE step >= ?", (since_step,))[0]
        return count, total or 0.0

    def scalars_between(self, first: int, last: int) -> List[ScalarRecord]:
        return self._read(ScalarRecord, "step BETWEEN ? AND ?", (first, last), order="rank, step")

    def latest_system(self) -> Optional[SystemSample]:
        latest = self._read(SystemSample, order="rowid DESC LIMIT 1")
        return latest[0] if latest else None

    def system_buckets(self, first_row: int, per_bucket: int) -> List[Tuple[SystemSample, int]]:
        """The node sampler's readings, `per_bucket` consecutive readings a bucket counted from
        row first_row (see system_extent): per bucket a SystemSample of the readings' means (RAM
        total and training RSS: their maximum; GPUs: the bucket's last reading), with how many
        readings it holds."""
        rows = self._rows(
            "SELECT AVG(unix_s), AVG(cpu_percent), AVG(training_cpu_percent), AVG(ram_used_bytes), "
            "MAX(ram_total_bytes), MAX(training_rss_bytes), MAX(rowid), COUNT(*) FROM system "
            "GROUP BY (rowid - ?) / ? ORDER BY 1", (first_row, per_bucket))
        # A bare `gpus` beside these aggregates would come from any row of its bucket: the GPUs
        # are read from each bucket's last row, by its rowid.
        if not rows:
            return []
        last_ids = [row[6] for row in rows]
        gpus: Dict[int, Optional[str]] = dict(self._rows(f"SELECT rowid, gpus FROM system WHERE rowid IN ({', '.join('?' * len(last_ids))})",
                               last_ids))
        return [(SystemSample(unix_s=unix_s, cpu_percent=cpu, training_cpu_percent=training_cpu,
                              ram_used_bytes=round(ram_used), ram_total_bytes=ram_total,
                              training_rss_bytes=training_rss,
                              gpus=msgspec.json.decode(gpus[last_id] or "[]", type=List[GpuSample])), readings)
                for unix_s, cpu, training_cpu, ram_used, ram_total, training_rss, last_id, readings in rows]

    def system_extent(self) -> Tuple[int, int]:
        """The first and last reading's row number (0, -1 when none), for sizing buckets."""
        low, high = self._rows("SELECT MIN(rowid), MAX(rowid) FROM system")[0]
        return (low, high) if low is not None else (0, -1)

    def meta(self) -> Dict[str, Any]:
        return {key: json.loads(value) for key, value in self._rows("SELECT key, value FROM meta")}


def _sql_literal(field: FieldInfo) -> str:
    """A field's default as SQL: what an older store reads for a column it lacks."""
    default = field.default
    if default is msgspec.NODEFAULT or default is None:
        return "NULL"
    if isinstance(default, bool):
        return str(int(default))
    if isinstance(default, (int, float)):
        return repr(default)
    return "'" + str(default).replace("'", "''") + "'"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("traceml")
    except Exception:  # not installed (run from a source tree)
        return "here"


def _columnar() -> Dict[str, Dict[str, FieldInfo]]:
    """The tables with a column per field, and their record's fields."""
    return {kind.table: _fields(kind) for kind in RECORD_TYPES.values() if kind.table and not kind.document}


def _row_of(kind: RecordType) -> Callable[[msgspec.Struct], Sequence[SqlValue]]:
    """How a record of this type becomes its row: its keys and its JSON, or a value a column."""
    if kind.document:
        keys = kind.keys
        return lambda record: (*(getattr(record, key) for key in keys), msgspec.json.encode(record).decode())
    as_json = [index for index, field in enumerate(_fields(kind).values()) if _held_as_json(field)]
    if not as_json:
        return msgspec.structs.astuple

    def row(record: msgspec.Struct) -> Sequence[SqlValue]:
        values = list(msgspec.structs.astuple(record))
        for index in as_json:
            values[index] = msgspec.json.encode(values[index]).decode()
        return values

    return row


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
