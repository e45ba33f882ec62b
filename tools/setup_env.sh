#!/usr/bin/env bash
# Create (or bring up to date) the project's virtual environment with the pinned OpenMMLab
# stack. Idempotent: when nothing it depends on changed and the stack imports, it returns in
# seconds. Used by the README commands (`make main`, `make seg`, `make pretrain`, `make test`).
#
# Environment:
#   LAPFORMER_VENV        where the venv lives (default: <repo>/.venv)
#   PYTHON                interpreter that creates it (default: python3; 3.11-3.12)
#   LAPFORMER_WHEEL_CACHE folder of prebuilt mmcv wheels, one subfolder per torch release
#                         (torch-2.14.1/), tried before building mmcv from source
#                         (default: <repo>/../shared/wheels when it exists)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${LAPFORMER_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=$ROOT/requirements/ci-constraints.txt
WHEEL_CACHE=${LAPFORMER_WHEEL_CACHE:-$ROOT/../shared/wheels}
STAMP=$VENV/.lapformer-setup
# The torch release the installed mmcv was built against: its compiled ops may still import
# beside another torch (an upgraded venv), with an ABI they were not built for.
MMCV_STAMP=$VENV/.lapformer-mmcv-torch
PY=$VENV/bin/python
MMCV_VERSION=2.1.0
STACK_MODULES='mmcv.ops, mmdet, mmseg, mmpretrain.models, torchvision, pycocotools, pytest, xdist, onnx, onnxscript, onnxruntime, openvino, lapformer_mm'

# Seconds since the start on every line: the CI log then shows what each step cost.
log() { echo "[setup +${SECONDS}s] $*"; }

# The C++ sources count: the editable install builds the CPU kernels from them in place.
inputs_hash() {
    cat "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/requirements.txt" "$ROOT"/requirements/*.txt \
        "$ROOT/tools/setup_env.sh" "$ROOT"/ops/*/* | sha256sum | cut -d' ' -f1
}

stack_imports() { "$PY" -c "import $STACK_MODULES" >/dev/null 2>&1; }

# --no-compile: pip would byte-compile each package on one core as it installs it;
# byte_compile_site does them all once the stack is in, on every core.
pip_install() { "$PY" -m pip install --disable-pip-version-check --no-compile -q -c "$CONSTRAINTS" "$@"; }

# Where PYTHONDONTWRITEBYTECODE is set (our CI machines) Python never caches what it
# compiles: every process would compile mmdet, mmseg and torch again (importing both
# took 19-25 s here without the cache, 8-10 s with it). Under Python 3.11 a few test
# files of the stack (torch's Python 3.12 syntax tests) do not compile; they are not
# importable here either, and stay source.
byte_compile_site() {
    local site
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$PY" -m compileall -q -j 0 "$site" >/dev/null ||
        log "a few modules of $site do not compile for this Python; left as source"
}

# torch 2.14's headers need C++20; mmcv 2.1.0's setup.py hard-codes -std=c++17 (for the CPU
# ops, and for nvcc and MPS builds), so its source build fails until the flag is raised.
raise_cxx_standard() {
    local setup_py=$1
    grep -q -- '-std=c++17' "$setup_py" || { log "no -std=c++17 to raise in $setup_py"; return 1; }
    sed -i 's/-std=c++17/-std=c++20/g' "$setup_py"
    ! grep -q -- '-std=c++17' "$setup_py"
}

build_mmcv_from_source() {
    local src
    src=$(mktemp -d)
    # pip's isolated build environment would bring setuptools>=82, which lacks the
    # pkg_resources that mmcv's setup.py imports: prepare the sdist with the venv's own.
    "$PY" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
        --no-build-isolation -d "$src" "mmcv==$MMCV_VERSION"
    tar xzf "$src/mmcv-$MMCV_VERSION.tar.gz" -C "$src"
    raise_cxx_standard "$src/mmcv-$MMCV_VERSION/setup.py"
    MMCV_WITH_OPS=1 MAX_JOBS=$(nproc) \
        pip_install --no-build-isolation --no-deps --force-reinstall "$src/mmcv-$MMCV_VERSION"
    rm -rf "$src"
}

# True when the installed mmcv was built against torch release $1 and its ops import.
mmcv_built_for() {
    [[ -f $MMCV_STAMP && "$(cat "$MMCV_STAMP")" == "$1" ]] &&
        "$PY" -c 'import mmcv.ops' >/dev/null 2>&1
}

install_mmcv() {
    local torch_release cache
    torch_release=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
    # A cached wheel is valid only beside exactly the torch it was built against.
    cache=$WHEEL_CACHE/torch-$torch_release
    if [[ -d $cache ]] && pip_install --no-build-isolation --no-deps --force-reinstall \
            --no-index --find-links "$cache" "mmcv==$MMCV_VERSION"; then
        log "installed mmcv $MMCV_VERSION from the wheel cache $cache"
    else
        log "building mmcv $MMCV_VERSION with ops from source with C++20" \
            "(about 17 minutes on 2 cores)"
        build_mmcv_from_source
    fi
}

if [[ ${BASH_SOURCE[0]} != "$0" ]]; then
    return 0  # sourced (by a test): the functions only
fi

# A checkout whose built kernels were removed (git clean) installs again to rebuild them.
if [[ -f $STAMP && "$(cat "$STAMP")" == "$(inputs_hash)" ]] && stack_imports \
        && compgen -G "$ROOT/lapformer_mm/_cpu_*.so" >/dev/null; then
    log "environment at $VENV is up to date"
    exit 0
fi

if [[ ! -x $PY ]]; then
    log "creating virtual environment at $VENV"
    "$PYTHON" -m venv "$VENV"
fi

log "installing build tools, torch and torchvision"
pip_install 'setuptools>=77,<82' wheel
pip_install torch torchvision numpy

# mmcv goes in without its dependencies (the next step brings them); that its ops import is
# checked once everything is in.
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
if mmcv_built_for "$torch_version"; then
    log "mmcv with compiled ops already installed for torch $torch_version"
else
    install_mmcv
    echo "$torch_version" >"$MMCV_STAMP"
fi

log "installing the OpenMMLab stack, test tools and lapformer_mm"
# lapformer_mm's CPU kernels need only torch: they compile (on every core) while the other
# pip installs the rest, which is mostly unpacking on one core.
pip_install --no-build-isolation --no-deps -e "$ROOT" &
own=$!
pip_install -r "$ROOT/requirements.txt" -r "$ROOT/requirements/tests.txt" \
    || { kill "$own" 2>/dev/null; wait "$own" || true; exit 1; }
# The kernel build usually ends last (its longest compile alone on one core at the end):
# the byte-compiling fills the other core meanwhile.
log "the stack is installed; byte-compiling it beside lapformer_mm's CPU kernels"
byte_compile_site
log "byte-compiled; waiting for lapformer_mm"
wait "$own" || { log "installing lapformer_mm failed"; exit 1; }
log "lapformer_mm installed"

if ! stack_imports; then
    "$PY" -c 'import mmcv.ops' || { log "mmcv installed without its compiled ops"; exit 1; }
    log "the installed stack does not import"; "$PY" -c "import $STACK_MODULES"; exit 1
fi
inputs_hash >"$STAMP"
log "environment ready at $VENV"
