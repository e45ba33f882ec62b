#!/usr/bin/env bash
# GPU check of the CUDA backend and the backbone on one GPU (an H100 or H200): each step has a
# time limit, and the limits add up to 300 s. nvidia-smi, the module probes and the card's
# name run outside them with no limit of their own, so the whole check ends a little after
# 5 minutes unless one of those hangs.
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh                        # every step
#   STEPS="compile tests sanitizer" OUT=... bash tools/gpu_check.sh   # a subset
#
# | step      | limit       | results in $OUT       | what                                       |
# |-----------|-------------|-----------------------|--------------------------------------------|
# | env       | 10 s        | env.txt               | GPU, driver, torch / CuPy / NVRTC, the     |
# |           |             |                       | backend's plans; lapformer_mm.ops imports  |
# |           |             |                       | without OpenMMLab packages                 |
# | compile   | 45 s        | env.txt (appended)    | benchmarks/cuda_compile.py: the NVRTC      |
# |           |             |                       | compiles (10-20 s each) of every variant x |
# |           |             |                       | fp32, fp16, bf16 in parallel processes,    |
# |           |             |                       | kept in CuPy's kernel cache, from which    |
# |           |             |                       | every later step loads them (on a fresh    |
# |           |             |                       | machine the steps after it need it first)  |
# | tests     | 85 s + 10 s | gpu_tests.txt         | pytest -m gpu tests/ops/cuda/              |
# |           |             |                       | test_attention_gpu.py (values with launch  |
# |           |             |                       | counts, every option's gradients, each     |
# |           |             |                       | shared-memory variant forced, grid limits, |
# |           |             |                       | CUDA graphs, torch.compile, the property   |
# |           |             |                       | tests); a skip fails the step unless its   |
# |           |             |                       | reason is a missing mmengine (a SKIP line);|
# |           |             |                       | then a CUDA-graph capture with no warm-up  |
# |           |             |                       | in a fresh process: CaptureError, or works |
# | sanitizer | 4 x 15 s    | sanitizer.txt         | compute-sanitizer memcheck, racecheck,     |
# |           |             |                       | synccheck, initcheck of benchmarks/        |
# |           |             |                       | cuda_sanitize_cases.py, our kernels only   |
# |           |             |                       | (--kernel-name kns=nys_)                   |
# | kernels   | 15 s        | kernel_times.md       | per-kernel profiler times at (bh, N) =     |
# |           |             |                       | (4, 66600), (32, 1050)                     |
# | ncu       | 20 s        | ncu.txt               | Nsight Compute bank conflicts and load /   |
# |           |             |                       | store counts of one backward pass          |
# | backbones | 55 s        | backbones_<gpu>.json, | LaplacianFormer-T (CuPy) vs timm PVTv2-b1  |
# |           |             | backbones.md          | and Swin-T at 800x1333, batch 2; <gpu>:    |
# |           |             |                       | the card (h100-80gb-hbm3, h200)            |
#                                       summary.txt: PASS, FAIL or SKIP per step (8 files in all)
#
# Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x), numpy, pytest, hypothesis (the
# tests step's collection, tests/conftest.py included, needs no more: not cv2 or pycocotools,
# which only the toy data writer of other tests uses); the backbones step timm and mmengine, and
# three GPU tests mmengine (lapformer_mm.models imports it); no other OpenMMLab package.
# mmengine counts with the modules it imports (MMENGINE_NEEDS below): addict, termcolor, yapf,
# platformdirs (yapf's), cv2 (opencv-python or -headless), yaml (pyyaml), rich; its metadata
# also requires matplotlib, which nothing here imports. A step whose tool (compute-sanitizer,
# ncu) or package (timm, mmengine or one of its needs) is missing is a SKIP line, not a
# failure, but for one case: mmengine there without one of its needs fails the tests step
# (import lapformer_mm imports mmengine's hooks where mmengine is installed). Bring what the machine lacks as wheels (docs/cuda.md says which are pure Python;
# opencv, pyyaml, rich and matplotlib are in the CUDA images) and put them on PYTHONPATH:
#   pip install --no-index --no-deps --target /tmp/site WHEELS/*.whl
#   PYTHONPATH=/tmp/site OUT=... bash tools/gpu_check.sh
# Exit status: 0 when no step failed (the backbone target's verdict is reported, not
# enforced).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env compile tests sanitizer kernels ncu backbones}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0
skipped=()

