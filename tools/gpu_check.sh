#!/usr/bin/env bash
# GPU check of the CUDA ops and the backbone (one GPU, about 4-5 minutes).
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh          # every step
#   STEPS="tests bench_ops" OUT=... bash tools/gpu_check.sh   # a subset
#
# Steps, each with a time limit; results in $OUT (8 files at most):
#   env          env.txt            GPU, driver, torch / CuPy / timm versions
#   tests        gpu_tests.txt      pytest -m gpu: tests/test_cuda_ops.py and the attention-level
#                                   CuPy-vs-reference property tests; a skipped test fails the step
#   sanitizer    sanitizer.txt      compute-sanitizer memcheck and racecheck of
#                                   benchmarks/cuda_sanitize_cases.py (every kernel instantiation)
#   bench_ops    bench_ops.md/.json kernel, solver and attention benchmark; PASS/FAIL per target
#   backbones    bench_backbones.md/.json  LaplacianFormer-T vs timm PVTv2-b1 and Swin-T, 800x1333
#   summary.txt  PASS/FAIL per step
# Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x), numpy, pytest, hypothesis;
# the backbone step also timm and mmengine (no other OpenMMLab package).
# Exit status: 0 only when every step ran and passed (every target met, no error row).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env tests sanitizer bench_ops backbones}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

record() {  # record STEP RC SECONDS [NOTE]
    local verdict=PASS
    [ "$2" -ne 0 ] && verdict="FAIL (exit $2)" && status=1
    echo "$verdict: $1 (${3}s)${4:+ $4}" | tee -a "$SUMMARY"
}

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

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
    {
        date -u
        nvidia-smi || echo "nvidia-smi not available"
        "$PY" - <<'EOF'
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
p = torch.cuda.get_device_properties(0)
print('gpu', p.name, 'cc', f'{p.major}.{p.minor}', 'sms', p.multi_processor_count,
      'smem optin', getattr(p, 'shared_memory_per_block_optin', None))
import cupy
print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())
for name in ('timm', 'hypothesis', 'mmengine'):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(name, 'missing')
import lapformer_mm.ops.cupy_ops  # must import without OpenMMLab packages
print('lapformer_mm.ops.cupy_ops imports')
EOF
    } > "$OUT/env.txt" 2>&1
    rc=$?
    cat "$OUT/env.txt"
    record env "$rc" 0
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: environment check failed (see $OUT/env.txt)" >&2
        exit 1
    fi
fi

if wanted tests; then
    # -rs lists skips: a skipped GPU test here means CUDA or CuPy was not usable.
    run_step tests 120 "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_cuda_ops.py tests/test_reliability_properties.py
    if grep -qE "[0-9]+ skipped" "$OUT/gpu_tests.txt"; then
        record "tests: no skips" 1 0 "(a GPU test was skipped)"
    fi
fi

if wanted sanitizer; then
    for tool in memcheck racecheck; do
        echo "=== compute-sanitizer --tool $tool ===" >> "$OUT/sanitizer.txt"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_step "sanitizer $tool" 90 "$OUT/sanitizer.txt" \
            compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" benchmarks/cuda_sanitize_cases.py
    done
fi

if wanted bench_ops; then
    run_step bench_ops 110 "$OUT/bench_ops.log" "$PY" benchmarks/cuda_ops.py --out "$OUT" \
        --n 3136 16384 66600 --m 49 64 --bh 4 64 --budget-s 70 --min-time-s 0.05
    rm -f "$OUT/bench_ops.log"
fi

if wanted backbones; then
    run_step backbones 100 "$OUT/bench_backbones.log" "$PY" benchmarks/backbones_gpu.py \
        --out "$OUT" --sizes 800x1333 --batch 2 --repeats 10
    rm -f "$OUT/bench_backbones.log"
fi

echo "gpu_check: $( [ "$status" -eq 0 ] && echo PASS || echo FAIL ) (steps: $STEPS)" | tee -a "$SUMMARY"
exit "$status"
