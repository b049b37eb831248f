#!/usr/bin/env bash
# The whole test suite, as CI runs it: bash scripts/test.sh [extra pytest arguments for pass 1]
#
# 1. Every test not marked `serial`, on five workers. Most tests are real runs in subprocesses
#    that wait on sleeps, sockets and each other as much as they compute, and each process has
#    one torch thread (tests/conftest.py), so together they keep a 2-core machine busy without
#    starving one another: fewer workers leave the cores idle while some of them wait (this
#    pass took 475-494 s on three, 432-445 s on four, 424 s on five with no idle core left).
# 2. The `serial` tests, which compare runs' timings and steps that stand out, in a pytest of
#    their own once the rest is done: other tests' start-ups beside them would be bursts in
#    their figures. Beside them, on the other core, the probe's and the compiled timers' tests
#    again on the Python timers alone (TRACEML_NO_FASTPATH=1: a machine where the C extension
#    is not built): one process at a time, a steady neighbour like the busy loop the serial
#    tests are checked beside. The trace API's runs are not made again: test_fastpath holds both
#    timers' steps, spans and scalars on the same loops against each other. Then, on that core
#    too, the GPU check's dry run, which also starts one process at a time (38 CPU seconds that
#    pass 1's workers would otherwise share).
set -uo pipefail
cd "$(dirname "$0")/.."
# The suite starts a few hundred Python processes: each would otherwise compile TraceML's modules
# again, and each pytest rewrite the tests' asserts again (__pycache__ is ignored by git).
unset PYTHONDONTWRITEBYTECODE

dry_run=tests/test_gpu_check.py::test_the_dry_run_writes_every_claim_with_a_status_and_passes_no_cuda_claim
python -m pytest -n 5 --dist loadgroup -m "not serial" --deselect "$dry_run" "$@" || exit 1

one_core_log=$(mktemp)
trap 'rm -f "$one_core_log"' EXIT
(
  status=0
  TRACEML_NO_FASTPATH=1 python -m pytest -q tests/test_probe.py tests/test_fastpath.py || status=1
  python -m pytest -q "$dry_run" || status=1
  exit "$status"
) >"$one_core_log" 2>&1 &
one_core=$!
# Only the files that hold them: collecting the whole suite again would be seconds on one core.
python -m pytest -m serial $(grep -l "pytest.mark.serial" tests/test_*.py)
serial_status=$?
wait "$one_core"
one_core_status=$?
echo "== the probe's tests again on the Python timers alone (TRACEML_NO_FASTPATH=1), then the GPU check's"
cat "$one_core_log"
[ "$serial_status" -eq 0 ] && [ "$one_core_status" -eq 0 ]
