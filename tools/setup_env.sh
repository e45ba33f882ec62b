#!/usr/bin/env bash
# Create (or bring up to date) the project's virtual environment with the pinned OpenMMLab
# stack. Idempotent: when nothing it depends on changed and the stack imports, it returns in
# seconds. Used by the README commands (`make main`, `make seg`, `make test`).
#
# Environment:
#   LAPFORMER_VENV        where the venv lives (default: <repo>/.venv)
#   PYTHON                interpreter that creates it (default: python3; 3.9-3.12)
#   LAPFORMER_WHEEL_CACHE folder of prebuilt wheels to try before building mmcv from source
#                         (default: <repo>/../shared/wheels when it exists)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${LAPFORMER_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
CONSTRAINTS=$ROOT/requirements/ci-constraints.txt
WHEEL_CACHE=${LAPFORMER_WHEEL_CACHE:-$ROOT/../shared/wheels}
STAMP=$VENV/.lapformer-setup
PY=$VENV/bin/python

log() { echo "[setup] $*"; }

inputs_hash() {
    cat "$ROOT/setup.py" "$ROOT/requirements.txt" "$ROOT"/requirements/*.txt \
        "$ROOT/tools/setup_env.sh" | sha256sum | cut -d' ' -f1
}

stack_imports() {
    "$PY" - <<'EOF' >/dev/null 2>&1
import mmcv.ops, mmdet, mmseg, pycocotools, pytest, lapformer_mm
EOF
}

if [[ -f $STAMP && "$(cat "$STAMP")" == "$(inputs_hash)" ]] && stack_imports; then
    log "environment at $VENV is up to date"
    exit 0
fi

if [[ ! -x $PY ]]; then
    log "creating virtual environment at $VENV"
    "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$PY" -m pip install --disable-pip-version-check -q -c "$CONSTRAINTS" "$@"; }

log "installing build tools and torch"
pip_install 'setuptools>=77,<82' wheel
pip_install torch numpy

if "$PY" -c 'import mmcv.ops' >/dev/null 2>&1; then
    log "mmcv with compiled ops already installed"
else
    find_links=()
    torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
    if [[ -d $WHEEL_CACHE && $torch_version == 2.13.0+cpu ]]; then
        # The cached wheel was built against exactly this torch; any other torch needs a
        # source build.
        find_links=(--find-links "$WHEEL_CACHE")
        log "trying the mmcv wheel cache in $WHEEL_CACHE"
    else
        log "building mmcv 2.1.0 with ops from source (about 30 minutes on 2 cores)"
    fi
    MMCV_WITH_OPS=1 MAX_JOBS=$(nproc) \
        pip_install --no-build-isolation "${find_links[@]}" mmcv
    "$PY" -c 'import mmcv.ops' || { log "mmcv installed without its compiled ops"; exit 1; }
fi

log "installing the OpenMMLab stack, test tools and lapformer_mm"
pip_install -r "$ROOT/requirements.txt" -r "$ROOT/requirements/tests.txt"
pip_install --no-build-isolation --no-deps -e "$ROOT"

stack_imports || { log "the installed stack does not import"; "$PY" -c 'import mmcv.ops, mmdet, mmseg, pycocotools, lapformer_mm'; exit 1; }
inputs_hash >"$STAMP"
log "environment ready at $VENV"
