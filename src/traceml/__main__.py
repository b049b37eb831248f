"""`python -m traceml` is the `traceml` command."""
import sys

from traceml.cli import main

sys.exit(main())
