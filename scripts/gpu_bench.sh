#!/usr/bin/env bash
# One device call for scripts/gpu_bench.py (see docs/perf-notes.md). The GPU image does not install the package,
# and PYTHONPATH=. alone cannot see `dflash_zoo.adapters` (a setuptools package-dir mapping of adapters/),
# so a symlink stands in for the mapping on the device copy of the tree.
set -o pipefail
cd "$(dirname "$0")/.."
[ -e dflash_zoo/adapters ] || ln -sfn ../adapters dflash_zoo/adapters
export OUT="${OUT:-/tmp/gpu_bench}"
mkdir -p "$OUT"
PYTHONPATH=. PYTHONUNBUFFERED=1 GPU_BENCH_BUDGET="${GPU_BENCH_BUDGET:-500}" \
  timeout 580 python3 scripts/gpu_bench.py 2>&1 | tee "$OUT/log.txt"
