"""What `traceml run` starts (the script in a fork of itself, or its ranks through
torch.distributed.run) and how it waits for them to end: signals passed on, the script's output
under the live dashboard, and a node's run ended boundedly once its ranks have exited, whatever
other nodes do.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from traceml import rendezvous

if TYPE_CHECKING:
    from types import FrameType

    from traceml.collector.server import Collector

log = logging.getLogger("traceml")

ZERO_CODE = "traceml.probe.zero_code"
AGENT = "traceml.agent"
# torch.distributed.run's own default wait for every node at the rendezvous.
DEFAULT_RDZV_TIMEOUT_S = 900
# Once this node's ranks have exited, how long torch.distributed.run may take to follow. Its
# agent waits in an exit barrier for the other nodes' agents (up to 300 s); an agent whose
# ranks failed leaves without reaching that barrier, so the others would wait it out.
AGENT_EXIT_GRACE_S = 10.0
AGENT_STOP_GRACE_S = 5.0  # from SIGTERM to SIGKILL
POLL_S = 0.25


class Launch:
    """The command `traceml run` starts and where this node's ranks find the run's collector."""

    def __init__(self, args: argparse.Namespace):
        self.script = Path(args.script)
        self.script_args = list(args.script_args)
        self.nnodes, self.node_rank = args.nnodes, args.node_rank
        self.distributed = args.nproc_per_node is not None or args.nnodes > 1
        self.nproc_per_node = args.nproc_per_node or 1
        self.rdzv_backend, self.rdzv_conf, self.rdzv_timeout_s = args.rdzv_backend, args.rdzv_conf, args.rdzv_timeout
        if args.rdzv_endpoint:
            self.master_addr, _, port = args.rdzv_endpoint.rpartition(":")
            if not self.master_addr or not port.isdigit():
                raise rendezvous.RendezvousError(
                    f"--rdzv-endpoint must be HOST:PORT, not {args.rdzv_endpoint!r}")
            self.master_port = int(port)
        else:
            self.master_addr = args.master_addr or rendezvous.LOOPBACK
            self.master_port = args.master_port or 29500
        self.hosts_collector = self.node_rank == 0
        if self.nnodes > 1:  # other nodes must know where to send: the rendezvous host, port P+1
            self.collector_host = rendezvous.bind_host(self.master_addr)
            self.collector_port = rendezvous.collector_port(self.master_port)
        else:
            self.collector_host, self.collector_port = rendezvous.LOOPBACK, 0

    @property
    def script_argv(self) -> List[str]:
        """The script and its arguments, as `python` would be given them."""
        return [os.fspath(self.script), *self.script_args]

    @property
    def rendezvous_address(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def command(self) -> List[str]:
        """Each rank runs the script through probe.zero_code, which traces it even if it
        never imports traceml (steps inferred from optimizer.step())."""
        script = [ZERO_CODE, *self.script_argv]
        if not self.distributed:
            return [sys.executable, "-m", *script]
        # torch.distributed.run through traceml.agent, which also records the failed ranks' exit status.
        launcher = [sys.executable, "-m", AGENT, "--nproc-per-node", str(self.nproc_per_node)]
        if self.nnodes == 1:  # torchrun takes a free rendezvous port itself: no port to race for
            return [*launcher, "--standalone", "--module", *script]
        timeout_key = "timeout" if self.rdzv_backend == "static" else "join_timeout"
        conf = ",".join(filter(None, [f"{timeout_key}={self.rdzv_timeout_s}", self.rdzv_conf]))
        launcher += ["--nnodes", str(self.nnodes), "--rdzv-backend", self.rdzv_backend, "--rdzv-conf", conf]
        if self.rdzv_backend == "static":
            launcher += ["--node-rank", str(self.node_rank), "--master-addr", self.master_addr,
                         "--master-port", str(self.master_port)]
        else:
            launcher += ["--rdzv-endpoint", self.rendezvous_address]
        return [*launcher, "--module", *script]

    def never_started_line(self, exit_code: int) -> str:
        return (f"traceml: no rank started on node {self.node_rank}: torch.distributed.run exited "
                f"with code {exit_code} before its rendezvous at {self.rendezvous_address} gathered "
                f"all {self.nnodes} nodes (they have --rdzv-timeout {self.rdzv_timeout_s} s to join)")


class AgentWatch:
    """Watch torch.distributed.run's agent from beside it, on a thread of its own.

    `ranks_seen` says whether any rank process ever ran under the agent. Once they have all
    exited, the agent has AGENT_EXIT_GRACE_S to exit too; an agent still there is waiting in
    its exit barrier, which it enters only when its own ranks succeeded, for a node that will
    not come: it is stopped (SIGTERM, then SIGKILL with anything left under it) and
    `stopped_after_success` is set, so the node's exit code is its ranks' 0. Not once a signal
    has been passed on to it (`signalled`): its ranks then ended because of the signal, and an
    agent slow to exit on a loaded machine is not waiting for another node.
    """

    def __init__(self, agent: subprocess.Popen):
        self._agent_pid = agent.pid
        self.ranks_seen = False
        self.stopped_after_success = False
        self.signalled = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traceml-agent-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            import psutil

            agent = psutil.Process(self._agent_pid)
            ranks_gone_at: Optional[float] = None
            while not self._done.wait(POLL_S):
                if not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE:
                    return
                ranks = [child for child in agent.children() if _is_rank(child)]
                now = time.monotonic()
                if ranks:
                    self.ranks_seen, ranks_gone_at = True, None
                elif self.ranks_seen and ranks_gone_at is None:
                    ranks_gone_at = now
                elif ranks_gone_at is not None and now - ranks_gone_at >= AGENT_EXIT_GRACE_S \
                        and not self.signalled.is_set():
                    self._stop_agent(agent)
                    return
        except Exception as exc:  # psutil missing or the process table unreadable: torchrun's own end
            log.debug("traceml: cannot watch torch.distributed.run: %s", exc)

    def _stop_agent(self, agent) -> None:
        import psutil

        print(f"traceml: this node's ranks exited {AGENT_EXIT_GRACE_S:.0f} s ago and "
              "torch.distributed.run is still waiting for another node to finish (its exit "
              "barrier): stopping it", file=sys.stderr, flush=True)
        self.stopped_after_success = True
        left = [agent, *agent.children(recursive=True)]
        try:
            agent.send_signal(signal.SIGTERM)
        except psutil.Error:
            return
        _, alive = psutil.wait_procs(left, timeout=AGENT_STOP_GRACE_S)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()


def _is_rank(process) -> bool:
    try:
        return ZERO_CODE in process.cmdline()
    except Exception:  # gone between the listing and the look
        return False


# -- starting the script and waiting for it -------------------------------------------------------
def probe_env(options: argparse.Namespace) -> Dict[str, str]:
    """The training processes' environment: this one, with the probe's options."""
    env = dict(os.environ)
    if options.deep:
        env[rendezvous.ENV_DEEP] = "1"
    if not options.auto_capture:
        env[rendezvous.ENV_AUTO_CAPTURE] = "0"
    return env


class Closable(Protocol):
    """What of the launcher's the script must not hold open: a socket, a file."""

    def close(self) -> None: ...


