"""How often the primary verdict is right: a labelled corpus of real CPU training runs, each run
quiet and beside a CPU hog, scored against its truth.

Every case is a real script (tests/scripts, tests/field) under `traceml run --mode summary`,
labelled with the verdict a careful engineer would give it, and, where the finding must name
something (a straggler's rank, a period), that too; where a second finding must be listed
under Also (evaluation that is the run's plan, a busy machine's stalls), that too. Each runs `--runs`
times on a quiet machine and `--runs` times with a hog process spinning on one core beside it.
Prints a confusion table (truth against the primary verdict), then the accuracy of the verdict
and of its evidence, quiet and loaded, and the cases that missed.

    python benchmarks/diagnosis_accuracy.py [--runs 3] [--case NAME ...] [--quiet-only]

H2D_BOUND needs an accelerator (a copy to the CPU's own memory is not one); SLOW_STARTUP,
RECOMPILATION and HOST_SYNC are not found by this version: none is in the corpus.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
FIELD = ROOT / "tests" / "field"
TRAIN = SCRIPTS / "train_loop.py"
CHAR = FIELD / "char_transformer.py"
WIDE = ("--no-loader", "--batch-size", "64", "--features", "512", "--width", "2048")


class Case(NamedTuple):
    name: str
    script: Path
    args: tuple
    truth: str  # the primary verdict's kind
    evidence: Dict[str, object] = {}  # what the primary finding must also say
    also: Optional[Tuple[str, Dict[str, object]]] = None  # a finding that must be listed after it
    traceml_args: tuple = ()
    timeout_s: float = 240.0
    beside: int = 0  # bursting neighbours: processes that spin 150 ms of every second, together


CASES: List[Case] = [
    # The healthy run, in several shapes: its verdict is COMPUTE_BOUND.
    Case("healthy wide MLP", TRAIN, ("--steps", "80", *WIDE), "COMPUTE_BOUND"),
    Case("healthy long steps", TRAIN, ("--steps", "30", "--no-loader", "--batch-size", "256",
                                       "--features", "1024", "--width", "4096"), "COMPUTE_BOUND"),
    Case("healthy tiny steps", TRAIN, ("--steps", "600", "--no-loader", "--batch-size", "256",
                                       "--features", "128", "--width", "512"), "COMPUTE_BOUND"),
    Case("healthy Adam warm-up", TRAIN, ("--steps", "80", *WIDE, "--optimizer", "adam"),
         "COMPUTE_BOUND"),
    Case("healthy GPT, eval every 10", FIELD / "gpt_memmap.py", ("--out", "out", "--iters", "40"),
         "COMPUTE_BOUND"),
    Case("healthy MLP, first eval 10x slower", FIELD / "cached_validation.py", ("--out", "out"),
         "COMPUTE_BOUND", also=("EVAL_HEAVY", {"period_steps": 10})),
    Case("healthy transformer, deep-dive", SCRIPTS / "tiny_transformer.py", ("--steps", "60"),
         "COMPUTE_BOUND", traceml_args=("--deep",)),
    Case("healthy LoRA fine-tune, deep-dive", FIELD / "llama_lora.py", ("--out", "out", "--steps", "80"),
         "COMPUTE_BOUND", traceml_args=("--deep",)),
    Case("healthy HF Trainer, eval every 20", SCRIPTS / "hf_trainer.py",
         ("--max-steps", "100", "--accumulate", "2", "--eval-every", "20", "--eval-rows", "80"),
         "COMPUTE_BOUND", also=("EVAL_HEAVY", {"period_steps": 20})),
    Case("healthy LSTM, manual SGD", FIELD / "lstm_bptt.py", ("--out", "out", "--epochs", "3"),
         "COMPUTE_BOUND"),
    Case("healthy compiled model", FIELD / "compiled_ema.py",
         ("--out", "out", "--steps", "60", "--backend", "aot_eager"), "COMPUTE_BOUND"),
    Case("healthy HF causal LM, padded labels", SCRIPTS / "trained_tokens.py",
         ("--shape", "hf", "--padded", "--steps", "80"), "COMPUTE_BOUND"),
    Case("healthy decoder slicing its chunk", SCRIPTS / "trained_tokens.py", ("--shape", "chunk", "--steps", "80"),
         "COMPUTE_BOUND"),
    # Waiting for data.
    Case("slow Dataset", TRAIN, ("--steps", "40", "--load-ms", "2"), "INPUT_BOUND"),
    Case("slow collate, zero-code", SCRIPTS / "untouched_loop.py", ("--steps", "40", "--collate-ms", "8"),
         "INPUT_BOUND"),
    Case("slow loader, Trace API", SCRIPTS / "trace_api_loop.py", ("--steps", "40", "--load-ms", "2"),
         "INPUT_BOUND"),
    Case("slow collate, HF Trainer", SCRIPTS / "hf_trainer.py",
         ("--max-steps", "20", "--accumulate", "2", "--collate-ms", "20"), "INPUT_BOUND"),
    # What the DataLoader's figures say the wait is (the finding's loader_cause).
    Case("cheap batches, 2 workers", CHAR, ("--out", "out", "--workers", "2", "--steps", "300"),
         "INPUT_BOUND", {"loader_cause": "handover", "num_workers": 2}),
    Case("slow reads, 2 workers", CHAR, ("--out", "out", "--workers", "2", "--steps", "200", "--read-ms", "4"),
         "INPUT_BOUND", {"loader_cause": "waiting_workers", "num_workers": 2}),
    # Input wait on INPUT_BOUND's 10% line (9-10% of the step, run after run): told under Also,
    # never the verdict, quiet or loaded.
    Case("input wait at the line", CHAR, ("--out", "out", "--workers", "0", "--steps", "500", "--augment", "10"),
         "COMPUTE_BOUND", also=("INPUT_BOUND", {"loader_cause": "no_workers"})),
    # Work of the user's outside the model.
    Case("logging between steps", TRAIN, ("--steps", "60", *WIDE[:3], "--outside-ms", "25"), "UNTRACED_WORK"),
    Case("a sync inside every 10th step", TRAIN, ("--steps", "100", *WIDE, "--stall-every", "10",
                                                  "--stall-ms", "150"),
         "UNTRACED_WORK", {"period_steps": 10}),
    Case("Lightning, a tiny model", SCRIPTS / "lightning_fit.py",
         ("--steps", "200", "--val-every", "1000", "--val-sample-ms", "0"), "UNTRACED_WORK"),
    # The garbage collector.
    Case("gc.collect() every step", TRAIN, ("--steps", "14", "--no-loader", "--gc-heap", "1500000"),
         "GC_PRESSURE"),
    # Memory.
    Case("a leak of every step's graph", TRAIN, ("--steps", "60", "--no-loader", "--keep-graph",
                                                 "--retain-graph", "--batch-size", "512", "--features", "256",
                                                 "--width", "1024", "--outside-ms", "10"),
         "MEMORY_CREEP"),
    Case("out of memory in a layer", SCRIPTS / "tiny_transformer.py",
         ("--steps", "40", "--deep-every", "5", "--oom-at", "12"), "MEMORY_PRESSURE"),
    # The run's planned work.
    Case("a save inside every 20th step", TRAIN, ("--steps", "120", "--no-loader", "--save-every", "20",
                                                  "--save-mb", "48"),
         "CHECKPOINT_STALL", {"period_steps": 20}),
    Case("a save between steps, every 10th", TRAIN, ("--steps", "100", "--no-loader", "--save-every",
                                                     "10", "--save-mb", "48", "--save-between"),
         "CHECKPOINT_STALL", {"period_steps": 10}),
    Case("evaluation every 2 iterations", FIELD / "gpt_memmap.py",
         ("--out", "out", "--iters", "40", "--eval-every", "2"), "EVAL_HEAVY", {"period_steps": 2}),
    # Sampling through the model's inner network under no_grad, never through the traced model.
    Case("sampling through an inner net every 3", FIELD / "sampled_lm.py",
         ("--out", "out", "--steps", "60", "--sample-every", "3", "--eval-every", "1000"), "EVAL_HEAVY",
         {"period_steps": 3}),
    # Slow steps with no share-based cause.
    Case("every 10th batch 8x larger", TRAIN, ("--steps", "100", *WIDE, "--long-batch-every", "10"),
         "STEP_SPIKES", {"period_steps": 10}),
    # A busy machine: its stalls are named, under Also; the verdict is the run's own.
    Case("a neighbour's CPU bursts", TRAIN, ("--steps", "400", *WIDE[:3], "--features", "256",
                                             "--width", "1024"),
         "COMPUTE_BOUND", also=("STEP_SPIKES", {"machine_wide": True}), beside=3),
    # Ranks.
    Case("a rank with a slow Dataset", SCRIPTS / "ddp_loop.py",
         ("--steps", "60", "--slow-rank", "1", "--load-ms", "2"), "INPUT_STRAGGLER", {"rank": 1},
         traceml_args=("--nproc-per-node", "2")),
    Case("a rank with extra compute", SCRIPTS / "ddp_loop.py",
         ("--steps", "60", "--slow-rank", "1", "--busy-ms", "15"), "COMPUTE_STRAGGLER", {"rank": 1},
         traceml_args=("--nproc-per-node", "2")),
    Case("a rank that sleeps between steps", SCRIPTS / "ddp_loop.py",
         ("--steps", "60", "--slow-rank", "0", "--sleep-ms", "15"), "STRAGGLER", {"rank": 0},
         traceml_args=("--nproc-per-node", "2")),
    # Two causes competing: the larger one is the verdict, the other under Also.
    Case("waiting 15%, logging 40%", TRAIN, ("--steps", "60", *WIDE[:3], "--load-ms", "0.5",
                                             "--outside-ms", "20"), "UNTRACED_WORK"),
    Case("gc 60%, waiting 20%", TRAIN, ("--steps", "20", "--gc-heap", "1000000", "--load-ms", "1"),
         "GC_PRESSURE"),
    # Too little to say.
    Case("five steps", TRAIN, ("--steps", "5",), "INSUFFICIENT_DATA"),
    Case("no step to find", FIELD / "grad_only.py", ("--out", "out"), "INSUFFICIENT_DATA"),
]


# A neighbour that wakes on each whole second and spins for 150 ms: several together stall
# whatever else runs on the machine, now and then.
BURST = """
import time
while True:
    time.sleep(1.0 - time.time() % 1.0)
    end = time.perf_counter() + 0.15
    while time.perf_counter() < end:
        pass
