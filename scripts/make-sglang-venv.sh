#!/usr/bin/env bash
# Build (or refresh) a CPU-only virtual environment with SGLang's own KV allocator importable.
#
#     bash scripts/make-sglang-venv.sh [--version X] [VENV]
#
# Without --version: SGLang 0.5.23 into VENV, default .venv-sglang in the repo root (what CI
# builds). With --version X: release X into VENV, default .venv-sglang-X in the repo root. Each
# release's pinned import closure is configs/sglang/X.pins (one requirement a line, a comment
# naming the module that first needs it); a release without a pins file is refused.
#
# What it installs, all pinned, in this order:
#   1. torch==2.13.0, the local CPU build, with its own dependencies pinned. It goes first, and
#      the script stops before downloading anything if pip would pick any build but `+cpu`, so
#      no unpinned or CUDA torch ever lands here.
#   2. sglang==X with --no-deps (its metadata asks for flashinfer, CUDA kernels, ..., and
#      0.5.23's for torch==2.14.1), then, also --no-deps, exactly the packages that the import check below reaches
#      (found by trial: import, read the ModuleNotFoundError, add). `pip check` therefore lists
#      unmet requirements of sglang itself (the GPU stack) and of a few packages whose unused
#      parts are never imported. A venv that holds another sglang release is refused: its
#      closure would mix with this one's.
#   3. torchvision==0.28.0 (the release paired with torch 2.13), in every release's pins:
#      sglang.srt.configs imports torchvision.transforms unconditionally (configs/
#      nano_nemotron_vl.py -> multimodal/internvl_utils.py). PyPI has only CUDA builds of
#      torchvision, whose _C.so lists libc10_cuda.so and libtorch_cuda.so as needed libraries;
#      a CPU torch has neither, _C.so fails to load, and `import torchvision` dies with
#      "operator torchvision::nms does not exist". The script compiles two tiny stand-ins for
#      those two libraries (the 16 CUDA symbols _C.so references; each aborts if ever called,
#      which cannot happen without a CUDA tensor) and a .pth hook that preloads them, with
#      torchvision's bundled libcudart, the first time `torchvision` is imported. torchvision
#      itself stays the real package, CPU kernels included (torchvision.ops.nms runs).
#      Needs gcc (on every machine of this kind).
#
# Idempotent: pinned packages already present are left alone, the stand-ins are rebuilt only
# when their source changes. It ends by running the import check (and prints its time): the
# allocator modules, the memory pool, the invariants, and the radix caches the release ships
# (swa_radix_cache up to 0.5.20, unified_radix_cache with what it needs), plus the engine's
# HTTP stack.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_VERSION=0.5.23
PYTHON_BIN="${PYTHON:-python3}"

usage() { sed -n '4p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; }
VERSION=""
VENV=""
while (($#)); do
    case "$1" in
        --version) VERSION="${2:?--version needs a release, e.g. 0.5.18}"; shift 2 ;;
        --version=*) VERSION="${1#--version=}"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "make-sglang-venv: unknown option $1" >&2; usage; exit 2 ;;
        *)
            [[ -z "$VENV" ]] || { echo "make-sglang-venv: one VENV only" >&2; usage; exit 2; }
            VENV="$1"; shift ;;
    esac
done
if [[ -z "$VERSION" ]]; then
    VERSION="$DEFAULT_VERSION"
    VENV="${VENV:-$REPO_ROOT/.venv-sglang}"
else
    VENV="${VENV:-$REPO_ROOT/.venv-sglang-$VERSION}"
fi

TORCH_PIN=(
    torch==2.13.0
    filelock==4.3.1 typing-extensions==4.16.0 setuptools==84.2.1 sympy==1.14.0 mpmath==1.3.0
    networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0
)
# The import closure of the release, each pin with the module that first needs it.
PINS_FILE="$REPO_ROOT/configs/sglang/$VERSION.pins"
if [[ ! -f "$PINS_FILE" ]]; then
    echo "make-sglang-venv: no pins for sglang $VERSION ($PINS_FILE); releases with pins:" \
        "$(cd "$REPO_ROOT/configs/sglang" && ls -- *.pins | sed 's/\.pins$//' | tr '\n' ' ')" >&2
    exit 2
fi
mapfile -t SGLANG_PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$PINS_FILE")
if ! printf '%s\n' "${SGLANG_PINS[@]}" | grep -qxF "sglang==$VERSION"; then
    echo "make-sglang-venv: $PINS_FILE does not pin sglang==$VERSION" >&2
    exit 2
fi
# What engine_stub itself needs to serve from this venv (--engine-python): its HTTP stack.
ENGINE_PINS=(fastapi==0.165.0 uvicorn==0.54.0 click==8.5.1 annotated-doc==0.0.7 opentelemetry-api==1.45.2)

