"""Instructions zero-code's import timer costs while torch imports, compiled against Python.

`traceml run` puts a timer in front of builtins.__import__ until the script's first step, so
that goodput can tell start-up apart. Every import statement goes through it, nested ones
included: torch's own import makes tens of thousands. Here one process a side imports torch
with each timer in front of __import__ (a subclass of it, as zero_code.py makes one), under
valgrind's callgrind, and the totals are printed side by side. Counts, not times: they do not
drift with this machine's load. They leave out the kernel's time (the Python timer's deeper
frames make CPython map and unmap frame chunks), so `--wall` also times the same two imports
from outside, launch after launch in alternating order, after one unmeasured launch of each:
the median of the pairs' differences, with its quartiles.

    python benchmarks/import_timer.py [--wall PAIRS]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = r"""
import builtins, sys
from traceml.probe import step, zero_code
base = step.fast_path.ImportTimer if sys.argv[1] == "compiled" else zero_code._PythonImportTimer
class Timer(base):
    pass
builtins.__import__ = Timer(builtins.__import__)
import torch, torch.nn, torch.optim, torch.utils.data
"""


def instructions(workdir: str, side: str) -> int:
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # not a shim's shell
    out = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={workdir}/callgrind.{side}",
                          python, f"{workdir}/imports.py", side],
                         capture_output=True, text=True, check=True, cwd=workdir).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def wall_ms(workdir: str, side: str) -> float:
    start_s = time.perf_counter()
    subprocess.run([sys.executable, f"{workdir}/imports.py", side], check=True, cwd=workdir)
    return (time.perf_counter() - start_s) * 1e3


def print_wall(workdir: str, pairs: int) -> None:
    for side in ("compiled", "python"):  # unmeasured: the page cache and bytecode warm
        wall_ms(workdir, side)
    added_ms = []
    for pair in range(pairs):
        order = ("compiled", "python") if pair % 2 else ("python", "compiled")
        took = {side: wall_ms(workdir, side) for side in order}
        added_ms.append(took["python"] - took["compiled"])
    low, median, high = statistics.quantiles(added_ms, n=4)
    print(f"wall clock, {pairs} alternating pairs: the Python timer {median:+.1f} ms against the compiled one "
          f"(quartiles {low:+.1f}, {high:+.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wall", type=int, default=0, metavar="PAIRS",
                        help="also time the imports from outside, this many alternating pairs")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind): nothing to count with")
    from traceml.probe import step

    if step.fast_path is None:
        sys.exit("the compiled timers are not built (or TRACEML_NO_FASTPATH is set): nothing to compare")
    with tempfile.TemporaryDirectory() as workdir:
        with open(f"{workdir}/imports.py", "w") as out:
            out.write(SCRIPT)
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            compiled, python = pool.map(lambda side: instructions(workdir, side), ("compiled", "python"))
        print("instructions importing torch with zero-code's import timer in front of __import__ (callgrind)")
        print(f"  compiled timer {compiled:>16,}")
        print(f"  Python timer   {python:>16,}   {python - compiled:+,} ({(python - compiled) / compiled:+.2%})")
        if args.wall:
            print_wall(workdir, args.wall)


if __name__ == "__main__":
    main()
