"""The sync guard the CUDA tests run under: each sync torch reports is filed under the code that made it.

On the CPU, torch's report is played by a warning with torch's message, raised from code whose
file is TraceML's, torch's or the user's (as code compiled under that file name), the shapes a
real sync has on CUDA: the zero-code starter (TraceML) further out on the stack must not make
the user's sync TraceML's, and a sync inside torch counts for whoever called torch.
"""
import os
import threading
import warnings

import torch

import traceml
from sync_guard import SYNC_MESSAGE, SyncLedger


def code_in(directory, name, source):
    """Functions whose frames say they live in directory/name."""
    namespace = {"warnings": warnings, "SYNC_MESSAGE": SYNC_MESSAGE}
    exec(compile(source, os.path.join(directory, name), "exec"), namespace)
    return namespace


TORCH_DIR = os.path.dirname(torch.__file__)
TRACEML_DIR = os.path.dirname(traceml.__file__)
torch_code = code_in(TORCH_DIR, "_tensor.py", "def item():\n    warnings.warn(SYNC_MESSAGE)\n")
traceml_code = code_in(TRACEML_DIR, "probe/step.py",
                       "def exit_step(read):\n    read()\n\n"
                       "def run_script(script):\n    script()\n")
user_code = code_in("/home/user", "train.py", "def log_loss(read):\n    read()\n")


def guarded(action):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        ledger = SyncLedger()
        ledger.install()
        action()
        warnings.warn("an unrelated warning")
    assert [str(warning.message) for warning in shown] == ["an unrelated warning"]  # shown as before
    return ledger


def test_a_sync_in_traceml_code_is_traceml_s_even_through_torch():
    ledger = guarded(lambda: traceml_code["exit_step"](torch_code["item"]))
    assert ledger.user == 0 and len(ledger.traceml) == 1
    assert ledger.traceml[0].startswith(os.path.join(TRACEML_DIR, "probe", "step.py") + ":2 ")


def test_the_user_s_sync_under_the_zero_code_starter_is_the_user_s():
    ledger = guarded(lambda: traceml_code["run_script"](lambda: user_code["log_loss"](torch_code["item"])))
    assert (ledger.user, ledger.traceml) == (1, [])


def test_every_sync_is_counted_on_every_thread():
    def twice_on_a_thread():
        thread = threading.Thread(target=lambda: [traceml_code["exit_step"](torch_code["item"]) for _ in range(2)],
                                  name="traceml-sender")
        thread.start()
        thread.join()
        for _ in range(3):
            user_code["log_loss"](torch_code["item"])

    ledger = guarded(twice_on_a_thread)
    assert ledger.user == 3
    assert len(ledger.traceml) == 2 and all(where.endswith("(traceml-sender)") for where in ledger.traceml)
