"""Real CUDA runs: device-timed phases, device memory, the idle gap, and never a synchronize.

Marked `cuda` and skipped without a GPU; scripts/gpu_check.sh runs them on a GPU machine.
"""

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARTS = ("input_wait_ms", "outside_ms", "h2d_ms", "forward_ms", "backward_ms", "optimizer_ms",
         "untraced_ms")

NO_SYNC_SCRIPT = r"""
import os, runpy, sys, torch
calls = []
def forbid(name):
    def wrapper(*args, **kwargs):
        import traceback
        stack = "".join(traceback.format_stack())
        if "traceml" in stack:
            calls.append(name)
    return wrapper
torch.cuda.synchronize = forbid("torch.cuda.synchronize")
torch.cuda.Event.synchronize = forbid("Event.synchronize")
torch.cuda.Stream.synchronize = forbid("Stream.synchronize")
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python script.py` would
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("TRACEML_SYNC_CALLS", len(calls), calls[:3])
"""


def test_cuda_phases_are_device_timed_and_add_up(traceml_run):
    run = traceml_run("--device", "cuda", "--steps", 60, "--no-loader", "--batch-size", 256,
                      "--features", 1024, "--width", 4096)
    assert run.returncode == 0, run.stderr
    rows = run.step_rows()
    assert len(rows) == 60
    for row in rows:
        assert row["device_timed"] == 1
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert row["device_allocated_bytes"] > 0 and row["device_peak_bytes"] >= row["device_allocated_bytes"]
        assert sum(row[p] for p in PARTS) == pytest.approx(row["step_ms"], rel=1e-6)
    assert all(row["gpu_idle_ms"] is not None for row in rows[:-1])
    summary = run.summary()
    assert summary["memory"]["device_capacity_bytes"] > 2 ** 30
    assert summary["steps"]["device_timed"] is True
    assert any("cuda" in device for device in summary["run"]["devices"])


def test_slow_loader_on_gpu_is_input_bound_with_an_idle_gpu(traceml_run):
    run = traceml_run("--device", "cuda", "--steps", 40, "--load-ms", 2, "--batch-size", 8)
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    idle = [row["gpu_idle_ms"] for row in run.step_rows()[5:-1]]
    assert min(idle) > 10.0  # 8 samples x 2 ms: the GPU waits for each batch


def test_traceml_never_synchronizes(traceml_run, tmp_path):
    wrapper = tmp_path / "no_sync.py"
    wrapper.write_text(NO_SYNC_SCRIPT)
    from conftest import TRAIN_LOOP

    run = traceml_run(str(TRAIN_LOOP), "--device", "cuda", "--steps", 30, "--no-loader",
                      script=wrapper)
    assert run.returncode == 0, run.stderr
    assert "TRACEML_SYNC_CALLS 0 []" in run.stdout
    assert run.summary()["steps"]["count"] == 30


def test_deep_dive_on_cuda_is_device_timed(traceml_run):
    run = traceml_run("--device", "cuda", "--steps", 40, "--no-loader", "--batch-size", 256,
                      "--features", 1024, "--width", 4096, traceml_args=("--deep",))
    assert run.returncode == 0, run.stderr
    summary = run.summary()
    linears = [row for row in summary["layers"] if row["type"] == "Linear"]
    assert len(linears) == 3
    for row in linears:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert row["allocated_delta_bytes"] is not None
    assert summary["deep_dive"]["sampled_steps"] == 3


def test_log_scalar_reads_a_cuda_tensor_without_a_sync(plain_run):
    from conftest import SCRIPTS

    run = plain_run("--device", "cuda", "--steps", 40, "--sync-check", script=SCRIPTS / "trace_api_loop.py")
    assert run.returncode == 0, run.stderr
    import sqlite3

    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        losses = [row[0] for row in db.execute("SELECT value FROM scalars WHERE name = 'loss' ORDER BY step")]
        steps = db.execute("SELECT COUNT(*), MIN(forward_calls) FROM steps").fetchone()
    assert len(losses) == 40 and all(0.0 < value < 100.0 for value in losses)
    assert steps == (40, 1)
