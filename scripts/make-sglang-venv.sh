#!/usr/bin/env bash
# Build (or refresh) a CPU-only virtual environment with an SGLang candidate importable.
#
#     bash scripts/make-sglang-venv.sh [--server] [--version X | --source WHEEL_OR_TREE] [--relock] [VENV]
#
# --server: a venv that runs SGLang's own server too (`python -m sglang.launch_server`, the
# suite's sglang-server runtime): the import check adds the server's start-up modules with SGLang's
# CPU engine on, the locks live in configs/sglang/server/, and the default venv names gain
# "-server" (.venv-sglang-server, .venv-sglang-server-X, ...).
#
# Without --version: SGLang 0.5.23 into VENV, default .venv-sglang in the repo root (what CI
# builds). With --version X: any release on the package index, into .venv-sglang-X by default.
# With --source: a wheel file (.venv-sglang-wheel-<sha256[:12]>) or a source checkout, its repo
# root or its python/ directory, linked in place (.venv-sglang-tree-<sha256(path)[:12]>).
#
# What it installs, in this order:
#   1. torch==2.13.0, the local CPU build, with its own dependencies pinned. It goes first, and
#      the script stops before downloading anything if pip would pick any build but `+cpu`, so
#      no unpinned or CUDA torch ever lands here.
#   2. torchvision's CUDA-library stand-ins (below): sglang.srt.configs imports
#      torchvision.transforms unconditionally (configs/nano_nemotron_vl.py ->
#      multimodal/internvl_utils.py). PyPI has only CUDA builds of torchvision, whose _C.so lists
#      libc10_cuda.so and libtorch_cuda.so as needed libraries; a CPU torch has neither, and
#      `import torchvision` dies with "operator torchvision::nms does not exist". The script
#      compiles two tiny stand-ins for those libraries (the 16 CUDA symbols _C.so references;
#      each aborts if ever called, which cannot happen without a CUDA tensor) and a .pth hook
#      that preloads them, with torchvision's bundled libcudart, the first time `torchvision` is
#      imported. torchvision itself stays the real package, CPU kernels included. Needs gcc.
#   3. sglang with --no-deps (its metadata asks for flashinfer, CUDA kernels, ...), then its
#      import closure, found by canaries/sglang/releases/closure.py (no hand-written pins): with a lock
#      for this candidate (configs/sglang/X.lock for a release, kept in the repo for the
#      releases CI runs; the venv's own sglang-closure.lock for a wheel or tree) it installs the
#      lock --no-deps and checks it imports; without one it resolves the closure from the
#      release's own requirements, the nearest release's lock as a first guess, and the import
#      check's failures, then writes the lock (configs/sglang/X.lock for a release). --relock
#      resolves even where a lock exists and rewrites it. Every pip call is constrained to
#      torch==2.13.0. `pip check` therefore lists unmet requirements of sglang itself (the GPU
#      stack) and of packages whose unused parts are never imported. A venv that holds another
#      release is refused: its closure would mix with this one's.
#
# A venv that does not exist yet starts as a copy of the nearest release's venv in the repo root,
# its site-packages hard-linked (canaries/sglang/releases/clone.py; SGLANG_VENV_NO_CLONE=1 builds from
# nothing): torch is never installed again, step 3 installs only what differs from the base and
# removes what the candidate's lock does not name. Nothing is written to the base venv.
#
# Idempotent: what is installed already is left alone, the stand-ins are rebuilt only when their
# source changes. The import check (canaries/sglang/releases/import_check.py) covers the allocator
# modules, the memory pool, the invariants, the radix caches the release ships, and the engine's
# own modules and HTTP stack; the script prints what it resolved and how long it took.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_VERSION=0.5.23
PYTHON_BIN="${PYTHON:-python3}"

usage() { sed -n '4p' "${BASH_SOURCE[0]}" | sed 's/^# *//' >&2; }
VERSION=""
SOURCE=""
RELOCK=()
PROFILE=(--profile memory)
KIND=""
VENV=""
while (($#)); do
    case "$1" in
        --version) VERSION="${2:?--version needs a release, e.g. 0.5.18}"; shift 2 ;;
        --version=*) VERSION="${1#--version=}"; shift ;;
        --source) SOURCE="${2:?--source needs a wheel file or a source directory}"; shift 2 ;;
        --source=*) SOURCE="${1#--source=}"; shift ;;
        --relock) RELOCK=(--relock); shift ;;
        --server) PROFILE=(--profile server); KIND="-server"; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) echo "make-sglang-venv: unknown option $1" >&2; usage; exit 2 ;;
        *)
            [[ -z "$VENV" ]] || { echo "make-sglang-venv: one VENV only" >&2; usage; exit 2; }
            VENV="$1"; shift ;;
    esac
done
if [[ -n "$VERSION" && -n "$SOURCE" ]]; then
    echo "make-sglang-venv: --version or --source, not both" >&2; exit 2
