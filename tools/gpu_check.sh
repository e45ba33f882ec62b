#!/usr/bin/env bash
# GPU check of the CUDA ops and the backbone (one GPU, under 5 minutes: the step limits
# below add up to 300 s).
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh          # every step
#   STEPS="tests bench_ops" OUT=... bash tools/gpu_check.sh   # a subset
#
# Steps, each with a time limit; results in $OUT (8 files):
#   env          env.txt            GPU, driver, torch / CuPy / timm versions
#   tests        gpu_tests.txt      pytest -m gpu: tests/test_cuda_ops.py, the fused attention
#                                   (tests/test_cuda_attention_gpu.py: values, CUDA graphs,
#                                   torch.compile) and the attention-level CuPy-vs-reference
#                                   property tests; a skipped test fails the step
#   sanitizer    sanitizer.txt      compute-sanitizer memcheck and racecheck of
#                                   benchmarks/cuda_sanitize_cases.py (every kernel instantiation)
#   bench_ops    bench_ops.md       kernel, solver and attention benchmark; PASS/FAIL per target
#   backbones    backbones_h200.json, backbones.md
#                                   LaplacianFormer-T (CuPy) vs timm PVTv2-b1 and Swin-T at
#                                   800x1333, batch 2: fwd and fwd+bwd, fp32/bf16/fp16 autocast,
#                                   eager and CUDA-graph replay, kernels per call, peak memory;
#                                   the 0.8x target's verdict (copy the JSON to
#                                   docs/cuda_results/backbones_h200.json)
#   numerics     numerics_stages.md per-stage error vs fp64 of LaplacianFormer-T (fused path) and
#                                   PVTv2-b1, fp32/bf16/fp16, 448x640 (docs/numerics.md)
#   summary.txt  PASS/FAIL per step
# Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x), numpy, pytest, hypothesis;
# the backbone and numerics steps also timm and mmengine (no other OpenMMLab package).
# Exit status: 0 only when every step ran and passed (every row ran; the backbone target's
# verdict is reported, not enforced).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env tests sanitizer bench_ops backbones numerics}"
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
        timeout 15 "$PY" - <<'EOF'
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
import lapformer_mm.ops.nystrom
print('lapformer_mm.ops.cupy_ops and the fused op import')
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
    run_step tests 60 "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/test_cuda_ops.py tests/test_cuda_attention_gpu.py tests/test_reliability_properties.py
    if grep -qE "[0-9]+ skipped" "$OUT/gpu_tests.txt"; then
        record "tests: no skips" 1 0 "(a GPU test was skipped)"
    fi
fi

if wanted sanitizer; then
    for tool in memcheck racecheck; do
        echo "=== compute-sanitizer --tool $tool ===" >> "$OUT/sanitizer.txt"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_step "sanitizer $tool" 40 "$OUT/sanitizer.txt" \
            compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" benchmarks/cuda_sanitize_cases.py
    done
fi

if wanted bench_ops; then
    run_step bench_ops 40 "$OUT/bench_ops.log" "$PY" benchmarks/cuda_ops.py --out "$OUT" \
        --n 66600 --m 49 64 --bh 4 64 --budget-s 25 --min-time-s 0.05
    rm -f "$OUT/bench_ops.log" "$OUT/bench_ops.json"
fi

if wanted backbones; then
    run_step backbones 85 "$OUT/backbones.md" "$PY" benchmarks/backbones_gpu.py \
        --json "$OUT/backbones_h200.json" --size 800x1333 --batch 2 --repeats 5
fi

if wanted numerics; then
    run_step numerics 20 "$OUT/numerics_stages.md" "$PY" benchmarks/numerics_stages.py \
        --device cuda --size 448x640 --baseline timm
fi

echo "gpu_check: $( [ "$status" -eq 0 ] && echo PASS || echo FAIL ) (steps: $STEPS)" | tee -a "$SUMMARY"
exit "$status"
