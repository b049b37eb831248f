#!/usr/bin/env bash
# Memory-safety check of the C fast path (src/traceml/probe/_fastpath.c).
#
#   scripts/memcheck.sh            all three parts
#   scripts/memcheck.sh valgrind   part 1 only
#   scripts/memcheck.sh dev        part 2 only
#   scripts/memcheck.sh refs       part 3 only
#
# The extension is built afresh (-g -O1) from MEMCHECK_SOURCE (default: the checkout's
# _fastpath.c) into a temporary copy of the traceml package, with a _layout.h made from that
# copy's layout.py as setup.py makes it; the copy goes first on PYTHONPATH. The in-place .so in
# src/ is neither used nor touched. The Python sources are the checkout's at the script's start.
#
# Part 1, valgrind memcheck, PYTHONMALLOC=malloc (every object its own malloc block): the code
#   the extension's tests run. One process under valgrind imports torch once (~90 s under
#   valgrind) and forks one child a case, MEMCHECK_JOBS at a time; valgrind follows forks, and
#   each case runs as `python SCRIPT` / `python -m MODULE` would, with its own cwd and run dir:
#   - inprocess: the in-process tests of tests/test_fastpath.py, through pytest (ProbeState's
#     __enter__/__exit__, the ring, drain_steps, _closed/_unconfirmed, a full buffer, a span's
#     push to a full sender that swaps the probe's dict of totals, a drop while the steps are
#     taken, a sender let go of, the model's timer without memory);
#   - the scripts the subprocess tests of tests/test_fastpath.py run, read from the test module
#     so they stay the tests' own: shapes_loop.py and inferred_shapes_loop.py (every Timer kind:
#     next, model call, backward, optimizer before/after, tensor.to; inferred steps, spans,
#     log_scalar), BROKEN_STEP (bookkeeping faults), SPAN_TIMES (span, SpanTotal), IDLE_CALLS
#     (the timers outside the steps), FAULT_IN_ENTER under `traceml run --deep` (zero-code,
#     the import timer, a fault in __enter__ from the model's timer; the script runs in a fork of
#     the launcher, so under valgrind too), SPAN_TOTALS_CHURN (SpanTotal's type references);
#   - faults_plain, faults_run: train_loop.py as tests/test_faults.py runs it, plain python
#     (rank 0 starts the collector) and under `traceml run`.
#   The pytest tests that spawn these are not run under valgrind --trace-children: their limits
#   (120 s a subprocess, wait_for's 60 s) do not survive valgrind's slowdown, and every collector
#   would be traced too. Each case checks the line its test reads instead. A process that execs
#   (the collector) is not traced.
#   A case fails on: any invalid read/write/free left after scripts/valgrind-python.supp,
#   anywhere; any other error, or definitely-lost block, made by _fastpath (its stack, for a
#   leak the allocation's, reaches a _fastpath frame before any Python frame: errors in Python
#   code the extension merely called, such as a user's forward, are not its own);
#   its process not exiting 0 or lacking its expected line.
# Part 2, `python -X dev` with PYTHONMALLOC=debug (and PYTHONDEVMODE=1, so that the tests'
#   subprocesses get both): tests/test_fastpath.py whole, and the tests of tests/test_faults.py
#   that run the compiled timers (all but the taken-port and full-store ones, which never load
#   them), as pytest runs them.
# Part 3, the exported types' reference counts: one that is short (a PyModule_AddObject without
#   its Py_INCREF) is latent on 3.11, out of reach of parts 1 and 2, so it is counted.
#
# Environment: MEMCHECK_SOURCE (the .c to build), MEMCHECK_JOBS (cases at once; default the
# CPUs), MEMCHECK_CASES (a space-separated subset of part 1's cases), MEMCHECK_KEEP=1 (keep the
# work folder; it is always kept when something fails).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PARTS="${1:-all}"
PY="$(python3 -c 'import sys; print(sys.executable)')"  # the interpreter itself, not a shim
SOURCE="$(realpath "${MEMCHECK_SOURCE:-$ROOT/src/traceml/probe/_fastpath.c}")"
JOBS="${MEMCHECK_JOBS:-$(nproc)}"
SUPP="$ROOT/scripts/valgrind-python.supp"
WORK="$(mktemp -d /tmp/traceml-memcheck.XXXXXX)"
CASES="${MEMCHECK_CASES:-inprocess shapes inferred broken_step span_times idle_calls fault_in_enter span_churn faults_plain faults_run}"
started_all=$SECONDS

