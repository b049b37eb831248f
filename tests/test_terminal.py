"""The live dashboard: render on synthetic collector state, and a real run in a pseudo-terminal."""
import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pyte
import pytest
from rich.console import Console

from conftest import TRAIN_LOOP, _env
from traceml.analysis.goodput import RunTime
from traceml.analysis.rollup import LiveRollup
from traceml.collector.server import Collector
from traceml.collector.store import Store
from traceml.records import GpuSample, SystemSample
from traceml.views.terminal import render, snapshot, sparkline
from test_records import hello, step


def collector_with(steps=60, ranks=1, slow_rank=None, gpu=False):
    collector = Collector(Store(":memory:"), live=LiveRollup(), run_time=RunTime())
    records = []
    for rank in range(ranks):
        greeting = hello()
        greeting.rank, greeting.world_size = rank, ranks
        collector._greet(greeting)
        for index in range(steps):
            record = step(index)  # 10 ms: 1 input wait, 1 outside, 3 forward, 3 backward, ...
            record.rank = rank
            record.host_rss_bytes = 400 * 2 ** 20
            if slow_rank is not None:
                record.comm_wait_ms = 0.5 if rank == slow_rank else 6.0
                if rank == slow_rank:
                    record.input_wait_ms += 5.5
            records.append(record)
    gpus = [GpuSample(index=0, utilization_percent=87.0, memory_used_bytes=30 * 2 ** 30,
                      memory_total_bytes=80 * 2 ** 30, temperature_c=61.0, power_w=412.0)] if gpu else []
    records.append(SystemSample(unix_s=1.0, cpu_percent=55.0, ram_used_bytes=8 * 2 ** 30,
                                ram_total_bytes=32 * 2 ** 30, training_cpu_percent=98.0,
                                training_rss_bytes=2 ** 30, gpus=gpus))
    collector.ingest(records)
    return collector


def screen_text(collector, width=120, height=60):
    state = snapshot(collector, "train.py", 83.0, alerts=[])
    console = Console(file=io.StringIO(), width=width, height=height, color_system=None, record=True)
    console.print(render(state, width, height))
    return console.export_text()


def test_render_shows_the_figures_of_the_run():
    text = screen_text(collector_with(gpu=True))
    assert "TraceML · train.py · 00:01:23 · step 60" in text
    assert "100.0 steps/s" in text and "800 samples/s" in text
    assert "median 10.0 ms   p90 10.0 ms" in text
    assert "forward                3.00 ms  30.0%" in text
    assert "host RSS 400 MiB" in text
    assert "CPU 55%  training 98%  RAM 8.0 of 32.0 GiB" in text
    assert "GPU0 87%  30.0/80 GiB  61°C  412 W" in text
    assert "ranks" not in text  # one rank: no rank panel


def test_render_shows_ranks_and_names_the_straggler():
    collector = collector_with(ranks=2, slow_rank=1)
    state = snapshot(collector, "train.py", 10.0, alerts=[])
    assert state.findings[0].kind == "INPUT_STRAGGLER" and state.findings[0].rank == 1
    text = screen_text(collector)
    assert "ranks (2)" in text
    assert "input wait median 3.75 ms  worst 6.50 ms  rank 1" in text
    assert "INPUT_STRAGGLER" in text  # in the alerts as it appears


def test_a_small_terminal_drops_panels_instead_of_wrapping():
    collector = collector_with(ranks=2, slow_rank=1, gpu=True)
    big = screen_text(collector, width=120, height=60)
    small = screen_text(collector, width=70, height=18)
    assert "system" in big and "memory" in big
    assert "system" not in small and "phases" in small
    assert max(len(line) for line in small.splitlines()) <= 70


def test_sparkline_scales_to_its_range():
    assert sparkline([1.0, 2.0, 3.0], 10) == "▁▄█"
    assert sparkline([5.0] * 4, 2) == "▁▁"


def read_screen(fd, stream, until_s, process):
    """Feed the terminal's output to the emulator until the time is up or the run is over."""
    deadline = time.monotonic() + until_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([fd], [], [], 0.1)
        if readable:
            try:
                stream.feed(os.read(fd, 65536).decode("utf-8", "replace"))
            except OSError:  # the run is over and its terminal closed
                return
        elif process.poll() is not None:
            return


