"""Builds the optional C fast path (src/traceml/probe/_fastpath.c); the rest is in pyproject.toml.

Where it cannot be built (no compiler, another platform), TraceML installs without it and its
Python patches do the same work, a few µs a step slower.
"""
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup

# The compiled timers' header comes from the one declaration of the step's layout.
probe_dir = Path(__file__).parent / "src" / "traceml" / "probe"
header = runpy.run_path(str(probe_dir / "layout.py"))["c_header"]()
if not (probe_dir / "_layout.h").exists() or (probe_dir / "_layout.h").read_text() != header:
    (probe_dir / "_layout.h").write_text(header)

fast_path = Extension("traceml.probe._fastpath", ["src/traceml/probe/_fastpath.c"],
                      depends=["src/traceml/probe/_layout.h"], optional=True)
setup(ext_modules=[fast_path] if sys.platform in ("linux", "darwin") else [])