say() { printf '%s\n' "$*"; }

# ---- the extension, built into a copy of the package ---------------------------------------
PKG="$WORK/pkg"
PROBE="$PKG/traceml/probe"
mkdir -p "$PKG"
(cd "$ROOT/src" && tar --exclude=__pycache__ --exclude='*.so' --exclude=_layout.h -cf - traceml) | tar -xf - -C "$PKG"
cp "$SOURCE" "$PROBE/_fastpath.c"
if [ -f "$PROBE/layout.py" ]; then
    "$PY" -c 'import runpy, sys; open(sys.argv[2], "w").write(runpy.run_path(sys.argv[1])["c_header"]())' \
        "$PROBE/layout.py" "$PROBE/_layout.h" || { say "memcheck: FAIL: cannot make _layout.h"; exit 2; }
fi
read -r INCLUDE SUFFIX < <("$PY" -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))')
SO="$PROBE/_fastpath$SUFFIX"
if ! gcc -shared -fPIC -g -O1 -fno-omit-frame-pointer -Wall -I"$INCLUDE" -o "$SO" "$PROBE/_fastpath.c" 2>"$WORK/build.log"; then
    cat "$WORK/build.log"
    say "memcheck: FAIL: cannot build $SOURCE (logs in $WORK)"
    exit 2
fi
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # valgrind runs one thread at a time anyway
if ! "$PY" -c "
import sys
from traceml.probe import step, _fastpath
assert _fastpath.__file__ == sys.argv[1], _fastpath.__file__
assert step.fast_path is _fastpath, 'the build is not used (its layout or version differs from step.py?)'
" "$SO"; then
    say "memcheck: FAIL: the temporary build does not load as traceml's fast path (logs in $WORK)"
    exit 2
fi
say "memcheck: built $SOURCE into $PKG (work folder $WORK)"

# ---- part 1: valgrind ---------------------------------------------------------------------
cat >"$WORK/cases.py" <<'EOF'
"""Part 1's driver, run under valgrind: imports torch once, then forks one child a case, which
runs the case's script as `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would."""
import os
import runpy
import sys
import time

def cases(work, root):
    """name: (argv, a line (regex) its stdout or stderr must have, as its test checks)."""
    scripts, tests, payloads = f"{root}/tests/scripts", f"{root}/tests/test_fastpath.py", f"{work}/payloads"
    in_process = ["test_the_compiled_timers_are_built_and_used",
                  "test_a_full_buffer_drops_and_counts_each_new_record_and_each_sender_has_its_own",
                  "test_steps_ended_by_either_path_reach_the_sender_in_order_with_their_figures",
                  "test_a_step_keeps_every_figure_on_its_way_to_the_sender",
                  "test_a_span_total_goes_to_the_probes_dict_as_it_is_after_a_full_buffers_push",
                  "test_a_step_dropped_while_the_sender_takes_the_steps_is_counted",
                  "test_a_probe_lets_its_sender_go",
                  "test_the_models_call_runs_when_its_timer_has_no_memory_for_its_bookkeeping"]
    return {
        "inprocess": (["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o", "timeout=0",
                       *(f"{tests}::{test}" for test in in_process)], r" 8 passed"),
        "shapes": ([f"{scripts}/shapes_loop.py"], r'"compiled": true'),
        "inferred": ([f"{scripts}/inferred_shapes_loop.py"], r'"compiled": true'),
        "broken_step": ([f"{payloads}/BROKEN_STEP.py"], r'^\{"faults": 4, "grad": true\}$'),
        "span_times": ([f"{payloads}/SPAN_TIMES.py"], r'"compiled": true'),
        "idle_calls": ([f"{payloads}/IDLE_CALLS.py"], r'^\{"compiled": true, "ran": \[\]\}$'),
        "fault_in_enter": (["-m", "traceml", "run", "--deep", "--mode", "summary", f"{payloads}/FAULT_IN_ENTER.py"],
                           r"disabled after an internal error in trace_step enter"),
        "span_churn": ([f"{payloads}/SPAN_TOTALS_CHURN.py"], r"^made True$"),
        "faults_plain": ([f"{scripts}/train_loop.py", "--steps", "150", "--load-ms", "1"], r"^trained 150 steps$"),
        "faults_run": (["-m", "traceml", "run", "--mode", "summary", "--run-dir", "{folder}/run",
                        f"{scripts}/train_loop.py", "--steps", "40", "--close-stdout-at", "10"], r"^closing stdout$"),
    }