def start_script(launch: Launch, env: Dict[str, str], with_terminal: bool,
                 not_for_script: Sequence[Closable] = ()) -> Tuple[Script, Optional[int]]:
    """Start the launch's script; (its process, the fd its output comes from when it writes to
    a terminal of its own for the live dashboard, else None). OSError when it cannot start.
    `not_for_script`: what of this process's the script must not hold open (the collector's
    listening socket), each with a close()."""
    output_fd = terminal_fd = None
    if with_terminal:  # the script writes to a terminal of its own; the dashboard shows it above itself
        try:
            output_fd, terminal_fd = _open_terminal()
        except OSError as exc:
            print(f"traceml: no live dashboard ({exc}); the card comes at the end", file=sys.stderr)
    if ScriptFork.can_run(launch):
        return ScriptFork.start(launch, env, output_fd, terminal_fd, not_for_script), output_fd
    if terminal_fd is None:
        return subprocess.Popen(launch.command(), env=env), None
    try:
        child = subprocess.Popen(launch.command(), env=env, stdout=terminal_fd, stderr=terminal_fd)
    except OSError:
        os.close(output_fd)  # type: ignore[arg-type]  # set with terminal_fd
        raise
    finally:
        os.close(terminal_fd)
    return child, output_fd


class ScriptFork:
    """A single-node script run in a fork of `traceml run` rather than in a new interpreter,
    which spares the run a second Python start (~35 ms here, more with a heavy site-packages)
    and a second import of what the launcher and the probe share.

    The fork is made before the launcher has done anything the script could notice: no thread
    running (a fork copies locks mid-use), no logging set up, no output pending, nothing
    heavier than the standard library and traceml's own launcher imported. It then runs the
    script as `python -m traceml.probe.zero_code` would, and exits as that would: the script's
    SystemExit unwinds to the interpreter, which runs its atexit and finalizers (a log file
    the script never closed is flushed, as under plain python). The launcher keeps the part
    of subprocess.Popen it uses: pid, poll, wait, send_signal, returncode.
    """

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None
        self._reaping = threading.Lock()

    @staticmethod
    def can_run(launch: Launch) -> bool:
        return not launch.distributed and hasattr(os, "fork") and threading.active_count() == 1

    @classmethod
    def start(cls, launch: Launch, env: Dict[str, str], output_fd: Optional[int], terminal_fd: Optional[int],
              not_for_script: Sequence[Closable]) -> "ScriptFork":
        """Fork and run the script in the fork, its output to `terminal_fd` when given (the
        launcher keeps `output_fd`, the terminal's other side); the fork, here."""
        for stream in (sys.stdout, sys.stderr):  # else what they hold would be written twice
            stream.flush()
        # The launcher's objects, frozen in the script's process: its garbage collector never
        # walks them (nor copies their pages to write its marks), as the gc docs advise for a
        # fork that does not exec.
        gc.freeze()
        try:
            pid = os.fork()
        except OSError:
            gc.unfreeze()
            for fd in (output_fd, terminal_fd):
                if fd is not None:
                    os.close(fd)
            raise
        if pid:
            gc.unfreeze()
        else:
            cls._run_script(launch, env, output_fd, terminal_fd, not_for_script)  # never returns
        if terminal_fd is not None:
            os.close(terminal_fd)
        return cls(pid)

    @staticmethod
    def _run_script(launch: Launch, env: Dict[str, str], output_fd: Optional[int], terminal_fd: Optional[int],
                    not_for_script: Sequence[Closable]) -> None:
        try:
            if terminal_fd is not None:
                os.dup2(terminal_fd, 1)
                os.dup2(terminal_fd, 2)
                os.close(terminal_fd)
                os.close(output_fd)  # type: ignore[arg-type]  # set with terminal_fd
            # Through their objects, not their fd numbers: an object closing its fd again when
            # the launcher's frames unwind at the script's end would close whatever the
            # script opened under that number since.
            for held in not_for_script:
                held.close()
            os.environ.update(env)
            from traceml.probe import zero_code
        except BaseException as exc:  # nothing of the launcher's may run on in this process
            os.write(2, f"traceml: cannot start {launch.script}: {exc}\n".encode())
            os._exit(127)
        zero_code.main(launch.script_argv)
        sys.exit(0)  # the script's end, as when `python script.py` reaches its last line

    def poll(self) -> Optional[int]:
        # Not blocking: a signal handler polls while the main thread may be inside wait().
        if self.returncode is None and self._reaping.acquire(blocking=False):
            try:
                self._reap(os.WNOHANG)
            finally:
                self._reaping.release()
        return self.returncode

    def wait(self) -> int:
        with self._reaping:
            while self.returncode is None:
                self._reap(0)
        return self.returncode

    def _reap(self, options: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, options)
        except ChildProcessError:  # reaped by the kernel: SIGCHLD ignored (Popen says 0 too)
            self.returncode = 0
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


