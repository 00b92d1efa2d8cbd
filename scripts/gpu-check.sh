#!/usr/bin/env bash
# The checks that need a GPU, as one short script for a lent CUDA machine (run from the repo root,
# with .whl/ carried: scripts/make-gpu-wheelhouse.sh fills it here; that machine has no network):
#   1. the cuda-marked tests (PR #36723's sync-freedom with torch.cuda.set_sync_debug_mode);
#   2. the sync-budget and allocator tests with the engine's tensors on the CUDA device;
#   3. both benchmarks on CUDA;
#   4. the default canary library with the engine on CUDA (fresh processes: no fork after CUDA),
#      its reports back as $OUT/reports.tar.gz.
# Nothing is installed from a registry: the missing HTTP stack comes from .whl with --no-index,
# the project itself runs from the checkout (PYTHONPATH), over the machine's own CUDA torch.
# Everything it prints also goes to $OUT (when set) so the results come back.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu-check}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "!! the wheelhouse did not install"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
else
    echo "!! no .whl/ carried (run scripts/make-gpu-wheelhouse.sh here, carry .whl)"; exit 1
fi
export PYTHONUNBUFFERED=1 CANARY_PROGRESS=plain
python3 -c "import torch, fastapi, uvicorn; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda)"

status=0
run() { echo "== $*"; "$@" || { echo "!! failed: $*"; status=1; }; }
run python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda.py tests/test_synccheck.py
run python3 -m pytest -q -p no:cacheprovider tests/test_sync_budget.py tests/test_swa_allocator.py
run timeout 240 python3 scripts/bench_alloc.py --device cuda --iters 200
run timeout 240 python3 scripts/bench_engine.py --starts 1 --reps 3 --chunked-reps 0
run timeout 300 python3 -m canaries.cli run --device cuda --start fresh --jobs 8 --report-dir "$out/reports"
# Every scenario's files in one archive ($OUT brings back 8 files at most).
tar -czf "$out/reports.tar.gz" -C "$out" reports && rm -rf "$out/reports"
exit $status