def write_payloads(work, root):
    """The scripts the subprocess tests run, from the test module itself."""
    os.makedirs(f"{work}/payloads", exist_ok=True)
    sys.path.insert(0, f"{root}/tests")
    import test_fastpath
    for name in ("BROKEN_STEP", "SPAN_TIMES", "IDLE_CALLS", "FAULT_IN_ENTER", "SPAN_TOTALS_CHURN"):
        with open(f"{work}/payloads/{name}.py", "w") as out:
            out.write(getattr(test_fastpath, name))


def run_case(work, root, name):
    """In the fork: the case's script, as its own `python` would run it; its exit status."""
    argv = cases(work, root)[name][0]
    folder = f"{work}/valgrind/{name}"
    argv = [arg.replace("{folder}", folder) for arg in argv]
    os.makedirs(f"{folder}/cwd", exist_ok=True)
    os.chdir(f"{folder}/cwd")
    os.environ["TRACEML_RUN_DIR"] = f"{folder}/run"
    for fd, file in ((1, "stdout"), (2, "stderr")):
        opened = os.open(f"{folder}/{file}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    del sys.path[0]  # this driver's folder
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exc.code
    return 0


def main(work, root, jobs, names):
    import torch  # noqa: F401  once, before the forks: each case's own import is then a lookup

    running, started = {}, {}
    pending = list(names)
    with open(f"{work}/valgrind/pids", "w") as pids:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    return run_case(work, root, name)
                running[pid], started[pid] = name, time.monotonic()
                print(name, pid, file=pids, flush=True)
            pid, status = os.wait()
            name = running.pop(pid)
            seconds = round(time.monotonic() - started[pid])
            with open(f"{work}/valgrind/{name}/rc", "w") as out:
                out.write(str(os.waitstatus_to_exitcode(status)))
            with open(f"{work}/valgrind/{name}/seconds", "w") as out:
                out.write(str(seconds))
            print(f"  done {name} ({seconds} s)", flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[3] == "--payloads":
        write_payloads(sys.argv[1], sys.argv[2])
    elif sys.argv[3] == "--expect":
        print(cases(sys.argv[1], sys.argv[2])[sys.argv[4]][1])
    else:
        sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]))  # a case: its script's end
EOF

cat >"$WORK/analyse.py" <<'EOF'
"""Part 1's verdict, from every process's valgrind log: one line a case, excerpts of what failed."""
import glob
import os
import re
import sys

work, names = sys.argv[1], sys.argv[2:]
# A block's first line says what it is (after a "Thread N:" line); it is an error when it has a stack.
INVALID = re.compile(r"^(Invalid (read|write|free)|Mismatched free|Jump to the invalid address|Source and "
                     r"destination overlap|Illegal memory pool|Invalid .*mempool)")
LEAK = re.compile(r"are definitely lost in loss record")
NOT_ERRORS = re.compile(r"^(Memcheck,|Copyright|Using Valgrind|Command:|Parent PID:|HEAP SUMMARY|LEAK SUMMARY|"
                        r"ERROR SUMMARY|For lists|For counts|Use --|Rerun with|Reachable blocks|To see them|"
                        r"Searching for pointers|Warning:|in use at exit|total heap usage|(definitely|indirectly|"
                        r"possibly) lost:|still reachable:|suppressed:|All heap blocks)")
