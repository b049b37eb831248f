"""Real CUDA runs: device-timed phases, device memory, the idle gap, host syncs, and never a sync.

Every run goes through the sync guard (sync_guard.py: torch's sync debug mode, each sync filed
under the code that made it), so each test also fails if TraceML made the host wait.
Marked `cuda` and skipped without a GPU; scripts/gpu_check.sh runs them on a GPU machine.
"""

from pathlib import Path

import pytest

from conftest import SCRIPTS, TRAIN_LOOP
from sync_guard import traceml_syncs

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARTS = ("input_wait_ms", "outside_ms", "h2d_ms", "forward_ms", "backward_ms", "optimizer_ms",
         "untraced_ms")

GUARD = Path(__file__).parent / "sync_guard.py"


def guarded(run_fixture, script, *args, **kwargs):
    """Run a script under the sync guard (sync_guard.py): every host sync is reported, and a
    test fails on any that TraceML's own code made."""
    run = run_fixture(str(script), *args, script=GUARD, **kwargs)
    assert run.returncode == 0, run.stderr
    syncs = traceml_syncs(run.stdout)
    assert syncs["traceml"] == [], f"TraceML synchronized: {syncs['traceml'][:3]}"
    return run


def test_cuda_phases_are_device_timed_and_add_up(traceml_run):
    run = guarded(traceml_run, TRAIN_LOOP, "--device", "cuda", "--steps", 60, "--no-loader",
                  "--batch-size", 256, "--features", 1024, "--width", 4096)
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
    assert summary["host_syncs"] == []  # the loop reads nothing on the host
    assert all(f["kind"] != "HOST_SYNC" for f in summary["findings"])


def test_slow_loader_on_gpu_is_input_bound_with_an_idle_gpu(traceml_run):
    run = guarded(traceml_run, TRAIN_LOOP, "--device", "cuda", "--steps", 40, "--load-ms", 2, "--batch-size", 8)
    summary = run.summary()
    assert summary["primary_diagnosis"]["kind"] == "INPUT_BOUND"
    idle = [row["gpu_idle_ms"] for row in run.step_rows()[5:-1]]
    assert min(idle) > 10.0  # 8 samples x 2 ms: the GPU waits for each batch


def test_zero_code_on_cuda_never_synchronizes(traceml_run):
    run = guarded(traceml_run, SCRIPTS / "untouched_loop.py", "--device", "cuda", "--steps", 40)
    assert run.summary()["steps"]["count"] == 40
    assert run.summary()["steps"]["device_timed"] is True


def test_deep_dive_on_cuda_is_device_timed(traceml_run):
    run = guarded(traceml_run, TRAIN_LOOP, "--device", "cuda", "--steps", 40, "--no-loader",
                  "--batch-size", 256, "--features", 1024, "--width", 4096, traceml_args=("--deep",))
    summary = run.summary()
    linears = [row for row in summary["layers"] if row["type"] == "Linear"]
    assert len(linears) == 3
    for row in linears:
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0
        assert row["allocated_delta_bytes"] is not None
    assert summary["deep_dive"]["sampled_steps"] == 3


def test_log_scalar_reads_a_cuda_tensor_without_a_sync(plain_run):
    import sqlite3

    run = guarded(plain_run, SCRIPTS / "trace_api_loop.py", "--device", "cuda", "--steps", 40)
    with sqlite3.connect(run.run_dir / "telemetry.sqlite") as db:
        losses = [row[0] for row in db.execute("SELECT value FROM scalars WHERE name = 'loss' ORDER BY step")]
        steps = db.execute("SELECT COUNT(*), MIN(forward_calls) FROM steps").fetchone()
    assert len(losses) == 40 and all(0.0 < value < 100.0 for value in losses)
    assert steps == (40, 1)


def test_hf_trainer_on_cuda_never_synchronizes(traceml_run, tmp_path):
    pytest.importorskip("transformers")
    run = guarded(traceml_run, SCRIPTS / "hf_trainer.py", "--max-steps", 30,
                  "--output-dir", str(tmp_path / "hf_out"), timeout=300)
    assert run.summary()["steps"]["count"] == 30
    assert run.summary()["steps"]["device_timed"] is True
    assert traceml_syncs(run.stdout)["user"] > 0  # the Trainer's own logging reads the loss


def test_the_guard_catches_a_sync_planted_in_the_probe(traceml_run):
    run = traceml_run(str(TRAIN_LOOP), "--device", "cuda", "--steps", 20, "--no-loader", script=GUARD,
                      env={"SYNC_GUARD_PLANT": "1"})
    assert run.returncode == 0, run.stderr
    made = traceml_syncs(run.stdout)["traceml"]
    assert len(made) >= 20 and all("traceml/probe/step.py" in where for where in made)


def test_a_loss_read_every_step_is_a_host_sync_at_its_line(traceml_run):
    run = guarded(traceml_run, TRAIN_LOOP, "--device", "cuda", "--steps", 40, "--no-loader",
                  "--batch-size", 256, "--features", 1024, "--width", 4096, "--read-loss")
    line = next(number for number, text in enumerate(TRAIN_LOOP.read_text().splitlines(), 1)
                if text.endswith("# READ LOSS"))
    summary = run.summary()
    top = summary["host_syncs"][0]
    # Filed under the script's line (relative to the working directory, or its last two parts).
    assert top["site"] == f"scripts/train_loop.py:{line}" and top["call"] == "Tensor.item"
    assert top["calls_per_step"] == pytest.approx(1.0) and top["wait_ms_per_step"] > 0
    finding = next(f for f in summary["findings"] if f["kind"] == "HOST_SYNC")
    assert finding["evidence"]["site"] == top["site"]
    assert top["site"] in (run.run_dir / "final_summary.txt").read_text()
