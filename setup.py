"""Builds the optional C fast path (src/traceml/probe/_fastpath.c); the rest is in pyproject.toml.

Where it cannot be built (no compiler, another platform), TraceML installs without it and its
Python patches do the same work, a few µs a step slower.
"""
import sys

from setuptools import Extension, setup

fast_path = Extension("traceml.probe._fastpath", ["src/traceml/probe/_fastpath.c"], optional=True)
setup(ext_modules=[fast_path] if sys.platform in ("linux", "darwin") else [])