FRAME = re.compile(r"^\s+(at|by) 0x[0-9A-Fa-f]+: (.*?) \((.*)\)$")
EVAL = "_PyEval_EvalFrameDefault"


def blocks(lines):
    block = []
    for line in lines:
        if not line.strip():
            if block:
                yield block
            block = []
        elif not (not block and re.match(r"^Thread \d+( \(.*\))?:$", line.strip())):
            block.append(line)
    if block:
        yield block


def frame(line):
    match = FRAME.match(line)
    return (match.group(2), match.group(3)) if match else None


def in_fastpath(line):
    found = frame(line)
    return found is not None and "_fastpath" in found[1]


def first_stack(block):
    stack = []
    for line in block[1:]:
        if frame(line) is None:
            break
        stack.append(line)
    return stack


def fastpath_did_it(block):
    """The error's own stack (for a leak: where the block was allocated) reaches a _fastpath frame
    before any Python frame: the extension made the call itself. One further down, under the
    eval loop, only called Python code that did (a user's forward, the import machinery)."""
    for line in first_stack(block):
        if in_fastpath(line):
            return True
        if frame(line)[0] == EVAL:
            return False
    return False


def excerpt(block):
    lines, stack = [block[0]], []

    def flush():
        near = [i for i, line in enumerate(stack) if in_fastpath(line)]
        shown = set(range(min(6, len(stack))))
        if near:  # and where the stack meets _fastpath (for a free: who freed it)
            shown |= set(range(max(0, near[0] - 2), min(len(stack), near[-1] + 3 if near[-1] - near[0] < 6 else near[0] + 3)))
        previous = -1
        for index in sorted(shown):
            if index != previous + 1:
                lines.append("     ...")
            line = stack[index]
            lines.append(f"  {'>>' if in_fastpath(line) else '  '} {frame(line)[0]} ({frame(line)[1]})")
            previous = index
        if previous < len(stack) - 1:
            lines.append(f"     ... ({len(stack)} frames)")
        stack.clear()

    for line in block[1:]:
        if frame(line) is None:
            flush()
            lines.append(line.strip())  # Address ... free'd / alloc'd, Block was alloc'd at
        else:
            stack.append(line)
    flush()
    return "\n".join("      " + line for line in lines)


def signature(block):
    """Repeats of one error as one: its kind, and where the extension is on its stack (or its top)."""
    kind = re.sub(r" of size \d+|\d[\d,]* bytes in \d[\d,]* blocks|loss record .*", "", block[0].strip())
    stack = first_stack(block)
    return kind, next((frame(line) for line in stack if in_fastpath(line)), frame(stack[0]) if stack else None)


# Each process's log, and the case it belongs to: its own pid's, or its nearest forked ancestor's.
logs, parents = {}, {}
for path in glob.glob(f"{work}/valgrind/vg.*.log"):
    pid = path.rsplit(".", 2)[-2]
    lines = [re.sub(r"^==\d+== ?", "", raw.rstrip("\n")) for raw in open(path, errors="replace")]
    logs[pid] = lines
    parents[pid] = next((line.split(":", 1)[1].strip() for line in lines[:8] if line.startswith("Parent PID:")), "")
case_of_pid = {}
if os.path.exists(f"{work}/valgrind/pids"):
    case_of_pid = {pid: name for name, pid in (line.split() for line in open(f"{work}/valgrind/pids"))}
pid_of_case = {name: pid for pid, name in case_of_pid.items()}


def case_of(pid):
    seen = set()
    while pid and pid not in case_of_pid and pid not in seen:
        seen.add(pid)
        pid = parents.get(pid, "")
    return case_of_pid.get(pid, "import")  # else the driver itself: torch's import, before any fork