log() { printf 'make-sglang-venv: %s\n' "$*" >&2; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON_BIN" --version 2>&1)"
    "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --quiet --disable-pip-version-check)
installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)"
if [[ -n "$installed" && "$installed" != "$VERSION" ]]; then
    log "$VENV holds sglang $installed, not $VERSION; refusing to mix their closures (pick another VENV)"
    exit 1
fi

# Every pip call below carries this constraint: nothing may move torch off 2.13.0.
CONSTRAINTS="$VENV/.sglang-venv-constraints.txt"
echo "torch==2.13.0" >"$CONSTRAINTS"

# ---- 1. torch, CPU build only ---------------------------------------------------------------
torch_version="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "$torch_version" != "2.13.0+cpu" ]]; then
    if [[ -n "$torch_version" ]]; then
        log "torch $torch_version is not the CPU build 2.13.0+cpu; refusing to touch this venv"
        exit 1
    fi
    report="$(mktemp)"
    trap 'rm -f "$report"' EXIT
    "${PIP[@]}" install --dry-run --no-deps --ignore-installed --report "$report" torch==2.13.0
    if ! grep -q '"version": "2.13.0+cpu"' "$report"; then
        log "pip would not take the CPU build of torch 2.13.0 here (no local wheel found);"
        log "refusing, so that no CUDA build is downloaded. Point pip at one (PIP_FIND_LINKS)."
        exit 1
    fi
    log "installing ${TORCH_PIN[*]}"
    "${PIP[@]}" install -c "$CONSTRAINTS" "${TORCH_PIN[@]}"
fi

# ---- 2. sglang and its import closure, no dependency resolution ------------------------------
log "installing sglang==$VERSION and its import closure (${#SGLANG_PINS[@]} pins from ${PINS_FILE#"$REPO_ROOT"/}, --no-deps)"
"${PIP[@]}" install -c "$CONSTRAINTS" --no-deps "${SGLANG_PINS[@]}"
log "installing the engine's own HTTP stack (${ENGINE_PINS[*]}, --no-deps)"
"${PIP[@]}" install -c "$CONSTRAINTS" --no-deps "${ENGINE_PINS[@]}"

# ---- 3. the CUDA-library stand-ins that let PyPI's torchvision load over a CPU torch ----------
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SHIM_DIR="$SITE/_sglang_cpu_shim"
mkdir -p "$SHIM_DIR"
STUB_SRC="$(cat <<'EOF'
/* Stand-ins for the CUDA-side torch libraries that PyPI's torchvision _C.so links against
   (libc10_cuda.so, libtorch_cuda.so). A CPU-only torch never dispatches to a CUDA kernel, so
   none of these is reached; each aborts loudly if it ever is. Written by make-sglang-venv.sh. */
#include <stdio.h>
#include <stdlib.h>
static void die(const char *name) {
    fprintf(stderr, "_sglang_cpu_shim: CUDA entry point called on a CPU-only torch: %s\n", name);
    abort();
}
#define STUB(sym) void sym(void) { die(#sym); }
STUB(_ZN2at4cuda26getCurrentDevicePropertiesEv)
STUB(_ZN3c104cuda14ExchangeDeviceEa)
STUB(_ZN3c104cuda14MaybeSetDeviceEa)
STUB(_ZN3c104cuda17getStreamFromPoolEba)
STUB(_ZN3c104cuda17getStreamFromPoolEia)
STUB(_ZN3c104cuda20getCurrentCUDAStreamEa)
STUB(_ZN3c104cuda20getDefaultCUDAStreamEa)
STUB(_ZN3c104cuda20setCurrentCUDAStreamENS0_10CUDAStreamE)
STUB(_ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb)
STUB(_ZN3c104cuda9GetDeviceEPa)
STUB(_ZN3c104cuda9SetDeviceEab)
STUB(_ZNK3c104cuda10CUDAStream11synchronizeEv)
STUB(_ZNK3c104cuda10CUDAStream5queryEv)
STUB(_ZNK3c104cuda10CUDAStream6streamEv)
/* c10::cuda::device_count(): no CUDA device. */
signed char _ZN3c104cuda12device_countEv(void) { return 0; }
/* c10::cuda::CUDACachingAllocator::allocator: no CUDA allocator. */
void *_ZN3c104cuda20CUDACachingAllocator9allocatorE = 0;
EOF
)"
if [[ ! -f "$SHIM_DIR/libc10_cuda.so" || ! -f "$SHIM_DIR/libtorch_cuda.so" ]] \
    || ! printf '%s\n' "$STUB_SRC" | cmp -s - "$SHIM_DIR/cuda_stub.c"; then
    log "building the torchvision CUDA-library stand-ins in $SHIM_DIR"
    command -v gcc >/dev/null || { log "gcc is needed to build $SHIM_DIR"; exit 1; }
    printf '%s\n' "$STUB_SRC" >"$SHIM_DIR/cuda_stub.c"
    gcc -shared -fPIC -O2 -Wl,-soname,libc10_cuda.so -o "$SHIM_DIR/libc10_cuda.so.tmp" "$SHIM_DIR/cuda_stub.c"
    printf '/* empty: every symbol _C.so needs is in libc10_cuda.so */\n' >"$SHIM_DIR/empty.c"
    gcc -shared -fPIC -Wl,-soname,libtorch_cuda.so -o "$SHIM_DIR/libtorch_cuda.so.tmp" "$SHIM_DIR/empty.c"
    mv -f "$SHIM_DIR/libc10_cuda.so.tmp" "$SHIM_DIR/libc10_cuda.so"
    mv -f "$SHIM_DIR/libtorch_cuda.so.tmp" "$SHIM_DIR/libtorch_cuda.so"