Script = Union[subprocess.Popen, ScriptFork]  # what runs the script: a new process, or a fork


def wait_for_launch(launch: Launch, child: Script, output_fd: Optional[int], collector: Collector) -> int:
    """Wait for the script (or torch.distributed.run) with the live dashboard when it writes to
    `output_fd`, forwarding signals; the node's exit code."""
    watch = AgentWatch(child) if launch.distributed else None  # type: ignore[arg-type]  # distributed: a Popen of torch.distributed.run
    return _launch_ended(launch, watch, wait(child, watch, output_fd, collector, launch.script.name))


def run_without_collector(launch: Launch, options: argparse.Namespace) -> int:
    """A node other than 0: its ranks send to node 0's collector, which prints the card."""
    env = probe_env(options)
    env[rendezvous.ENV_COLLECTOR] = f"{launch.master_addr}:{launch.collector_port}"
    try:
        child = subprocess.Popen(launch.command(), env=env)
    except OSError as exc:
        print(f"traceml: cannot start {launch.script}: {exc}", file=sys.stderr)
        return 2
    watch = AgentWatch(child)
    exit_code = _launch_ended(launch, watch, wait(child, watch))
    print(f"traceml: node {launch.node_rank} done (exit code {exit_code}); node 0 prints the "
          "card and keeps the run", file=sys.stderr)
    return exit_code


