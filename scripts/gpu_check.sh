#!/usr/bin/env bash
# The CUDA checks, for a GPU machine: the marked tests, the overhead benchmark, a demo card.
# Runs from the repository root with the machine's own python3 and torch (no install there:
# nothing can be fetched). msgspec, if missing, comes from wheels carried in .gpu-wheels/:
#   pip download --only-binary=:all: --python-version 3.12 -d .gpu-wheels msgspec
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import msgspec" 2>/dev/null || \
  python3 -m pip install -q --no-index --find-links .gpu-wheels msgspec || exit 1
python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
echo "== CUDA tests"
timeout 420 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
status=$?
echo "== demo card on the GPU"
timeout 60 python3 -m traceml run --run-dir "${OUT:-/tmp}/gpu-demo" tests/scripts/train_loop.py \
  --device cuda --steps 200 --no-loader --batch-size 512 --features 1024 --width 4096 | tail -30
echo "== overhead (CPU side of the probe on this machine)"
timeout 120 python3 benchmarks/overhead.py --steps 2000 --rounds 2
exit $status
