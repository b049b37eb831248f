#!/usr/bin/env bash
# The whole test suite, as CI runs it: bash scripts/test.sh [extra pytest arguments for pass 1]
#
# 1. Every test not marked `serial`, on three workers. Most tests are real runs in subprocesses
#    that wait on sleeps, sockets and each other as much as they compute, so three keep a 2-core
#    machine busy; each process has one torch thread (tests/conftest.py).
# 2. The `serial` tests, which compare runs' timings, in a pytest of their own, and beside them
#    the probe's, the compiled timers' and the fault tests again on the Python timers alone
#    (TRACEML_NO_FASTPATH=1: a machine where the C extension is not built), on one worker. The
#    serial tests must hold beside a busy core anyway; this one is at most that.
set -uo pipefail
cd "$(dirname "$0")/.."

python -m pytest -n 4 --dist loadgroup -m "not serial" "$@" || exit

python_timers_log=$(mktemp)
TRACEML_NO_FASTPATH=1 python -m pytest -q tests/test_probe.py tests/test_fastpath.py \
  tests/test_faults.py tests/test_trace_api.py >"$python_timers_log" 2>&1 &
python_timers=$!
python -m pytest -m serial
serial_status=$?
wait "$python_timers"
python_timers_status=$?
echo "== the probe's tests on the Python timers alone (TRACEML_NO_FASTPATH=1)"
cat "$python_timers_log"
rm -f "$python_timers_log"
[ "$serial_status" -eq 0 ] && [ "$python_timers_status" -eq 0 ]
