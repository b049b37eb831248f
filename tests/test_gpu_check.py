"""The GPU check's machinery on the CPU: its dry run writes a row per claim with a status, a row
made to fail fails the check, and the parsing its CUDA rows rely on reads what torch and pytest write."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _table(path: Path) -> dict:
    """The markdown table's rows by id: {id: (measured, threshold, result)}."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[0] not in ("row", "---"):
            rows[cells[0]] = (cells[2], cells[3], cells[4])
    return rows


def _run(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path / "gpu_check.md"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_the_dry_run_writes_every_claim_with_a_status_and_passes_no_cuda_claim(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table_file = tmp_path / "gpu_check.md"
    head = table_file.read_text().split("| row |")[0]
    assert "torch " in head and "date: " in head and "dry run on the CPU" in head
    rows = _table(table_file)
    declared = [row_id for group in gpu_check.GROUPS for row_id in group.claims if row_id != "sync.tests"]
    assert set(declared) <= set(rows)
    assert any(row_id.startswith("sync.test_") for row_id in rows)  # one row per cuda-marked test
    for row_id, (measured, _, status) in rows.items():
        assert status in ("pass", "fail") or status.startswith("skipped: "), (row_id, status)
        if row_id != "mfu.flops_per_step":  # the one claim that holds on any device
            assert status == gpu_check.SKIPPED_NO_CUDA, (row_id, status, measured)
    # The CPU parts ran and measured: figures, not placeholders.
    assert rows["mfu.flops_per_step"][2] == "pass"
    assert re.search(r"TraceML [\d.]+ ms \(host-timed\) vs profiler host range [\d.]+ ms", rows["phase.forward"][0])
    assert "added" in rows["overhead.added_pct"][0]
    assert "layer='blocks.1.blow_up'" in rows["oom.post_mortem"][0]
    assert "/metrics (" in rows["nvml.metrics"][0]
    assert (tmp_path / "gpu_check.json").exists()


def test_a_row_whose_threshold_cannot_be_met_fails_the_check_and_the_table_is_still_written(tmp_path):
    result = _run(tmp_path, "--only", "mfu", "--impossible", "mfu.flops_per_step", timeout=90)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _table(tmp_path / "gpu_check.md")
    assert rows["mfu.flops_per_step"][2] == "fail"
    assert rows["mfu.flops_per_step"][1] == "impossible (--impossible)"
    assert rows["mfu.mfu"][2] == gpu_check.SKIPPED_NO_CUDA


def test_device_work_is_tied_to_the_range_whose_time_holds_its_launch():
    """As a CUDA trace has it: backward's kernel launched from autograd's thread (another tid),
    inside the main thread's range by time; a copy; a kernel launched outside every range."""
    def launch(name, tid, ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": ts,
                "args": {"correlation": correlation}}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "gpu_check.forward", "tid": 1, "ts": 100.0, "dur": 50.0},
        {"ph": "X", "cat": "user_annotation", "name": "gpu_check.backward", "tid": 1, "ts": 200.0, "dur": 100.0},
        {"ph": "X", "cat": "user_annotation", "name": "gpu_check.h2d", "tid": 1, "ts": 10.0, "dur": 20.0},
        launch("cudaLaunchKernel", 1, 110.0, 1), launch("cudaLaunchKernel", 1, 120.0, 2),
        launch("cudaLaunchKernel", 2, 250.0, 3),  # autograd's thread
        launch("cudaMemcpyAsync", 1, 15.0, 4), launch("cudaLaunchKernel", 1, 400.0, 5),
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 500.0, "dur": 30.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "relu", "ts": 532.0, "dur": 8.0, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "gemm_bwd", "ts": 600.0, "dur": 70.0, "args": {"correlation": 3}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 40.0, "dur": 12.0, "args": {"correlation": 4}},
        {"ph": "X", "cat": "kernel", "name": "loss", "ts": 700.0, "dur": 5.0, "args": {"correlation": 5}},
    ]
    names = ["gpu_check.h2d", "gpu_check.forward", "gpu_check.backward", "gpu_check.optimizer"]
    times = gpu_check.profiler_times({"traceEvents": events}, names)
    assert times["gpu_check.forward"]["kernel_ms"] == pytest.approx(0.038)  # both its kernels
    assert times["gpu_check.forward"]["span_ms"] == pytest.approx(0.040)  # the gap between them too
    assert times["gpu_check.backward"]["kernel_ms"] == pytest.approx(0.070)
    assert times["gpu_check.h2d"]["kernel_ms"] == pytest.approx(0.012)
    assert times["gpu_check.optimizer"]["count"] == 0
    assert times["_unattributed_ms"] == pytest.approx(0.005)


def test_tracebacks_compare_by_frames_and_a_masked_last_line():
    plain = ('Traceback (most recent call last):\n  File "/s/oom.py", line 9, in <module>\n    main()\n'
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 280.00 GiB. 1.2 GiB free\n")
    other = plain.replace("1.2 GiB", "1.3 GiB")
    assert gpu_check.traceback_of(plain)["frames"] == ["/s/oom.py:9 in <module>"]
    assert gpu_check.traceback_of(plain)["exception_masked"] == gpu_check.traceback_of(other)["exception_masked"]


def test_junit_cases_and_the_nvml_fields_on_a_card():
    xml = ('<testsuites><testsuite><testcase classname="t" name="test_a"/>'
           '<testcase classname="t" name="test_b">'
           '<failure message="AssertionError: 3 syncs&#10;more">x</failure></testcase>'
           '<testcase classname="t" name="test_c"><skipped message="needs a CUDA GPU"/></testcase>'
           '</testsuite></testsuites>')
    assert gpu_check.junit_cases(xml) == [
        {"name": "test_a", "outcome": "pass", "detail": ""},
        {"name": "test_b", "outcome": "fail", "detail": "AssertionError: 3 syncs"},
        {"name": "test_c", "outcome": "skipped", "detail": "needs a CUDA GPU"}]
    card = ("│ Step time  median 9.1 ms                                            │\n"
            "│ System     CPU avg 9%  ·  GPU0 util avg 97% mem peak 12.0 GiB        │\n"
            "│            temp 51 °C power 402 W                                  │\n"
            "│ Memory     device peak 11.00 GiB                                     │\n")
    text = gpu_check._card_gpu_text(card)
    assert gpu_check.nvml_fields_in(text) == ["utilisation", "memory", "temperature", "power"]
    assert "device peak" not in text  # the Memory section is not the GPU's NVML figures
    assert gpu_check.hand_counted_flops(2, 3, 1) == 2 * 2 * 9 * 2
