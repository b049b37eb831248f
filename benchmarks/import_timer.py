"""Instructions zero-code's import timer costs while torch imports, compiled against Python.

`traceml run` puts a timer in front of builtins.__import__ until the script's first step, so
that goodput can tell start-up apart. Every import statement goes through it, nested ones
included: torch's own import makes tens of thousands. Here one process a side imports torch
with each timer in front of __import__ (a subclass of it, as zero_code.py makes one), under
valgrind's callgrind, and the totals are printed side by side. Counts, not times: they do not
drift with this machine's load. They leave out the kernel's time (the Python timer's deeper
frames make CPython map and unmap frame chunks).

    python benchmarks/import_timer.py
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

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


def main() -> None:
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


if __name__ == "__main__":
    main()