"""


class Result(NamedTuple):
    case: Case
    loaded: bool
    primary: str
    evidence_ok: bool
    detail: str


def run_case(case: Case, loaded: bool, workdir: Path) -> Result:
    run_dir = workdir / "run"
    command = [sys.executable, "-m", "traceml", "run", "--mode", "summary", "--run-dir", str(run_dir),
               *case.traceml_args, str(case.script), *case.args]
    env = {k: v for k, v in os.environ.items() if k not in ("TRACEML_COLLECTOR", "TRACEML_RUN_DIR")}
    others = [subprocess.Popen([sys.executable, "-c", BURST]) for _ in range(case.beside)]
    if loaded:
        others.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
    try:
        process = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                                 timeout=case.timeout_s)
    except subprocess.TimeoutExpired:
        return Result(case, loaded, "TIMEOUT", False, "")
    finally:
        for other in others:
            other.kill()
            other.wait()
    try:
        summary = json.loads((run_dir / "final_summary.json").read_text())
    except (OSError, ValueError):
        return Result(case, loaded, "NO SUMMARY", False, process.stderr[-300:])
    primary = summary.get("primary_diagnosis") or {}
    kind = primary.get("kind", "NONE")
    evidence = dict(primary.get("evidence") or {}, rank=primary.get("rank"))
    ok = kind == case.truth and all(evidence.get(key) == value for key, value in case.evidence.items())
    shown = {key: evidence.get(key) for key in case.evidence}
    if case.also:
        also_kind, also_evidence = case.also
        others = [f for f in summary.get("findings", [])[1:] if f.get("kind") == also_kind]
        ok = ok and any(all((f.get("evidence") or {}).get(key) == value for key, value in also_evidence.items())
                        for f in others)
        shown["also"] = [(f["kind"], {key: (f.get("evidence") or {}).get(key) for key in also_evidence})
                         for f in others] or f"no {also_kind}"
    return Result(case, loaded, kind, ok, f"{primary.get('summary', '')[:110]} {shown or ''}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each case, quiet and loaded each")
    parser.add_argument("--case", action="append", default=[], help="only cases whose name holds this")
    parser.add_argument("--quiet-only", action="store_true", help="no runs beside the CPU hog")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.case or any(part in c.name for part in args.case)]
    results: List[Result] = []
    started = time.monotonic()
    for case in cases:
        for loaded in (False, True)[:1 if args.quiet_only else 2]:
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as workdir:
                    result = run_case(case, loaded, Path(workdir))
                results.append(result)
                mark = "ok  " if result.primary == case.truth and result.evidence_ok else "MISS"
                print(f"{mark} {'loaded' if loaded else 'quiet '} {case.name:<34} {result.primary:<18} "
                      f"{result.detail}", flush=True)
    print(f"\n{len(results)} runs of {len(cases)} cases in {time.monotonic() - started:.0f} s\n")
    print_confusion(results)
    for loaded in (False, True):
        mine = [r for r in results if r.loaded == loaded]
        if not mine:
            continue
        verdicts = sum(r.primary == r.case.truth for r in mine)
        with_evidence = [r for r in mine if r.case.evidence or r.case.also]
        print(f"{'loaded' if loaded else 'quiet '}: primary verdict right in {verdicts}/{len(mine)} "
              f"({verdicts / len(mine):.0%}); evidence right in "
              f"{sum(r.evidence_ok for r in with_evidence)}/{len(with_evidence)}")
    missed = collections.Counter((r.case.name, r.loaded, r.primary) for r in results if not r.evidence_ok)
    for (name, loaded, primary), count in sorted(missed.items()):
        print(f"  missed: {name} ({'loaded' if loaded else 'quiet'}): {primary} x{count}")


def print_confusion(results: List[Result]) -> None:
    truths = sorted({r.case.truth for r in results})
    predicted = sorted({r.primary for r in results} | set(truths))
    width = max(len(k) for k in predicted) + 1
    counts = collections.Counter((r.case.truth, r.primary) for r in results)
    print("truth \\ primary".ljust(width) + " ".join(p[:9].rjust(9) for p in predicted))
    for truth in truths:
        print(truth.ljust(width) + " ".join(str(counts[(truth, p)] or ".").rjust(9) for p in predicted))
    print()


if __name__ == "__main__":
    main()