fi
if [[ -n "$SOURCE" ]]; then
    [[ -e "$SOURCE" ]] || { echo "make-sglang-venv: --source $SOURCE: no such file or directory" >&2; exit 2; }
    SOURCE="$(cd "$(dirname "$SOURCE")" && pwd)/$(basename "$SOURCE")"
    if [[ -f "$SOURCE" ]]; then
        VENV="${VENV:-$REPO_ROOT/.venv-sglang$KIND-wheel-$(sha256sum "$SOURCE" | cut -c1-12)}"
    else
        # A checkout's root or its python/ directory: the venv is named after the one holding sglang/.
        [[ -d "$SOURCE/python/sglang" ]] && SOURCE="$SOURCE/python"
        VENV="${VENV:-$REPO_ROOT/.venv-sglang$KIND-tree-$(printf '%s' "$SOURCE" | sha256sum | cut -c1-12)}"
    fi
    CANDIDATE=(--source "$SOURCE")
elif [[ -z "$VERSION" ]]; then
    VERSION="$DEFAULT_VERSION"
    VENV="${VENV:-$REPO_ROOT/.venv-sglang$KIND}"
    CANDIDATE=(--version "$VERSION")
else
    VENV="${VENV:-$REPO_ROOT/.venv-sglang$KIND-$VERSION}"
    CANDIDATE=(--version "$VERSION")
fi

TORCH_PIN=(
    torch==2.13.0
    filelock==4.3.1 typing-extensions==4.16.0 setuptools==84.2.1 sympy==1.14.0 mpmath==1.3.0
    networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0
)
log() { printf 'make-sglang-venv: %s\n' "$*" >&2; }

SCRIPT_STARTED=$SECONDS
if [[ ! -x "$VENV/bin/python" && ! -e "$VENV" && -z "${SGLANG_VENV_NO_CLONE:-}" ]]; then
    # A new venv starts as a hard-linked copy of the nearest release's (canaries/sglang/releases/clone.py):
    # torch and the closure releases share are never installed again; step 3 installs only what
    # differs and removes what the candidate's lock does not name.
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON_BIN" -m canaries.sglang.releases.clone \
        "${CANDIDATE[@]}" ${KIND:+--server} --root "$REPO_ROOT" "$VENV" >/dev/null
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON_BIN" --version 2>&1)"
    "$PYTHON_BIN" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --quiet --disable-pip-version-check)
installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || true)"
if [[ -n "$VERSION" && -n "$installed" && "$installed" != "$VERSION" ]]; then
    log "$VENV holds sglang $installed, not $VERSION; refusing to mix their closures (pick another VENV)"
    exit 1
fi

# Every pip call carries this constraint: nothing may move torch off 2.13.0.
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

# ---- 2. the CUDA-library stand-ins that let PyPI's torchvision load over a CPU torch ----------
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
    printf '%s\n' "$STUB_SRC" >"$SHIM_DIR/cuda_stub.c.tmp"
    mv -f "$SHIM_DIR/cuda_stub.c.tmp" "$SHIM_DIR/cuda_stub.c"
    gcc -shared -fPIC -O2 -Wl,-soname,libc10_cuda.so -o "$SHIM_DIR/libc10_cuda.so.tmp" "$SHIM_DIR/cuda_stub.c"
    printf '/* empty: every symbol _C.so needs is in libc10_cuda.so */\n' >"$SHIM_DIR/empty.c.tmp"
    mv -f "$SHIM_DIR/empty.c.tmp" "$SHIM_DIR/empty.c"
    gcc -shared -fPIC -Wl,-soname,libtorch_cuda.so -o "$SHIM_DIR/libtorch_cuda.so.tmp" "$SHIM_DIR/empty.c"
    mv -f "$SHIM_DIR/libc10_cuda.so.tmp" "$SHIM_DIR/libc10_cuda.so"
    mv -f "$SHIM_DIR/libtorch_cuda.so.tmp" "$SHIM_DIR/libtorch_cuda.so"
fi
# Written to a new file and renamed into place, never through an existing one: in a cloned venv
# (canaries/sglang/releases/clone.py) a file may be a hard link into its base.
cat >"$SHIM_DIR/__init__.py.tmp" <<'EOF'
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
mv -f "$SHIM_DIR/__init__.py.tmp" "$SHIM_DIR/__init__.py"
echo "import _sglang_cpu_shim; _sglang_cpu_shim.install()" >"$SITE/_sglang_cpu_shim.pth.tmp"
mv -f "$SITE/_sglang_cpu_shim.pth.tmp" "$SITE/_sglang_cpu_shim.pth"

# ---- 3. sglang and its import closure (canaries/sglang/releases/closure.py) ---------------------------
started=$SECONDS
PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m canaries.sglang.releases.closure \
    "${CANDIDATE[@]}" --lock-dir "$REPO_ROOT/configs/sglang" "${RELOCK[@]}" "${PROFILE[@]}"
log "$VENV ready in $((SECONDS - SCRIPT_STARTED))s ($((SECONDS - started))s for sglang and its closure)"
