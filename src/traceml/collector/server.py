"""The collector: accepts rank connections over TCP, ingests their frames into the store.

One asyncio loop on a background thread owns the sockets and the store's writes. A bad frame
(wrong magic or version, too large, undecodable) closes that connection only.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hmac
import logging
import select
import socket
import threading
import time
from typing import Any, Callable, Collection, Deque, Dict, Hashable, Iterable, List, Optional, Protocol, Sequence, Set, Tuple, Type

import msgspec

from traceml.collector.store import Store
from traceml.record_types import RECORD_TYPES, R
from traceml.records import RankEnd, RankHello, RolledStep, StepRecord, SystemSample
from traceml.wire import HEADER_BYTES, FrameError, decode_payload, parse_header

log = logging.getLogger("traceml")
COMMIT_INTERVAL_S = 0.5
# A connection must greet within HELLO_TIMEOUT_S, send each frame's rest within FRAME_TIMEOUT_S
# of its header, and say something at least every IDLE_TIMEOUT_S (ranks send a heartbeat
# every HEARTBEAT_S when they have nothing else: a model compiling for minutes is not dead).
HELLO_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 120.0
EXITED_GRACE_S = 0.5  # after the ranks' processes ended: for the collector's thread to accept what they sent
HANG_CHECK_S = 1.0  # how often the hang watch looks at the ranks


# -- what the collector asks of the analysis the run hands it (see Collector): typed object where
# it hands back the analysis' own figures, which the collector only passes on (report.live reads them)
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

    def goodput(self, now_unix_s: Optional[float]) -> Optional[object]:
        """The run's goodput so far (an analysis.goodput.Goodput), None before any hello."""

    def to_builtins(self) -> List[Dict[str, object]]: ...


class HangCheck(Protocol):
    """Looks at the ranks every HANG_CHECK_S (report.live.HangWatch), given the collector."""

    @property
    def hang(self) -> Optional[object]:
        """The hang that holds now (a diagnose.hangs.Hang), or None."""

    def check(self, collector: Collector, now_unix_s: float) -> None: ...


