#!/usr/bin/env bash
# The whole test suite, as CI runs it: bash scripts/test.sh [extra pytest arguments for pass 1]
#
# 1. Every test not marked `serial`, on five workers. Most tests are real runs in subprocesses
#    that wait on sleeps, sockets and each other as much as they compute, and each process has
#    one torch thread (tests/conftest.py), so together they keep a 2-core machine busy without
#    starving one another: fewer workers leave the cores idle while some of them wait (this
#    pass took 475-494 s on three, 432-445 s on four, 385-424 s on five with no idle core left).
#    Beside them, the probe's and the compiled timers' tests again on the Python timers alone
#    (TRACEML_NO_FASTPATH=1: a machine where the C extension is not built), one process. The
#    trace API's runs are not made again: test_fastpath holds both timers' steps, spans and
#    scalars on the same loops against each other.
# 2. The balanced DDP run, alone: it judges two ranks' compute against each other, and another
#    process on the node makes one of them slower (the verdict then names that process, which
#    is so, but would also excuse a rule that names a straggler where there is none).
# 3. The other `serial` tests, which compare runs' timings and steps that stand out, in a pytest
#    of their own: other tests' start-ups beside them would be bursts in their figures. Beside
#    them, on the other core, the GPU check's dry run, which starts one process at a time (38 CPU
#    seconds that pass 1's workers would otherwise share): a steady neighbour, like the busy loop
#    the suite is checked beside.
set -uo pipefail
cd "$(dirname "$0")/.."
# The suite starts a few hundred Python processes: each would otherwise compile TraceML's modules
# again, and each pytest rewrite the tests' asserts again (__pycache__ is ignored by git).
unset PYTHONDONTWRITEBYTECODE
dry_run=tests/test_gpu_check.py::test_the_dry_run_writes_every_claim_with_a_status_and_passes_no_cuda_claim
alone=tests/test_distributed.py::test_balanced_ranks_have_no_straggler
beside_log=$(mktemp)
trap 'rm -f "$beside_log"' EXIT

# Reports what a job beside a pass printed, after the pass's own output.
report() {
  echo "== $1"
  cat "$beside_log"
}

TRACEML_NO_FASTPATH=1 python -m pytest -q tests/test_probe.py tests/test_fastpath.py >"$beside_log" 2>&1 &
python_timers=$!
python -m pytest -n 5 --dist loadgroup -m "not serial" --durations=15 --deselect "$dry_run" "$@"
parallel_status=$?
wait "$python_timers"
python_timers_status=$?
report "the probe's tests again on the Python timers alone (TRACEML_NO_FASTPATH=1)"
[ "$parallel_status" -eq 0 ] && [ "$python_timers_status" -eq 0 ] || exit 1

python -m pytest -q "$alone" || exit 1

python -m pytest -q "$dry_run" >"$beside_log" 2>&1 &
dry_run_job=$!
# Only the files that hold them: collecting the whole suite again would be seconds on one core.
python -m pytest -m serial --deselect "$alone" $(grep -l "pytest.mark.serial" tests/test_*.py)
serial_status=$?
wait "$dry_run_job"
dry_run_status=$?
report "the GPU check's dry run"
[ "$serial_status" -eq 0 ] && [ "$dry_run_status" -eq 0 ]