def _launch_ended(launch: Launch, watch: Optional[AgentWatch], exit_code: int) -> int:
    """The node's exit code once torch.distributed.run has gone, on its own or stopped by the
    watch; a launch whose ranks never started says why."""
    if watch is None:
        return exit_code
    watch.stop()
    if watch.stopped_after_success:
        return 0
    if exit_code != 0 and not watch.ranks_seen:
        print(launch.never_started_line(exit_code), file=sys.stderr, flush=True)
    return exit_code


def _open_terminal() -> Tuple[int, int]:
    """A pseudo-terminal the size of ours: the script still sees a terminal (line-buffered
    output, progress bars) while its output reaches us to print above the dashboard."""
    import fcntl
    import pty
    import termios

    main_fd, terminal_fd = pty.openpty()
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, size)
    return main_fd, terminal_fd


def _drain(output_fd: int, child: Script) -> None:
    """Copy the script's output to ours until it ends, as if no dashboard were there."""
    while True:
        readable, _, _ = select.select([output_fd], [], [], 0.5)
        if readable:
            try:
                chunk = os.read(output_fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                return
            os.write(sys.stdout.fileno(), chunk)
        elif child.poll() is not None:
            return


def wait(child: Script, watch: Optional[AgentWatch] = None, output_fd: Optional[int] = None,
         collector: Optional[Collector] = None, script: str = "") -> int:
    """Wait for the script, forwarding signals (and telling the agent's watch, where there is
    one, that they were), with the live dashboard over its output when it writes to
    `output_fd` (closed here; without a collector, its output is passed on as it comes); its
    exit code, 128+N if signal N killed it."""
    restore = _forward_signals(child, watch)
    try:
        if output_fd is not None and collector is not None:
            from traceml.views.terminal import Dashboard

            try:
                Dashboard(collector, script).run(child, output_fd)
            except Exception as exc:  # the dashboard is a view: if it fails, the run goes on
                log.warning("traceml: live dashboard stopped (%s); the card comes at the end", exc)
                _drain(output_fd, child)
        elif output_fd is not None:
            _drain(output_fd, child)
        returncode = child.wait()
    finally:
        restore()
        if output_fd is not None:
            os.close(output_fd)
    return _exit_code(returncode)


def _exit_code(returncode: int) -> int:
    """A child's exit code as a shell gives it: 128+N if signal N killed it."""
    return 128 - returncode if returncode < 0 else returncode


def _forward_signals(child: Script, watch: Optional[AgentWatch] = None) -> Callable[[], None]:
    """Pass Ctrl-C and SIGTERM on to the script, and outlive them to write the summary.

    A Ctrl-C typed at the terminal already reaches the script, which shares our process group;
    forwarding it too would interrupt the script's own clean-up. So SIGINT is forwarded only
    when it cannot have come from our terminal (no terminal, or we are not in the foreground).
    """

    def from_terminal() -> bool:
        try:
            return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
        except (OSError, ValueError, AttributeError):
            return False

    def on_signal(signum: int, frame: Optional[FrameType]) -> None:
        if child.poll() is not None:
            return
        if signum == signal.SIGINT and from_terminal():
            return
        if watch is not None:
            watch.signalled.set()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
