"""Runs a training script with CUDA's sync debug mode on and reports every host sync TraceML made.

    python sync_guard.py SCRIPT [ARGS...]     (as the script of `traceml run`, or under python)

torch.cuda.set_sync_debug_mode("warn") makes torch warn at every synchronizing call (`.item()`,
`.cpu()`, a blocking copy, `bool()` of a CUDA tensor, torch.cuda.synchronize), explicit or
implicit, on any thread. Each warning is filed under the innermost frame outside torch and the
warnings machinery: a frame in TraceML's package is TraceML's sync, any other the user's (the
script's own setup, a trainer's logging). Whatever TraceML has on the stack further out (the
zero-code starter runs the whole script) does not count. "warn" rather than "error": an error
raised inside TraceML is caught by its own fault handling (by design, the training comes
first) and would pass unseen, and the user's own syncs (`model.to("cuda")`) would stop the run.
At exit it prints one line: TRACEML_SYNCS {"traceml": [where, ...], "user": count}.
"""
import json
import os
import runpy
import sys
import threading
import warnings

SYNC_MESSAGE = "called a synchronizing CUDA operation"
MARK = "TRACEML_SYNCS "


def _package_dir(name):
    module = __import__(name)
    return os.path.dirname(module.__file__) + os.sep


class SyncLedger:
    """The syncs seen so far, by whose code made them."""

    def __init__(self):
        self.not_user = (_package_dir("torch"), os.path.dirname(warnings.__file__) + os.sep + "warnings.py")
        self.traceml_dir = _package_dir("traceml")
        self.this_file = os.path.abspath(__file__)  # the ledger's own frames are not the user's
        self.traceml = []  # "file:line (thread)" of each sync TraceML's code made
        self.user = 0
        self._lock = threading.Lock()

    def note(self, frame):
        """File a sync whose warning is being shown, frame being the frame showing it."""
        while frame is not None and (frame.f_code.co_filename.startswith(self.not_user)
                                     or os.path.abspath(frame.f_code.co_filename) == self.this_file):
            frame = frame.f_back
        with self._lock:
            if frame is not None and frame.f_code.co_filename.startswith(self.traceml_dir):
                self.traceml.append(f"{frame.f_code.co_filename}:{frame.f_lineno} "
                                    f"({threading.current_thread().name})")
            else:
                self.user += 1

    def report(self):
        return MARK + json.dumps({"traceml": self.traceml, "user": self.user})

    def install(self):
        """Show torch's sync warnings to this ledger only, every one of them."""
        shown_before = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if SYNC_MESSAGE in str(message):
                self.note(sys._getframe(1))
            else:
                shown_before(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*" + SYNC_MESSAGE)
        warnings.showwarning = showwarning


def traceml_syncs(stdout):
    """The report a guarded run printed: {"traceml": [...], "user": n}."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    assert lines, "the guarded run printed no sync report"
    return json.loads(lines[-1][len(MARK):])


def main():
    import torch

    ledger = SyncLedger()
    ledger.install()
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    if os.environ.get("SYNC_GUARD_PLANT"):
        plant_a_sync_in_the_probe()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as `python script.py` would
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        print(ledger.report(), flush=True)


def plant_a_sync_in_the_probe():
    """The guard's own test: every step's end reads a CUDA value on the host, from a function
    whose code lives in the probe's file, as a careless change to the probe would."""
    from traceml.probe import step

    source = ("def exit_reading_a_value(self, *args, **kwargs):\n"
              "    import torch\n"
              "    torch.ones((), device='cuda').item()\n"
              "    return original_exit(self, *args, **kwargs)\n")
    namespace = {"original_exit": step.StepProbe.exit}
    exec(compile(source, step.__file__, "exec"), namespace)
    step.StepProbe.exit = namespace["exit_reading_a_value"]


if __name__ == "__main__":
    main()
