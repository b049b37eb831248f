"""How the ranks of a run find its one collector (rank 0 of a plain `python` run starts it), and
who may talk to it; the environment `traceml run` hands its training processes (every TRACEML_*
name is here).

One collector per run, on node 0. Under `traceml run` its address reaches the ranks in
TRACEML_COLLECTOR. Under a launch of the user's own (torchrun, srun) every rank derives the
same address from the rendezvous variables it already has: MASTER_ADDR, port MASTER_PORT + 1
(or TRACEML_COLLECTOR_PORT). A collector listens on loopback unless the run spans nodes; then
it listens on the master address and only talks to ranks presenting TRACEML_TOKEN.
"""
from __future__ import annotations

import ipaddress
import os
import select
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from traceml.records import RankHello

ENV_COLLECTOR = "TRACEML_COLLECTOR"  # host:port, set by `traceml run` for its ranks
ENV_COLLECTOR_PORT = "TRACEML_COLLECTOR_PORT"
ENV_TOKEN = "TRACEML_TOKEN"
ENV_RUN_DIR = "TRACEML_RUN_DIR"  # where the run's directory goes (`traceml run` sets it)
ENV_DEEP = "TRACEML_DEEP"  # set by `traceml run --deep`: deep-dive on the model trace_step sees
ENV_DEEP_EVERY = "TRACEML_DEEP_EVERY"
ENV_AUTO_CAPTURE = "TRACEML_AUTO_CAPTURE"  # "0" (traceml run --no-auto-capture): no capture when a rule fires
LOOPBACK = "127.0.0.1"


class RendezvousError(Exception):
    """A collector that must not start as asked (a routable bind without a token)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def collector_port(master_port: int, env: Mapping[str, str] = os.environ) -> int:
    return int(env.get(ENV_COLLECTOR_PORT) or master_port + 1)


def bind_host(master_addr: str, env: Mapping[str, str] = os.environ) -> str:
    """Where the collector listens: loopback, or the master address with a token required."""
    if is_loopback(master_addr):
        return LOOPBACK
    if not env.get(ENV_TOKEN):
        raise RendezvousError(
            f"a collector reachable from other nodes ({master_addr}) needs a shared secret: "
            f"set {ENV_TOKEN} to the same value on every node")
    return master_addr


def from_launch_env(env: Mapping[str, str] = os.environ) -> Optional[Tuple[str, int]]:
    """The run's collector address under torchrun or srun, or None for a single process."""
    if int(env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or 1) <= 1 or not env.get("MASTER_PORT"):
        return None
    master_addr = env.get("MASTER_ADDR") or LOOPBACK
    return master_addr, collector_port(int(env["MASTER_PORT"]), env)


def listen(host: str, port: int) -> socket.socket:
    """The collector's listening socket, bound now (raises OSError when it cannot be): ranks
    that connect before the collector serves it wait in its backlog, so `traceml run` starts
    the script first and sets the collector up while the script imports."""
    family, address = _numeric_address(host, port)
    if family is None:  # a name: the resolver (its first call loads libraries: ~2 ms)
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    listening = socket.socket(family, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(128)
    except OSError:
        listening.close()
        raise
    return listening


def _numeric_address(host: str, port: int) -> Tuple[Any, Any]:
    """(family, address) when host is an IP address as written (the loopback `traceml run`
    listens on), else (None, None)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family, (host, port) if family == socket.AF_INET else (host, port, 0, 0)
    return None, None


# -- python train.py: rank 0 starts the run's collector as a process of its own ---------------
# The collector's own command (cli.py): no user types it, so no help lists it.
COLLECT_COMMAND = "_collect"


def spawn_collector_process(hello: RankHello, host: str, port: int, web_port: Optional[int] = None,
                            run_name: Optional[str] = None) -> Tuple[subprocess.Popen, str, Path]:
    """Start `python -m traceml _collect` (COLLECT_COMMAND) for this run and return it with its address and the
    run dir it keeps; with web_port, it serves the web dashboard too (the Trace API), never in
    the training process."""
    from traceml import rundir

    read_fd, write_fd = os.pipe()
    script = run_name or (hello.argv[0] if hello.argv else "python")
    # Chosen here, so that rank 0 knows where its run goes even if the collector dies.
    run_dir = Path(os.environ.get(ENV_RUN_DIR) or rundir.default_run_dir(script))
    env = {**os.environ, ENV_RUN_DIR: os.fspath(run_dir)}
    command = [sys.executable, "-m", "traceml", COLLECT_COMMAND, "--ready-fd", str(write_fd),
               "--parent-pid", str(os.getpid()), "--script", script, "--host", host,
               "--port", str(port)]
    if web_port is not None:
        command += ["--web-port", str(web_port)]
    try:
        process = subprocess.Popen(command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, env=env)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        readable, _, _ = select.select([ready], [], [], 20.0)
        line = ready.readline().decode().strip() if readable else ""
    if not line or line.startswith("error:"):
        process.kill()
        raise RuntimeError(line[len("error:"):].strip() or "the collector did not start")
    return process, line, run_dir


def rank_env() -> Tuple[int, int, int, int]:
    """(rank, local rank, world size, node rank) as torchrun or SLURM's srun set them."""
    env = os.environ

    def first(*names: str, default: int) -> int:
        for name in names:
            value = env.get(name)
            if value:  # neither unset nor empty
                try:
                    return int(value)
                except ValueError:
                    continue
        return default

    return (first("RANK", "SLURM_PROCID", default=0),
            first("LOCAL_RANK", "SLURM_LOCALID", default=0),
            first("WORLD_SIZE", "SLURM_NTASKS", default=1),
            first("GROUP_RANK", "NODE_RANK", "SLURM_NODEID", default=0))