class Collector:
    """Receives every rank's records for one run and keeps them in the store.

    The analysis that follows the records as they come is handed in by the run (lifecycle.py):
    `live`, the rollup across ranks (analysis.rollup.LiveRollup), `run_time`, the wall-time
    tally (analysis.goodput.RunTime), and `hang_watch` (report.live.HangWatch), which looks at
    the ranks every HANG_CHECK_S. Without them the collector only stores.
    """

    def __init__(self, store: Store, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 hello_timeout_s: float = HELLO_TIMEOUT_S, frame_timeout_s: float = FRAME_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, live: Optional[StepRollup] = None,
                 run_time: Optional[WallTimeTally] = None, hang_watch: Optional[HangCheck] = None):
        self.store, self.host, self.port = store, host, port
        self.hello_timeout_s, self.frame_timeout_s = hello_timeout_s, frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._token = token  # when set, a connection's hello must carry it
        self.training_pids: Set[int] = set()
        self.ranks_seen: Set[int] = set()
        self.world_size = 1  # the largest a rank's hello announced
        # What the live views read (they never touch the sockets or the store's writer): the
        # recent records of each type, as many as record_types.py says, by its `per` fields' values.
        self._kept: Dict[Type[msgspec.Struct], Tuple[Dict[Any, Deque[Any]], Tuple[str, ...], Optional[int]]] = {
            record: ({}, kind.per, kind.recent) for record, kind in RECORD_TYPES.items() if kind.recent != 0}
        self.live = live  # recent steps across ranks
        self.run_time = run_time  # every rank's wall time so far, for goodput
        # Ranks whose connection dropped with no goodbye while other ranks were still there:
        # they died or were killed, and the summary reports them missing.
        self.lost_ranks: Set[int] = set()
        self.last_heard_unix_s: Dict[int, float] = {}  # each rank's latest frame
        self.hang_watch = hang_watch
        self.records_ingested = 0  # from the ranks (benchmarks/collector_scale.py reads it)
        self.connections_seen = 0
        self.connections_open = 0
        self.frames_rejected = 0
        self._said_store_failed = False
        self._deadlines: Dict[asyncio.StreamWriter, list] = {}  # writer -> [monotonic deadline, what is owed]
        self._timed_out: Dict[asyncio.StreamWriter, str] = {}
        self._last_change = time.monotonic()  # of connections opening or closing
        self._changed = threading.Condition()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def latest_system(self) -> Optional[SystemSample]:
        return self.latest(SystemSample).get(())

    def kept_by(self, record_type: Type[R]) -> Dict[Hashable, List[R]]:
        """The recent records of one type, by the values of its `per` fields (record_types.py:
        a rank, a rank and a part, () for all), the keys in order, each's records as they came."""
        by_key = self._kept[record_type][0]
        return {key: list(by_key[key]) for key in sorted(list(by_key))}

    def kept(self, record_type: Type[R]) -> List[R]:
        return [record for records in self.kept_by(record_type).values() for record in records]

    def latest(self, record_type: Type[R]) -> Dict[Hashable, R]:
        """Each key's latest record of one type (a rank's hello, goodbye or pulse)."""
        return {key: records[-1] for key, records in self.kept_by(record_type).items() if records}

    def everything_kept(self) -> Dict[Type[msgspec.Struct], List[msgspec.Struct]]:
        """Every type's recent records, by type: what the rules read live."""
        return {record_type: self.kept(record_type) for record_type in self._kept}

    def start(self, listening: Optional[socket.socket] = None) -> str:
        """Bind and serve on a background thread; raises OSError when the port cannot be bound.
        listening: a socket already bound and listening (rendezvous.listen), served as it is."""
        started: "concurrent.futures.Future[None]" = concurrent.futures.Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, sock=listening) if listening is not None
                    else asyncio.start_server(self._serve, self.host, self.port))
                self.port = self._server.sockets[0].getsockname()[1]
                loop.create_task(self._every(COMMIT_INTERVAL_S, self.store.commit, self._store_failed))
                loop.create_task(self._watch_deadlines())
                hang_watch = self.hang_watch
                if hang_watch is not None:  # has a rank stopped ending steps (report.live.HangWatch)?
                    loop.create_task(self._every(HANG_CHECK_S, lambda: hang_watch.check(self, time.time()),
                                                 lambda exc: log.debug("traceml: the hang watch failed", exc_info=exc)))
            except BaseException as exc:
                started.set_exception(exc)
                loop.close()
                return
            started.set_result(None)
            try:
                loop.run_forever()
            finally:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="traceml-collector", daemon=True)
        self._thread.start()
        started.result()  # raises what the loop raised
        return self.address

    def ingest(self, records: List[msgspec.Struct]) -> None:
        """Add records produced outside the sockets (the system sampler); the store locks."""
        self._store(records)
        self._observe(records)

    def _observe(self, records: List[Any]) -> None:
        """Keep the recent records the live views show, roll the steps up and tally the time."""
        steps = []
        for record in records:
            kind = type(record)
            keeping = self._kept.get(kind)
            if keeping is not None:
                by_key, per, recent = keeping
                key = getattr(record, per[0]) if len(per) == 1 else tuple(getattr(record, name) for name in per)
                kept = by_key.get(key)
                if kept is None:
                    kept = by_key[key] = collections.deque(maxlen=recent)
                kept.append(record)
            if kind is StepRecord:
                steps.append(record)
            if self.run_time is not None:
                self.run_time.add(record)
        if steps and self.live is not None:
            self.live.add(steps)
            if self.live.rolled_out:
                self._store(self.live.take_rolled())

    def wait_for_ranks(self, timeout_s: float, until: Optional[Callable[[], bool]] = None,
                       absent_grace_s: float = 5.0, ranks_exited: bool = False) -> bool:
        """Block until every rank of the run has come and gone; True if all did. Gives up when
        `until()` says so, when the time is up, or when every rank that came has gone and none
        has come for absent_grace_s: a rank that died before connecting never comes.

        ranks_exited: the caller saw every rank's process end (one node). Whatever they sent is
        already in this machine's socket buffers, so the wait ends once no connection is open or
        waiting to be accepted, for EXITED_GRACE_S, whether or not any rank came (a script that
        never stepped never connects)."""
        started = time.monotonic()
        deadline = started + timeout_s
        grace_s = min(absent_grace_s, EXITED_GRACE_S) if ranks_exited else absent_grace_s
        with self._changed:
            while True:
                if (self.connections_seen or ranks_exited) and not self.connections_open:
                    if self.connections_seen and len(self.ranks_seen) >= self.world_size:
                        return True
                    quiet_since = max(self._last_change, started) if ranks_exited else self._last_change
                    if time.monotonic() - quiet_since >= grace_s and not (ranks_exited and self._backlog()):
                        return False
                if until is not None and until():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.2))

    def _backlog(self) -> bool:
        """Whether a connection waits to be accepted (a listening socket reads as ready)."""
        server = self._server
        try:
            sockets = list(server.sockets) if server is not None else []
            return bool(sockets) and bool(select.select(sockets, [], [], 0)[0])
        except (OSError, ValueError):  # closed under us: nothing more comes
            return False

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            async def shutdown() -> None:
                if self._server is not None:
                    self._server.close()
                loop.stop()

            asyncio.run_coroutine_threadsafe(shutdown(), loop)
            if self._thread is not None:
                self._thread.join(timeout=5)
        try:  # the loop is gone: nothing else writes now
            self.store.set_meta({"lost_ranks": sorted(self.lost_ranks)})
            self._finish_rollup()
            self.store.commit()
        except Exception as exc:
            self._store_failed(exc)

    # -- on the loop ------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count_connection(+1)
        peer = writer.get_extra_info("peername")
        greeted = False
        rank: Optional[int] = None
        said_goodbye = False
        # What the connection owes next, and by when: the watchdog closes it when late (one
        # watchdog for all, not a timer a read: a rank sends ten frames a second).
        deadline = self._deadlines[writer] = [time.monotonic() + self.hello_timeout_s, "no hello in time"]
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER_BYTES)
                except asyncio.IncompleteReadError:
                    if writer in self._timed_out:
                        raise
                    return  # a clean goodbye, or a rank that died: either way its data is kept
                deadline[0], deadline[1] = time.monotonic() + self.frame_timeout_s, "a frame stalled half-sent"
                payload = await reader.readexactly(parse_header(header))
                records = decode_payload(payload)
                if not greeted:
                    if not records or type(records[0]) is not RankHello:
                        raise FrameError("the first frame must start with the rank's hello")
                    if not hmac.compare_digest(records[0].token, self._token):
                        self.frames_rejected += 1
                        log.warning("traceml: refused a connection from %s: wrong or missing "
                                    "token", peer)
                        return
                    greeted = True
                deadline[0], deadline[1] = time.monotonic() + self.idle_timeout_s, "idle for too long"
                for index, record in enumerate(records):
                    if type(record) is RankHello:
                        records[index] = msgspec.structs.replace(record, token="")  # never stored
                        self._greet(record)
                        rank = record.rank
                    elif type(record) is RankEnd:
                        said_goodbye = True
                if rank is not None:
                    self.last_heard_unix_s[rank] = time.time()
                self._store(records)
                self._observe(records)
                self.records_ingested += len(records)
        except (FrameError, asyncio.IncompleteReadError, ConnectionError) as exc:
            reason = self._timed_out.pop(writer, None)
            if reason is None:  # a timeout was counted by the watchdog as it closed it
                self.frames_rejected += 1
            log.warning("traceml: closed connection from %s: %s", peer, reason or exc)
        except OSError as exc:
            log.debug("traceml: connection from %s ended: %s", peer, exc)
        except Exception as exc:  # anything else a peer provokes ends its connection, no more
            self.frames_rejected += 1
            log.warning("traceml: closed connection from %s: %s: %s", peer, type(exc).__name__, exc)
        finally:
            self._deadlines.pop(writer, None)
            self._timed_out.pop(writer, None)
            writer.close()
            with self._changed:
                if rank is not None and not said_goodbye and self.connections_open > 1:
                    self.lost_ranks.add(rank)
            self._count_connection(-1)

    def _store(self, records: Sequence[msgspec.Struct]) -> None:
        """Write records; a full disk loses them (said once), never the run."""
        try:
            self.store.write(records)
        except Exception as exc:
            self._store_failed(exc)

    def _finish_rollup(self) -> None:
        """Keep the last rolled steps and the wall-time tally of every record, so the summary
        need not roll or read them all again."""
        if self.live is not None:
            rolled = self.live.finish(self.store.steps_at)
            if rolled:
                self.store.write(rolled)
            self.store.set_meta({"rolled_complete": True})
        if self.run_time is not None:
            self.store.set_meta({"run_time": self.run_time.to_builtins()})

    def _store_failed(self, exc: Exception) -> None:
        if not self._said_store_failed:
            self._said_store_failed = True
            log.warning("traceml: could not store telemetry (%s); the run goes on, and what was "
                        "stored before is kept", exc)

    def _greet(self, hello: RankHello) -> None:
        with self._changed:
            self.training_pids.add(hello.pid)
            self.ranks_seen.add(hello.rank)
            self.world_size = max(self.world_size, hello.world_size)
            if self.live is not None:
                self.live.world_size = self.world_size
            self._changed.notify_all()

    def _count_connection(self, delta: int) -> None:
        with self._changed:
            self._last_change = time.monotonic()
            self.connections_open += delta
            if delta > 0:
                self.connections_seen += 1
            self._changed.notify_all()

    async def _watch_deadlines(self) -> None:
        """Close the connections that are late with a hello, a frame's rest, or any word."""
        while True:
            await asyncio.sleep(min(0.25, self.hello_timeout_s / 2, self.frame_timeout_s / 2))
            now = time.monotonic()
            for writer, (due, reason) in list(self._deadlines.items()):
                if now > due:
                    self._timed_out[writer] = reason
                    self._deadlines.pop(writer, None)
                    self.frames_rejected += 1
                    writer.transport.abort()

    @staticmethod
    async def _every(interval_s: float, action: Callable[[], None], failed: Callable[[Exception], None]) -> None:
        """Run `action` every interval_s; one that fails (a full disk, the hang watch) is handed
        to `failed`, and the next tries again: never the collector's end."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                action()
            except Exception as exc:
                failed(exc)