record() {  # record STEP RC SECONDS [NOTE]
    local verdict=PASS
    [ "$2" -ne 0 ] && verdict="FAIL (exit $2)" && status=1
    echo "$verdict: $1 (${3}s)${4:+ $4}" | tee -a "$SUMMARY"
}

skip() {  # skip STEP WHY
    echo "SKIP: $1 ($2)" | tee -a "$SUMMARY"
    skipped+=("$1")
}

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

# lapformer_mm.models imports mmengine, which imports these.
MMENGINE_NEEDS="mmengine addict termcolor yapf platformdirs cv2 yaml rich"

missing_modules() {  # missing_modules MODULE...: prints those not installed (or broken)
    "$PY" - "$@" <<'EOF'
import sys

missing = []
for name in sys.argv[1:]:
    try:
        __import__(name)
    except ModuleNotFoundError as err:
        # mmengine without rich is installed; rich is the one to name
        if err.name == name:
            missing.append(name)
    except ImportError:
        missing.append(name)
print(*missing)
EOF
}

run_step() {  # run_step NAME TIMEOUT_S LOG COMMAND...
    local name=$1 limit=$2 log=$3 start rc
    shift 3
    start=$(date +%s)
    timeout "$limit" "$@" >> "$log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && echo "$name: killed after ${limit}s" >> "$log"
    record "$name" "$rc" "$(( $(date +%s) - start ))"
    tail -n 25 "$log"
}

if wanted env; then
    start=$(date +%s)
    {
        date -u
        nvidia-smi || echo "nvidia-smi not available"
        timeout 10 "$PY" - <<'EOF'
import sys

import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
p = torch.cuda.get_device_properties(0)
print('gpu', p.name, 'cc', f'{p.major}.{p.minor}', 'sms', p.multi_processor_count,
      'smem optin', getattr(p, 'shared_memory_per_block_optin', None))
import cupy
print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())


class NoOpenMMLab:  # the op and its backends must import where no OpenMMLab package is
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)


sys.meta_path.insert(0, NoOpenMMLab())
import lapformer_mm.ops  # noqa: E402,F401
from lapformer_mm.ops.backends import cuda  # noqa: E402
del sys.meta_path[0]
print('lapformer_mm.ops and its CUDA backend import without OpenMMLab packages')
limits = cuda.device_limits(torch.device('cuda'))
print('backend limits', limits)
for m, dv in ((49, 32), (64, 64)):
    print(f'plan m={m} dv={dv}:', cuda.plan(m, dv, limits.smem_optin))
for name in ('timm', 'hypothesis', 'mmengine'):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, 'missing')
EOF
    } > "$OUT/env.txt" 2>&1
    rc=$?
    cat "$OUT/env.txt"
    record env "$rc" $(( $(date +%s) - start ))
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: environment check failed (see $OUT/env.txt)" >&2
        exit 1
    fi
fi

if wanted compile; then
    echo "=== compile: benchmarks/cuda_compile.py ===" >> "$OUT/env.txt"
    run_step compile 45 "$OUT/env.txt" "$PY" benchmarks/cuda_compile.py
fi

