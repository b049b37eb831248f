"""The regression gate on real runs: trials of a benchmark loop, gated as a CI job would gate them
(`traceml compare BASE NEW --fail-on regression`). Unchanged trials should pass (exit 0) and no
trial of the same code should be an IMPROVEMENT or a REGRESSION; the loop made 20% slower should
fail (exit 1). Prints a row per trial: the gate's exit, the verdict, the change in the median step
and its 95% interval.

    python benchmarks/gate.py [--pairs 5] [--steps 600] [--repeats 5] [--order interleaved]

--order says how each trial's runs are made:
- interleaved (the default, as docs/regression-gate.md's CI job makes them): one after the
  other on the same core, base and new in the order base, new, new, base, base, new, ... so
  that drift over time, a straight-line slowdown included, falls on both sides alike;
- side-by-side: base and new at the same time, each on a core of its own (the baseline on the
  other core every other pair), so whatever the machine does meanwhile it does to both, as long
  as its two cores run at the same speed.
With --repeats N each side is N runs, gated as two folders of runs: the interval then holds the
run-to-run variance the repeats measured.

A judgment of timings, so a benchmark and not a test: on a machine whose speed drifts more than
the repeats can measure, trials that cannot be told apart say so (exit 3), and the rows show it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional

GATE_BENCH = Path(__file__).resolve().parent.parent / "tests" / "scripts" / "gate_bench.py"
LAYERS, SLOW_LAYERS = 10, 12  # two layers in ten: the forward and backward 20% longer


def on_core(core: int):
    """Run on the core-th CPU this process may use alone (its collector too), at a raised
    priority where allowed, as a CI job may run its benchmark under `nice -n -10`."""
    def setup() -> None:
        try:
            os.nice(-10)  # where allowed, ahead of whatever else the machine runs
        except OSError:
            pass
        if hasattr(os, "sched_setaffinity"):  # the core-th of those this process may use
            allowed = sorted(os.sched_getaffinity(0))
            if core < len(allowed):
                os.sched_setaffinity(0, {allowed[core]})
    return setup


def bench_command(run_dir: Path, layers: int, steps: int) -> list:
    """The benchmark loop with this many layers under `traceml run`, into run_dir."""
    return [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", str(run_dir),
            str(GATE_BENCH), "--steps", str(steps), "--layers", str(layers)]


def side_by_side(base_dir: Path, new_dir: Path, new_layers: int, steps: int, base_core: int = 0,
                 env: Optional[Dict[str, str]] = None) -> None:
    """The baseline and the loop with new_layers under `traceml run` at the same time, each on a
    core of its own (the loop has one thread): whatever the machine does meanwhile, it does to
    both. tests/test_regression_gate.py makes its runs with this too."""
    started = [subprocess.Popen(
        bench_command(run_dir, layers, steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=on_core(core))
        for run_dir, layers, core in ((base_dir, LAYERS, base_core), (new_dir, new_layers, 1 - base_core))]
    for process in started:
        _, stderr = process.communicate(timeout=300)
        if process.returncode != 0:
            raise RuntimeError(f"a benchmark run failed:\n{stderr[-3000:]}")


def interleaved(base_dir: Path, new_dir: Path, new_layers: int, steps: int, repeats: int, core: int = 0) -> None:
    """repeats runs of the baseline into base_dir/0, 1, ... and of the loop with new_layers into
    new_dir/0, 1, ..., one after the other on the same core, in the order base, new, new, base,
    base, new, ...: a machine that slows down steadily over the trial slows both sides alike."""
    for repeat in range(repeats):
        sides = [(base_dir, LAYERS), (new_dir, new_layers)]
        for run_dir, layers in (sides if repeat % 2 == 0 else sides[::-1]):
            process = subprocess.run(
                bench_command(run_dir / str(repeat), layers, steps), stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True, preexec_fn=on_core(core), timeout=300)
            if process.returncode != 0:
                raise RuntimeError(f"a benchmark run failed:\n{process.stderr[-3000:]}")


def gate(base_dir: Path, new_dir: Path) -> tuple:
    process = subprocess.run([sys.executable, "-m", "traceml", "compare", str(base_dir), str(new_dir),
                              "--fail-on", "regression", "--json"], capture_output=True, text=True, timeout=120)
    result = json.loads(process.stdout)
    return process.returncode, result["verdict"], result["step"]["delta_share"], result["step"]["ci_share"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="unchanged trials")
    # Runs of a few seconds, five a side: on a 2-core VM the same code's runs of 150 steps came
    # out 4-6% apart (their medians' spread), of 1000 steps about 3%.
    parser.add_argument("--steps", type=int, default=600, help="steps in each run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side in a trial, gated as folders")
    parser.add_argument("--order", choices=("interleaved", "side-by-side"), default="interleaved",
                        help="each trial's runs one after the other on one core, or base and new at once")
    args = parser.parse_args()
    print(f"{'trial':<12} {'exit':>4}  {'verdict':<13} {'change':>8}  95% interval")
    with tempfile.TemporaryDirectory(prefix="gate-bench-") as tmp:
        cases = [(f"unchanged {i}", LAYERS) for i in range(args.pairs)] + [("20% slower", SLOW_LAYERS)]
        for i, (name, layers) in enumerate(cases):
            base, new = Path(tmp) / f"base{i}", Path(tmp) / f"new{i}"
            try:
                if args.order == "interleaved":
                    interleaved(base, new, layers, args.steps, args.repeats)
                    if args.repeats == 1:  # one run a side: gate the runs, not folders of one
                        base, new = base / "0", new / "0"
                else:
                    for repeat in range(args.repeats):
                        # The baseline on the other core every other pair: a core's own speed falls on both.
                        run_dirs = (base / str(repeat), new / str(repeat)) if args.repeats > 1 else (base, new)
                        side_by_side(*run_dirs, layers, args.steps, base_core=(i + repeat) % 2)
            except RuntimeError as error:
                raise SystemExit(str(error)) from None
            code, verdict, delta, interval = gate(base, new)
            low, high = interval or (float("nan"), float("nan"))
            print(f"{name:<12} {code:>4}  {verdict:<13} {delta:>+8.1%}  {low:+.1%} to {high:+.1%}", flush=True)


if __name__ == "__main__":
    main()
