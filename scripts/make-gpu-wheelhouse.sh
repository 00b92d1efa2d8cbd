#!/usr/bin/env bash
# The wheels a lent H200 lacks (its image has torch, numpy, requests, PyYAML, rich, pytest, but no
# HTTP stack): cp312 manylinux wheels into .whl/ (git-ignored through .git/info/exclude), for
# `carry: [".whl"]` and scripts/gpu-check.sh's `pip install --no-index`. Run it here, once.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PINS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 opentelemetry-api==1.45.2)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "${PINS[@]}"
ls -1 .whl