failed = 0
for name in ["import", *names]:
    folder = f"{work}/valgrind/{name}"

    def read(file, default=""):
        path = f"{folder}/{file}"
        return open(path, errors="replace").read() if os.path.exists(path) else default

    mine = sorted(pid for pid in logs if case_of(pid) == name)
    bad, noise = {}, {}  # signature -> [label, count, block]
    for pid in mine:
        for block in blocks(logs[pid]):
            header = block[0].strip()
            if NOT_ERRORS.match(header) or frame(block[1] if len(block) > 1 else "") is None:
                continue
            ours, invalid, leak = fastpath_did_it(block), bool(INVALID.match(header)), bool(LEAK.search(header))
            if invalid or ours:
                kind = "invalid access" if invalid else "definite leak" if leak else "error"
                label = f"{kind}, {'made by _fastpath' if ours else 'not in _fastpath'}, pid {pid}"
                entry = bad.setdefault(signature(block), [kind, label, 0, block])
                entry[2] += 1
            else:
                key = "definite leaks" if leak else re.sub(r" of size \d+| \d+ bytes.*", "", header)
                noise[key] = noise.get(key, 0) + 1
    invalid = sum(count for kind, _, count, _ in bad.values() if kind == "invalid access")
    leaks = sum(count for kind, _, count, _ in bad.values() if kind == "definite leak")
    others = sum(count for kind, _, count, _ in bad.values() if kind == "error")
    noise_text = "; ".join(f"{key} {count}" for key, count in sorted(noise.items())) or "none"
    if name == "import":
        ok, head = not bad, "torch's import (the driver, before the forks)"
    else:
        rc = int(read("rc", "1").strip() or 1)
        expect = read("expect").strip()
        expected = bool(re.search(expect, read("stdout") + read("stderr"), re.M)) if expect else True
        finished = any(line.startswith("ERROR SUMMARY") for line in logs.get(pid_of_case.get(name, ""), []))
        ok = rc == 0 and expected and finished and not bad
        head = (f"{read('seconds', '?').strip():>4s} s, exit {rc}" + ("" if expected else ", its line is missing")
                + ("" if finished else ", no valgrind summary (killed?)"))
    failed += not ok
    print(f"  {'ok  ' if ok else 'FAIL'} {name:14s} {head}: invalid reads/writes/frees {invalid},"
          f" definite leaks made by _fastpath {leaks}, other errors made by _fastpath {others}"
          f"  [{len(mine)} process(es); ignored, not made by _fastpath: {noise_text}]")
    for kind, label, count, block in bad.values():
        print(f"    -- {label}{f' (x{count})' if count > 1 else ''}")
        print(excerpt(block))
    if name != "import" and not ok and not bad:
        print("    stderr's tail:\n" + "\n".join("      " + line for line in read("stderr").splitlines()[-15:]))
sys.exit(1 if failed else 0)
EOF

part1() {
    command -v valgrind >/dev/null || { say "  valgrind is not installed"; return 1; }
    local started=$SECONDS name status
    "$PY" "$WORK/cases.py" "$WORK" "$ROOT" --payloads || { say "  cannot read the tests' scripts"; return 1; }
    for name in $CASES; do
        mkdir -p "$WORK/valgrind/$name"
        "$PY" "$WORK/cases.py" "$WORK" "$ROOT" --expect "$name" >"$WORK/valgrind/$name/expect" 2>/dev/null \
            || { say "  no such case: $name"; return 1; }
    done
    say "valgrind: ${CASES// /, } ($JOBS at once)"
    # shellcheck disable=SC2086
    (cd "$WORK" && PYTHONMALLOC=malloc valgrind --tool=memcheck --trace-children=no --child-silent-after-fork=no \
        --log-file="$WORK/valgrind/vg.%p.log" --error-limit=no --suppressions="$SUPP" \
        --leak-check=full --show-leak-kinds=definite --errors-for-leak-kinds=definite --num-callers=40 \
        "$PY" "$WORK/cases.py" "$WORK" "$ROOT" "$JOBS" $CASES)
    status=$?
    "$PY" "$WORK/analyse.py" "$WORK" $CASES || status=1
    VALGRIND_SECONDS=$((SECONDS - started))
    return $status
}

