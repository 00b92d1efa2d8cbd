#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent CUDA machine (run from the repo root):
#   1. the cuda-marked tests (synccheck arms torch.cuda.set_sync_debug_mode there);
#   2. the sync-budget test and the allocator tests on a CUDA device;
#   3. both benchmarks on CUDA;
#   4. three canary scenarios with the engine on CUDA.
# Everything it prints also goes to $OUT (when set) so the results come back.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1

python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda)"
pip install -q -e '.[dev]' 2>&1 | tail -1   # keeps the machine's CUDA torch: no torch pin here

status=0
run() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
run python -m pytest -q -p no:cacheprovider -m cuda -rs
run timeout 300 python scripts/bench_alloc.py --device cuda --iters 200
run timeout 300 python scripts/bench_engine.py --starts 1 --reps 3
run timeout 300 canary run --device cuda --report-dir "$out/reports" \
    configs/scenarios/clean-page1-radix.yaml configs/scenarios/strip-mapping-page1.yaml \
    configs/scenarios/flip-kv-swa-in-use.yaml
exit $status