fi
cat >"$SHIM_DIR/__init__.py" <<'EOF'
"""Let PyPI's (CUDA-built) torchvision load over a CPU-only torch; see make-sglang-venv.sh.

Installed by a .pth file: a one-shot meta-path finder that, the first time `torchvision` is
imported, preloads (RTLD_GLOBAL) torchvision's bundled libcudart and the two stand-in
libraries beside this file, then steps aside so the real torchvision imports as usual.
Nothing happens, and torch is not imported, until something imports torchvision.
"""

import sys


class _PreloadForTorchvision:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision":
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass
        _preload()
        return None


def _preload():
    import ctypes
    import glob
    import importlib.util
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    libs = []
    spec = importlib.util.find_spec("torchvision")
    if spec is not None and spec.origin:
        bundled = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "torchvision.libs")
        libs += sorted(glob.glob(os.path.join(bundled, "libcudart*.so*")))
    libs += [os.path.join(here, "libc10_cuda.so"), os.path.join(here, "libtorch_cuda.so")]
    for lib in libs:
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:  # torchvision then fails as it would have without us
            print(f"_sglang_cpu_shim: could not preload {lib}: {exc}", file=sys.stderr)


def install():
    if _PreloadForTorchvision not in sys.meta_path:
        sys.meta_path.insert(0, _PreloadForTorchvision)
EOF
echo "import _sglang_cpu_shim; _sglang_cpu_shim.install()" >"$SITE/_sglang_cpu_shim.pth"

# ---- the import check ------------------------------------------------------------------------
log "import check"
SGLANG_VERSION="$VERSION" "$PY" - <<'EOF'
import importlib
import importlib.metadata as md
import importlib.util
import os
import time
import warnings

warnings.filterwarnings("ignore")
t0 = time.perf_counter()
import torch

t_torch = time.perf_counter() - t0
import sglang.srt.mem_cache.allocator.swa as swa
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.utils import invariants

# The radix caches: each must import where the release ships it (0.5.23 has no swa_radix_cache).
RADIX = {
    "sglang.srt.mem_cache.swa_radix_cache": "SWARadixCache",
    "sglang.srt.mem_cache.unified_radix_cache": "UnifiedRadixCache",
}
RADIX_NEEDS = ["sglang.srt.mem_cache.unified_cache", "sglang.srt.mem_cache.cache_init_params",
               "sglang.srt.mem_cache.base_prefix_cache", "sglang.srt.mem_cache.radix_cache"]
shipped = [name for name in RADIX if importlib.util.find_spec(name) is not None]
assert "sglang.srt.mem_cache.unified_radix_cache" in shipped, "no unified_radix_cache in this sglang"
for name in shipped:
    getattr(importlib.import_module(name), RADIX[name])
for name in RADIX_NEEDS:
    importlib.import_module(name)

import fastapi, uvicorn, yaml  # noqa: E401,F401 - the engine serves from this venv too

total = time.perf_counter() - t0
assert torch.version.cuda is None and torch.__version__ == "2.13.0+cpu", torch.__version__
assert md.version("sglang") == os.environ["SGLANG_VERSION"], md.version("sglang")

import torchvision
from torchvision.ops import nms

boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float)
assert nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist() == [0, 2]
print(
    f"sglang {md.version('sglang')} allocator import OK on torch {torch.__version__}, "
    f"torchvision {torchvision.__version__} (CPU ops work): {total:.2f} s "
    f"(import torch {t_torch:.2f} s, sglang after it {total - t_torch:.2f} s); "
    f"radix caches: {', '.join(RADIX[name] for name in shipped)}"
)
EOF
