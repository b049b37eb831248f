"""The probe's bounded buffer and the one background thread that ships records to the collector.

The training thread only appends to the buffer (the probe queues its ended steps in a ring
instead, and its user spans' totals in the spans queue, which this thread makes into records
and moves into the buffer each round, so the buffer holds records only); when full it drops
the record and counts it, it never waits. The background thread resolves CUDA events,
refreshes host RSS, batches records into frames and sends them over TCP. While no collector is reachable the records
wait in the buffer (which drops when full); at exit what could not be sent is counted as dropped.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, TypeVar

from traceml import rendezvous
from traceml.probe.code_sites import CodeSampler
from traceml.probe.ledger import LedgerWatch
from traceml.probe.loaders import LoaderWatch
from traceml.probe.pulse import PulsedProbe, PulseWatch
from traceml.probe.step_records import QueuedSteps, StepRecords
from traceml.records import RankEnd, RankHello, StepRecord
from traceml.wire import HEADER_BYTES, Record, decode_payload, encode_frame

if TYPE_CHECKING:
    from traceml.probe.clock import DeviceTimeline
    from traceml.probe.compile import CompileWatch
    from traceml.probe.memory import HostRss
    from traceml.probe.thread_cpu import ThreadCpu

log = logging.getLogger("traceml")

BUFFER_CAPACITY = 65536
FLUSH_INTERVAL_S = 0.1
# Host RSS is read every round (20 ms), records sent every 5th. Reading RSS once a flush, every
# 100 ms, left a short run's memory creep unseen (too few readings); and a wake every 20 ms
# costs the training no more than one every 100 ms within this VM's noise, where one every 5 ms
# does (`benchmarks/overhead.py --only wakes`).
ROUNDS_PER_FLUSH = 5
RECORDS_PER_FRAME = 4096
# This rank's latest sent steps, kept for traceml.summary() as the frames that carried them:
# under 200 bytes a step where a StepRecord holds 1 KiB. As objects, the latest 8192 steps
# grew a process by 8 MiB over its first 8192 steps, which the memory rules read as the
# user's creep (tests/test_memory_gc_spikes.py).
RECENT_STEPS_KEPT = 4096
CONNECT_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 5.0
RECONNECT_BACKOFF_S = 1.0
CODE_SITES_EVERY_FLUSHES = 10  # where the untimed time goes, sent about once a second while sampled
HEARTBEAT_S = 20.0  # an empty frame when nothing else went out: the collector drops idle peers
QUIET_CONNECT_S = 15.0  # other ranks may start before rank 0's collector: no warning before this


class StepFeed(QueuedSteps, PulsedProbe, Protocol):
    """What the sender reads of the probe that feeds it (a probe.step.StepProbe), on its thread:
    the steps it queued (made into records by a StepRecords) and how many have ended; and what
    its pulse watch reads of it (probe/pulse.PulsedProbe)."""


T = TypeVar("T")


class PendingRecord(Protocol):
    """A record whose value the device has yet to copy (probe.tracer's device scalars)."""

    def ready(self) -> bool: ...

    def record(self) -> Record: ...


class Sender:
    """Buffer plus background shipping for one training process.

    feed_of makes the probe that feeds it, given the sender, once the sender is built: the probe
    pushes to the sender and the sender drains the probe, so one of them is made for the other
    (None: a sender on its own, which ships what is pushed). training_thread: the ident of the
    thread whose stack a stall reports (probe/pulse.py; None: no pulses). web_port, run_name:
    for the collector rank 0 starts under the Trace API (its web page, its run directory's name).
    """

    def __init__(self, hello: RankHello, timeline: Optional[DeviceTimeline] = None, host_rss: Optional[HostRss] = None,
                 thread_cpu: Optional[ThreadCpu] = None,
                 capacity: int = BUFFER_CAPACITY, address: Optional[str] = None,
                 feed_of: Optional[Callable[["Sender"], StepFeed]] = None, training_thread: Optional[int] = None,
                 web_port: Optional[int] = None, run_name: Optional[str] = None,
                 evaluating: Callable[[], bool] = lambda: False):
        self.hello = hello
        self.timeline = timeline
        self.host_rss = host_rss  # refreshed here, each round, off the training thread
        self.thread_cpu = thread_cpu  # a probe.thread_cpu.ThreadCpu: read each round, stamped on the steps
        self.capacity = capacity  # the compiled pushes read it, with _buffer and _spans, on each push
        self.records_sent = 0
        self.records_dropped = 0
        self._buffer: Deque[Record] = collections.deque()  # Records only
        # User spans' totals as the training thread hands them over, (name, total): made into
        # SpanRecords each round, here (_take_ended_spans). The buffer's capacity holds both.
        self._spans: Deque[tuple] = collections.deque()
        # local_steps takes the probe's ended steps on the training thread as the rounds do on
        # this one: one at a time, or a step held between the probe and the buffer is unseen.
        self._taking_steps = threading.Lock()
        # This rank's latest steps, for traceml.summary() inside the training process: the
        # frames of steps sent (see RECENT_STEPS_KEPT) as (how many steps, frame), and last,
        # while a frame's steps are being gathered and sent, the list of them. local_steps runs
        # on the training thread at any moment of a round, and sees each step in one place.
        self._sent_steps: Deque[Any] = collections.deque()
        self._sent_steps_kept = 0
        # Values still on the device (Trace.log_scalar).
        self._deferred: Deque[PendingRecord] = collections.deque()
        self._address = address if address is not None else os.environ.get(rendezvous.ENV_COLLECTOR)
        self._first_connect_at: Optional[float] = None
        self._socket: Optional[socket.socket] = None
        self._next_connect_at = 0.0
        self._said_unreachable = False
        self._last_sent_at = time.monotonic()
        self.lost_collector = False  # a connection broke: at exit, this rank keeps its own summary
        # Where the run's files go, when this process knows (traceml run says; rank 0 chooses).
        env_run_dir = os.environ.get(rendezvous.ENV_RUN_DIR)
        self.run_dir: Optional[Path] = Path(env_run_dir) if env_run_dir else None
        self._collector_process: Optional[subprocess.Popen] = None
        self.web_port, self.run_name = web_port, run_name
        self.steps_from = hello.steps_from  # the probe updates it; the goodbye carries it
        self.compile_watch: Optional[CompileWatch] = None  # once torch compiles
        # The training's DataLoader iterators: the patches note them, this thread reads them.
        self.loaders: Optional[LoaderWatch] = LoaderWatch(hello.rank)
        # What holds the memory: the training thread reads it (see probe/ledger.py), close() last.
        self.ledger: Optional[LedgerWatch] = LedgerWatch(hello.rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-sender", daemon=True)
        # Last: the probe reads the sender as it is made (its ledger, its buffer).
        self.feed: Optional[StepFeed] = feed_of(self) if feed_of is not None else None
        self.steps = StepRecords(self.feed) if self.feed is not None else None  # the feed's records
        # Where the training thread is while no step ends; None once its frames cannot be read.
        self.pulses: Optional[PulseWatch] = None
        # Where the training thread's time outside the timed phases goes, once it is large.
        self.code: Optional[CodeSampler] = None
        if self.feed is not None and training_thread is not None:
            self.pulses = PulseWatch(self.feed.rank, self.feed, training_thread, loaders=self.loaders,
                                     evaluating=evaluating)
            self.code = CodeSampler(training_thread, evaluating=evaluating)

    # -- training thread ------------------------------------------------------------------
    def push(self, record: Record) -> None:
        if len(self._buffer) >= self.capacity:
            self.records_dropped += 1
            return
        self._buffer.append(record)

    def push_span(self, ended: tuple) -> None:
        """A user span's (name, total) for a step it no longer runs in (StepProbe.span_done; the
        compiled spans append here directly): this thread makes its SpanRecord."""
        if len(self._buffer) + len(self._spans) >= self.capacity:
            self.records_dropped += 1
            return
        self._spans.append(ended)

    def defer(self, pending: PendingRecord, limit: int) -> None:
        """Hold a record whose value the device has not copied yet; the sender sends it when
        pending.ready(). Dropped and counted when `limit` are already waiting."""
        if len(self._deferred) >= limit:
            self.records_dropped += 1
            return
        self._deferred.append(pending)

    def local_steps(self) -> List[StepRecord]:
        """This rank's step records so far: those sent (the latest RECENT_STEPS_KEPT at least)
        and those still waiting in the buffer; read from the training thread, the buffer left
        as it is."""
        self._take_ended_steps()
        sent: List[Any] = []
        for kept in list(self._sent_steps):
            sent.extend(list(kept) if type(kept) is list else decode_payload(kept[1][HEADER_BYTES:]))
        return sent + [record for record in list(self._buffer) if type(record) is StepRecord]

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self, exit_code: Optional[int] = None, timeout_s: float = 5.0, tail_eval_ms: float = 0.0,
              tail_checkpoint_ms: float = 0.0, tail_counts: Sequence[int] = (0, 0)) -> None:
        """Ship what is left and say goodbye (with what ran after the last step, and how many);
        bounded in time whatever the collector does."""
        ended_unix_s = time.time()
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("traceml: telemetry sender did not stop in time; the last records are lost")
            return
        self._take_ended_steps()
        self._take_ended_spans()
        self._watch_loaders(flushing=False, final=True)
        self._sample_code(send=True, sample=False)  # this is the training thread: nothing to sample
        self._read_last_ledger()  # this thread has stopped: close() runs on the training's
        # Let the device finish the last steps' events and scalar copies.
        while ((self.timeline is not None and self.timeline.pending_count) or self._deferred) \
                and time.monotonic() < deadline - 1.0:
            self._collect_device_steps()
            time.sleep(0.01)
        self._collect_device_steps()
        # The goodbye bypasses the capacity check: it is what tells the collector the rank is done.
        self._buffer.append(RankEnd(rank=self.hello.rank, exit_code=exit_code, records_sent=0,
                                    records_dropped=0, steps_from=self.steps_from,
                                    ended_unix_s=ended_unix_s, tail_eval_ms=tail_eval_ms,
                                    tail_checkpoint_ms=tail_checkpoint_ms, tail_evaluations=tail_counts[0],
                                    tail_saves=tail_counts[1]))
        # Rank 0's collector may still be starting when a short run's other ranks end: keep
        # trying to reach it, whatever the back-off said, until the deadline.
        while True:
            self._next_connect_at = 0.0
            self._flush()
            if (not self._buffer or self._socket is not None or self._address is None
                    or time.monotonic() >= deadline):
                break
            time.sleep(0.1)
        if self._buffer and self._address is not None:
            self.lost_collector = True
        if self.lost_collector:
            self._keep_local_summary(exit_code)
        if self._buffer:
            self.records_dropped += _drain_count(self._buffer)
        if self._socket is not None:
            try:
                self._socket.close()
            except OSError:
                pass
            self._socket = None
        if self._collector_process is not None:
            # Plain `python train.py`: the collector we started prints the card; wait for it.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            try:
                self._collector_process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("traceml: the collector is still finishing the summary; not waiting for it")

    # -- background thread ------------------------------------------------------------------
    def _run(self) -> None:
        # The first round runs at once: the rank says hello (and rank 0 starts the collector)
        # before its first steps are done, so even a rank that dies early is known to the run.
        rounds = 0
        while True:
            self._watch_loaders(flushing=rounds % ROUNDS_PER_FLUSH == 0)
            try:
                if self.host_rss is not None:
                    self.host_rss.refresh()
                self._take_ended_steps()
                self._take_ended_spans()
                self._sample_code(send=rounds % (ROUNDS_PER_FLUSH * CODE_SITES_EVERY_FLUSHES) == 0)
                if rounds % ROUNDS_PER_FLUSH == 0:
                    self._collect_device_steps()
                    self._pulse()
                    self._flush()
            except Exception:  # never let the thread die: the next round tries again
                log.debug("traceml: sender round failed", exc_info=True)
            rounds += 1
            if self._stop.wait(FLUSH_INTERVAL_S / ROUNDS_PER_FLUSH):
                return

    def _watch_loaders(self, flushing: bool, final: bool = False) -> None:
        """Read the DataLoader iterators each round; their figures go out with the flushes."""
        loaders = self.loaders
        if loaders is None:
            return
        try:
            loaders.read_ready()
            if flushing or final:
                for sample in loaders.samples(final=final):
                    self.push(sample)
        except Exception:  # a loader that cannot be read: no figures, the rest goes on
            log.debug("traceml: DataLoader watch failed; it stops", exc_info=True)
            self.loaders = None

    def _sample_code(self, send: bool, sample: bool = True) -> None:
        """A sample of the training thread's stack when it is due (probe/code_sites.py); with
        send, the tallies that moved since the last go out."""
        code = self.code
        if code is None:
            return
        try:
            if sample:
                code.sample(self.feed)
            if send:
                for record in code.records(self.hello.rank):
                    self.push(record)
        except Exception:  # frames it cannot read: the untimed time goes unnamed, the rest goes on
            log.debug("traceml: code sampling stops", exc_info=True)
            self.code = None

    def _pulse(self) -> None:
        """A RankPulse when the training thread has ended no step for a while (probe/pulse.py)."""
        pulses = self.pulses
        if pulses is None:
            return
        try:
            pulse = pulses.due()
        except Exception:  # frames it cannot read: no more pulses, the rest goes on
            log.debug("traceml: the stall pulse stops", exc_info=True)
            self.pulses = None
            return
        if pulse is not None:
            self.push(pulse)

    def _read_last_ledger(self) -> None:
        """What holds the memory as the process ends, when it moved since the last reading."""
        ledger = self.ledger
        if ledger is None:
            return
        try:
            reading = ledger.reading(self.feed.step_index if self.feed is not None else 0, final=True)
            if reading is not None:
                self.push(reading)
        except Exception:
            log.debug("traceml: memory ledger failed at the end", exc_info=True)

    def _take_ended_steps(self) -> None:
        """The probe's steps ended since the last call, as StepRecords, into the buffer."""
        if self.steps is None:
            return
        with self._taking_steps:
            ended, dropped = self.steps.drain_steps()
            self._stamp_thread_cpu(ended)
            self._note_steps(ended)
            room = max(0, self.capacity - len(self._buffer))
            if len(ended) > room:  # a full buffer drops, as push does
                dropped += len(ended) - room
                del ended[room:]
            self.records_dropped += dropped
            self._buffer.extend(ended)

    def _stamp_thread_cpu(self, steps: List[StepRecord]) -> None:
        """Each step's time on a CPU and wait for one, from a reading taken now (its window has
        ended)."""
        thread_cpu = self.thread_cpu
        if thread_cpu is None or not thread_cpu.known:
            return
        thread_cpu.refresh()
        for step in steps:
            start_s = step.start_unix_s
            figures = thread_cpu.ran_and_waited_ms(start_s, start_s + step.step_ms / 1e3)
            if figures is not None:
                step.on_cpu_ms, step.cpu_wait_ms = figures

    def _note_steps(self, steps: List[StepRecord]) -> None:
        """Ended steps, for the code sampler to decide whether their untimed time is large."""
        if self.code is not None and steps:
            self.code.note_steps(steps)

    def _take_ended_spans(self) -> None:
        """The spans handed over since the last call, as SpanRecords, into the buffer."""
        spans, buffer = self._spans, self._buffer
        if self.steps is None:  # spans come from the probe: none without one
            return
        span_record = self.steps.span_record
        while spans:  # one at a time: the training thread may append meanwhile
            ended = spans.popleft()
            if len(buffer) >= self.capacity:  # a full buffer drops, as push does
                self.records_dropped += 1
            else:
                buffer.append(span_record(ended))

    def _collect_device_steps(self) -> None:
        """Move what the device has finished into the buffer: steps whose events are done,
        scalars whose copies are (in order: one stream finishes its work in order)."""
        while self._deferred and self._deferred[0].ready():
            self.push(self._deferred.popleft().record())
        record: Record  # a compilation's, then a step's
        if self.compile_watch is not None and self.compile_watch.ended:
            for record in self.compile_watch.records(final=self._stop.is_set()):
                self.push(record)
        if self.timeline is None or self.steps is None:
            return
        resolved = self.timeline.resolve_ready(self.steps.record_from)
        self._stamp_thread_cpu(resolved)
        self._note_steps(resolved)
        for record in resolved:
            self.push(record)

    def _flush(self) -> None:
        sock = self._connection()  # connecting sends the hello, even with nothing buffered yet
        if sock is not None and not self._buffer and time.monotonic() - self._last_sent_at > HEARTBEAT_S:
            self._send(sock, encode_frame([]), 0)
            return
        if not self._buffer or sock is None:
            return  # unreachable: records wait in the bounded buffer, which drops when full
        while self._buffer:
            # Steps go in a frame of their own, which is then kept as it is for local_steps;
            # the rest (spans, scalars, reports, the goodbye last) in the frame after it.
            steps: List[Record] = []
            others: List[Record] = []
            self._sent_steps.append(steps)
            try:
                while self._buffer and len(steps) + len(others) < RECORDS_PER_FRAME:
                    record = self._buffer.popleft()
                    kind = type(record)
                    if kind is StepRecord:
                        steps.append(record)
                    else:
                        if kind is RankEnd:  # the goodbye carries the final counts
                            record.records_sent = self.records_sent + len(steps) + len(others)  # type: ignore[attr-defined]  # a RankEnd (kind is RankEnd)
                            record.records_dropped = self.records_dropped + (  # type: ignore[attr-defined]  # a RankEnd (kind is RankEnd)
                                self.timeline.dropped_steps if self.timeline is not None else 0)
                        others.append(record)
            finally:  # whatever happened, the list becomes its frame (or goes, when empty)
                steps_frame = self._keep_sent_steps(steps)
            unsent = len(steps) + len(others)
            frames = ((steps_frame, len(steps)), (encode_frame(others), len(others)))
            for frame, count in frames:
                if count and not self._send(sock, frame, count):
                    self.records_dropped += unsent + _drain_count(self._buffer)
                    return
                unsent -= count

    def _send(self, sock: socket.socket, frame: bytes, count: int) -> bool:
        """Send a frame of `count` records; False when the connection broke."""
        try:
            sock.sendall(frame)
        except OSError as exc:
            self._lost_connection(exc)
            return False
        self.records_sent += count
        self._last_sent_at = time.monotonic()
        return True

    def _keep_sent_steps(self, steps: List[Record]) -> bytes:
        """The frame of the steps gathered last (the list _sent_steps ends with), kept in the
        list's place: one store, so local_steps sees them as the list or as the frame."""
        if not steps:
            self._sent_steps.pop()
            return b""
        frame = encode_frame(steps)
        self._sent_steps[-1] = (len(steps), frame)
        self._sent_steps_kept += len(steps)
        while self._sent_steps_kept - self._sent_steps[0][0] >= RECENT_STEPS_KEPT:
            self._sent_steps_kept -= self._sent_steps.popleft()[0]
        return frame

    def _connection(self) -> Optional[socket.socket]:
        if self._socket is not None:
            return self._socket
        now = time.monotonic()
        if now < self._next_connect_at:
            return None
        self._next_connect_at = now + RECONNECT_BACKOFF_S
        if self._first_connect_at is None:
            self._first_connect_at = now
        if self._address is None:
            self._address = self._find_collector()
            if self._address is None:
                return None
        host, _, port = self._address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendall(encode_frame([self.hello]))
            self._last_sent_at = time.monotonic()
        except (OSError, ValueError) as exc:
            if not self._said_unreachable and now - self._first_connect_at >= QUIET_CONNECT_S:
                log.warning("traceml: collector %s unreachable (%s); telemetry is dropped until it is",
                            self._address, exc)
                self._said_unreachable = True
            return None
        self._socket = sock
        self.lost_collector = False  # reached again: the collector keeps the run after all
        return sock

    def _keep_local_summary(self, exit_code: Optional[int]) -> None:
        """The collector is gone: write this rank's own summary beside the run (or in the
        current directory), so the run is not lost with it. One line says where."""
        try:
            from traceml import probe, rundir

            folder = self.run_dir or Path(rundir.RUNS_ROOT)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank{self.hello.rank}-local-summary.json"
            summary: Dict[str, object] = {"rank": self.hello.rank, "exit_code": exit_code, "argv": self.hello.argv,
                       "reason": "the collector was lost during the run",
                       "records_sent": self.records_sent, "records_dropped": self.records_dropped}
            if probe.summarize_steps is not None:
                summary.update(probe.summarize_steps(self.local_steps()))
            path.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"traceml: the collector was lost; rank {self.hello.rank}'s summary is in {path}",
                  file=sys.stderr)
        except Exception as exc:
            log.warning("traceml: the collector was lost and no local summary could be written: %s", exc)

    def _lost_connection(self, exc: Exception) -> None:
        self.lost_collector = True
        log.warning("traceml: lost the collector (%s); telemetry is dropped until it is back", exc)
        try:
            if self._socket is not None:
                self._socket.close()
        except OSError:
            pass
        self._socket = None

    def _find_collector(self) -> Optional[str]:
        """No `traceml run` around us: rank 0 starts the run's collector as a child process,
        the other ranks connect to where the launch's rendezvous variables say it is."""
        endpoint = rendezvous.from_launch_env()
        if self.hello.rank != 0:
            return f"{endpoint[0]}:{endpoint[1]}" if endpoint is not None else None
        if self._collector_process is not None:
            return None
        host, port = endpoint if endpoint is not None else (rendezvous.LOOPBACK, 0)
        try:
            self._collector_process, address, self.run_dir = rendezvous.spawn_collector_process(
                self.hello, host, port, web_port=self.web_port, run_name=self.run_name)
            return address
        except Exception as exc:
            log.warning("traceml: could not start a collector (%s); running without telemetry", exc)
            return None


def _drain_count(buffer: Deque[T]) -> int:
    count = len(buffer)
    buffer.clear()
    return count
