#!/usr/bin/env bash
# The GPU check in one command: TraceML's CUDA claims measured on this machine, one table row per
# claim (figure, threshold, pass/fail), printed and written to $OUT/gpu_check.md (else
# ./gpu_check.md), the raw figures beside it in gpu_check.json. Exit status 1 if a row fails.
#
# Runs from the repository root with the machine's own python3 and torch: nothing is installed
# from a registry (the GPU machine reaches none). A package TraceML needs that is missing there
# comes from wheels carried in .gpu-wheels/ (git-ignored), fetched beforehand on a machine with pip:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .gpu-wheels msgspec starlette uvicorn
# Extra arguments go to scripts/gpu_check.py (--dry-run, --only GROUP, --budget-s S).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Only a wheel whose package cannot be imported is installed (into a folder of its own, on the
# path after src/): a package the machine already has is never shadowed by a carried one.
site=/tmp/gpu-check-site
for wheel in .gpu-wheels/*.whl; do
  [ -e "$wheel" ] || break
  name=$(basename "$wheel"); name=${name%%-*}
  if ! python3 -c "import $name" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" \
      || echo "gpu_check: could not install $wheel" >&2
  fi
done
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
python3 -c "import msgspec" 2>/dev/null || echo "gpu_check: msgspec is missing: every TraceML row will fail (carry it in .gpu-wheels/)" >&2

# 8 minutes for the whole check; the script keeps its own budget inside this and rewrites the
# table after each group, so even a run cut short leaves what it measured.
timeout -k 10 480 python3 scripts/gpu_check.py "$@"