wanted tests && missing=$(missing_modules $MMENGINE_NEEDS)
if wanted tests && [[ -n "$missing" && " $missing " != *" mmengine "* ]]; then
    # Where mmengine is there, import lapformer_mm imports the parts that use it
    # (lapformer_mm/registry.py), so without one of its needs no test is even collected.
    echo "mmengine is installed but not $missing: import lapformer_mm fails" \
        > "$OUT/gpu_tests.txt"
    record tests 1 0 "(mmengine is installed without $missing, so import lapformer_mm fails: \
bring them as well, or leave mmengine out)"
elif wanted tests; then
    # -rs lists the skips with their reasons: one means CUDA or CuPy was not usable, unless
    # the reason is a missing mmengine.
    run_step tests 85 "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/ops/cuda/test_attention_gpu.py
    skips=$(grep -E '^SKIPPED \[[0-9]+\]' "$OUT/gpu_tests.txt")
    if [ -n "$skips" ]; then
        if grep -qv mmengine <<< "$skips"; then
            record "tests: no skips" 1 0 "(a GPU test was skipped for a reason other than mmengine)"
        else
            skip "tests needing mmengine" "$(awk -F'[][]' '{n += $2} END {print n}' <<< "$skips") \
skipped: mmengine is not installed"
        fi
    fi
    echo "=== CUDA-graph capture without warm-up (fresh process) ===" >> "$OUT/gpu_tests.txt"
    start=$(date +%s)
    timeout 10 "$PY" - >> "$OUT/gpu_tests.txt" 2>&1 <<'EOF'
import torch

from lapformer_mm.ops import nystrom_attention, pool_landmarks
from lapformer_mm.ops.backends.cuda import CaptureError

q = torch.randn(2, 2, 196, 32, device='cuda')
landmarks = pool_landmarks(q, (14, 14), 7)
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        out = nystrom_attention(q, q, q.clone(), landmarks, impl='cupy')
    graph.replay()
    print('capture without warm-up: works')
except CaptureError as err:
    print('capture without warm-up: CaptureError as designed:', err)
EOF
    record "tests: capture without warm-up" $? $(( $(date +%s) - start ))
fi

if wanted sanitizer; then
    if command -v compute-sanitizer > /dev/null; then
        for tool in memcheck racecheck synccheck initcheck; do
            echo "=== compute-sanitizer --tool $tool ===" >> "$OUT/sanitizer.txt"
            # Our kernels only: instrumenting every PyTorch kernel of the cases and their
            # reference costs the time limit.
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_step "sanitizer $tool" 15 "$OUT/sanitizer.txt" \
                compute-sanitizer --tool "$tool" --kernel-name kns=nys_ --error-exitcode 3 \
                "$PY" benchmarks/cuda_sanitize_cases.py
        done
    else
        echo "compute-sanitizer not found: nothing checked" > "$OUT/sanitizer.txt"
        skip sanitizer "no compute-sanitizer"
    fi
fi

if wanted kernels; then
    run_step kernels 15 "$OUT/kernels.log" "$PY" benchmarks/cuda_kernels.py \
        --out "$OUT/kernel_times.md" --repeats 20
    rm -f "$OUT/kernels.log"
fi

if wanted ncu; then
    if command -v ncu > /dev/null; then
        # The first backward pass (one launch of each of its 5 kernels): bank conflicts of
        # shared loads and stores, and the shared / global load and store instruction counts.
        run_step ncu 20 "$OUT/ncu.txt" ncu --clock-control none -k regex:nys_backward -c 5 \
            --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum \
            "$PY" benchmarks/cuda_kernels.py --repeats 1
    else
        echo "ncu not found: no counters" > "$OUT/ncu.txt"
        skip ncu "no ncu"
    fi
fi

if wanted backbones; then
    missing=$(missing_modules timm $MMENGINE_NEEDS)
    if [ -n "$missing" ]; then
        echo "missing: $missing (timm, mmengine and its needs): not measured" \
            > "$OUT/backbones.md"
        skip backbones "needs timm and mmengine; missing: $missing"
    else
        # The result file is named by the card: NVIDIA H100 80GB HBM3 -> h100-80gb-hbm3.
        card=$("$PY" -c "import re, torch
name = torch.cuda.get_device_name().lower().replace('nvidia', '')
print(re.sub('[^a-z0-9]+', '-', name).strip('-'))")
        run_step backbones 55 "$OUT/backbones.md" "$PY" benchmarks/backbones_gpu.py \
            --json "$OUT/backbones_${card:-gpu}.json" --size 800x1333 --batch 2 --repeats 5
    fi
fi

verdict=$( [ "$status" -eq 0 ] && echo PASS || echo FAIL )
echo "gpu_check: $verdict (steps: $STEPS${skipped[*]:+; skipped: ${skipped[*]}})" \
    | tee -a "$SUMMARY"
exit "$status"