# ---- part 2: python -X dev, PYTHONMALLOC=debug ----------------------------------------------
part2() {
    local started=$SECONDS status
    mkdir -p "$WORK/dev"
    say "python -X dev, PYTHONMALLOC=debug: tests/test_fastpath.py, tests/test_faults.py"
    (cd "$WORK/dev" && PYTHONMALLOC=debug PYTHONDEVMODE=1 "$PY" -X dev -m pytest -q -p no:cacheprovider -o addopts= \
        "$ROOT/tests/test_fastpath.py" "$ROOT/tests/test_faults.py" \
        -k "not taken_collector_port and not full_store_keeps" >"$WORK/dev/pytest.log" 2>&1)
    status=$?
    DEV_SECONDS=$((SECONDS - started))
    grep -E "^(FAILED|ERROR) |Fatal Python error|[0-9]+ (passed|failed)" "$WORK/dev/pytest.log" | sed 's/^/  /'
    return $status
}

# ---- part 3: the exported types' references ------------------------------------------------
# A static type handed to PyModule_AddObject without its Py_INCREF is one reference short. On
# CPython 3.11 nothing frees it (the module's copy of its dict and the type's own descriptors
# keep it alive), so neither valgrind nor the debug allocator can see it: count it instead. Each
# type's references not held by a gc-visible object or a subclass must be the same for all.
part3() {
    "$PY" - <<'EOF'
import gc
import sys

from traceml.probe import _fastpath, step, tracer, zero_code  # noqa: F401  what subclasses them in a run


def unowned(name):
    gc.collect()
    owners = gc.get_referrers(getattr(_fastpath, name))
    held = sum(1 for owner in owners for item in gc.get_referents(owner) if item is getattr(_fastpath, name))
    return sys.getrefcount(getattr(_fastpath, name)) - held - len(getattr(_fastpath, name).__subclasses__())


counts = {name: unowned(name) for name in sorted(dir(_fastpath)) if isinstance(getattr(_fastpath, name), type)}
usual = max(set(counts.values()), key=list(counts.values()).count)
odd = {name: count - usual for name, count in counts.items() if count != usual}
print(f"  references not held by an object or subclass: {counts}")
for name, short in odd.items():
    print(f"  {name}: {-short} reference(s) {'short' if short < 0 else 'too many'} (PyModule_AddObject without Py_INCREF?)")
sys.exit(1 if odd else 0)
EOF
}

total=0 VALGRIND_SECONDS=0 DEV_SECONDS=0
verdicts=()
if [ "$PARTS" = all ] || [ "$PARTS" = valgrind ]; then
    if part1; then verdicts+=("valgrind memcheck: PASS (${VALGRIND_SECONDS} s)")
    else verdicts+=("valgrind memcheck: FAIL (${VALGRIND_SECONDS} s; logs in $WORK/valgrind)"); total=1; fi
fi
if [ "$PARTS" = all ] || [ "$PARTS" = dev ]; then
    if part2; then verdicts+=("python -X dev, PYTHONMALLOC=debug: PASS (${DEV_SECONDS} s)")
    else verdicts+=("python -X dev, PYTHONMALLOC=debug: FAIL (${DEV_SECONDS} s; $WORK/dev/pytest.log)"); total=1; fi
fi
if [ "$PARTS" = all ] || [ "$PARTS" = refs ]; then
    say "type references: the module's exported types"
    if part3; then verdicts+=("type references: PASS")
    else verdicts+=("type references: FAIL"); total=1; fi
fi
say ""
for verdict in "${verdicts[@]}"; do say "$verdict"; done
if [ "$total" -eq 0 ]; then
    say "memcheck: PASS ($((SECONDS - started_all)) s, $SOURCE)"
    [ "${MEMCHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK"
else
    say "memcheck: FAIL ($((SECONDS - started_all)) s, $SOURCE; work folder $WORK)"
fi
exit "$total"
