"""`python -m traceml` is the `traceml` command."""
from traceml.cli import entry

entry()