def read_until_live(fd, stream, screen, process, min_steps=10, until_s=60.0):
    """The screen once the live panel shows more than min_steps steps (however long the
    machine takes to start the run), or as it is when the time is up."""
    deadline = time.monotonic() + until_s
    while time.monotonic() < deadline and process.poll() is None:
        read_screen(fd, stream, 0.5, process)
        headers = [line for line in screen.display if "TraceML · train_loop.py ·" in line and " · step " in line]
        if headers and int(headers[-1].split(" · step ")[1].split(" ")[0].replace(",", "")) > min_steps:
            break
    return list(screen.display)


@pytest.mark.timeout(150)
def test_live_dashboard_in_a_real_terminal(tmp_path):
    import fcntl
    import struct
    import termios

    main_fd, terminal_fd = pty.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    process = subprocess.Popen(
        [sys.executable, "-m", "traceml", "run", "--run-dir", str(tmp_path / "run"), str(TRAIN_LOOP),
         "--steps", "200", "--load-ms", "3", "--outside-ms", "2"],
        stdin=terminal_fd, stdout=terminal_fd, stderr=terminal_fd, cwd=tmp_path,
        env=dict(_env(), TERM="xterm-256color"), start_new_session=True)
    os.close(terminal_fd)
    screen = pyte.Screen(120, 50)
    stream = pyte.Stream(screen)
    try:
        live = read_until_live(main_fd, stream, screen, process)  # mid-run: the live panel is up
        read_screen(main_fd, stream, 90.0, process)  # to the end, reading all the while
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(main_fd)
    assert process.returncode == 0
    headers = [line for line in live if "TraceML · train_loop.py ·" in line]
    assert headers, "\n".join(live)
    current = headers[-1]  # the latest redraw
    steps_done = int(current.split(" · step ")[1].split(" ")[0].replace(",", ""))
    assert 10 < steps_done < 200  # live, mid-run
    assert "steps/s" in current and "samples/s" in current and "INPUT_BOUND" in current
    shares = [float(match.group(2)) for line in live
              if (match := re.search(r"input wait\s+([\d.]+) ms\s+([\d.]+)%", line))]
    assert shares and shares[-1] > 40.0  # 8 samples x 3 ms in a step of ~30 ms
    assert any("step time (last" in line for line in live)
    final = "\n".join(screen.display)
    assert "trained 200 steps" in final  # the script's own output, intact
    assert "Verdict" in final and "INPUT_BOUND" in final  # the card at the end
    assert (tmp_path / "run" / "final_summary.json").is_file()


NO_COLLECTOR = """
import sys
from traceml import cli, lifecycle

def refuse(self, *args, **kwargs):
    raise OSError("cannot start the collector: refused by the test")

lifecycle.Run.start_collector = refuse
sys.exit(cli.main(["run", "--mode", "cli", "--run-dir", sys.argv[1], sys.argv[2]]))
"""
LOUD_SCRIPT = """
for line in range(4000):
    print("x" * 100, line)  # 400 KB: far more than a terminal's buffer holds unread
print("all written")
"""


@pytest.mark.timeout(120)
def test_a_collector_that_cannot_start_leaves_the_script_running_with_its_output(tmp_path):
    """Under the live dashboard the script writes into a terminal of the launcher's: when the
    collector cannot start after the script has, that output is still read and passed on, or a
    script that writes more than the terminal holds would block for ever."""
    script = tmp_path / "loud.py"
    script.write_text(LOUD_SCRIPT)
    main_fd, terminal_fd = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", NO_COLLECTOR, str(tmp_path / "run"), str(script)],
                               stdin=terminal_fd, stdout=terminal_fd, stderr=terminal_fd, cwd=tmp_path,
                               env=dict(_env(), TERM="xterm-256color"), start_new_session=True)
    os.close(terminal_fd)
    seen = b""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and process.poll() is None:
            if select.select([main_fd], [], [], 0.2)[0]:
                try:
                    seen += os.read(main_fd, 65536)
                except OSError:
                    break
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(main_fd)
    text = seen.decode("utf-8", "replace")
    assert process.returncode == 0, text[-2000:]
    assert "the script runs untraced" in text and "all written" in text
