#!/usr/bin/env bash
# GPU check of the CUDA backend and the backbone (one GPU, under 5 minutes: the step
# limits below add up to at most 300 s).
#
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh          # every step
#   STEPS="tests sanitizer" OUT=... bash tools/gpu_check.sh   # a subset
#
# Steps, each with a time limit; results in $OUT (8 files):
#   env          env.txt            GPU, driver, torch / CuPy / NVRTC, the backend's plans
#   tests        gpu_tests.txt      pytest -m gpu: tests/ops/cuda/test_attention_gpu.py (values
#                                   with launch counts, every option's gradients, each
#                                   shared-memory variant forced, grid limits, CUDA graphs,
#                                   torch.compile, the CuPy-vs-reference property tests); a
#                                   skipped test fails the step. Then a CUDA-graph capture with
#                                   no warm-up in a fresh process (appended): it must raise the
#                                   backend's CaptureError, or work
#   sanitizer    sanitizer.txt      compute-sanitizer memcheck, racecheck, synccheck, initcheck
#                                   of benchmarks/cuda_sanitize_cases.py (m = 49, 64; d_v = 32, 64)
#   kernels      kernel_times.md    per-kernel profiler times at (bh, N) = (4, 66600), (32, 1050)
#   ncu          ncu.txt            Nsight Compute shared-memory bank conflicts and load/store
#                                   counts of the backward kernels (where ncu exists)
#   backbones    backbones_h200.json, backbones.md
#                                   LaplacianFormer-T (CuPy) vs timm PVTv2-b1 and Swin-T at
#                                   800x1333, batch 2 (copy the JSON to
#                                   docs/cuda_results/backbones_h200.json)
#   summary.txt  PASS/FAIL per step
# Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x), numpy, pytest, hypothesis;
# the backbone step also timm and mmengine (no other OpenMMLab package).
# Exit status: 0 only when every step ran and passed (the backbone target's verdict is
# reported, not enforced).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env tests sanitizer kernels ncu backbones}"
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
    record env "$rc" 0
    if [ "$rc" -ne 0 ]; then
        echo "gpu_check: environment check failed (see $OUT/env.txt)" >&2
        exit 1
    fi
fi

if wanted tests; then
    # -rs lists skips: a skipped GPU test here means CUDA or CuPy was not usable.
    run_step tests 80 "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/ops/cuda/test_attention_gpu.py
    if grep -qE "[0-9]+ skipped" "$OUT/gpu_tests.txt"; then
        record "tests: no skips" 1 0 "(a GPU test was skipped)"
    fi
    echo "=== CUDA-graph capture without warm-up (fresh process) ===" >> "$OUT/gpu_tests.txt"
    start=$(date +%s)
    timeout 15 "$PY" - >> "$OUT/gpu_tests.txt" 2>&1 <<'EOF'
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
    for tool in memcheck racecheck synccheck initcheck; do
        echo "=== compute-sanitizer --tool $tool ===" >> "$OUT/sanitizer.txt"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_step "sanitizer $tool" 15 "$OUT/sanitizer.txt" \
            compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" benchmarks/cuda_sanitize_cases.py
    done
fi

if wanted kernels; then
    run_step kernels 20 "$OUT/kernels.log" "$PY" benchmarks/cuda_kernels.py \
        --out "$OUT/kernel_times.md" --repeats 20
    rm -f "$OUT/kernels.log"
fi

if wanted ncu; then
    if command -v ncu > /dev/null; then
        # The backward kernels of the profiled calls: bank conflicts of shared loads and
        # stores, and the shared / global load and store instruction counts.
        run_step ncu 25 "$OUT/ncu.txt" ncu --clock-control none -k regex:nys_backward \
            --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum \
            "$PY" benchmarks/cuda_kernels.py --repeats 1
    else
        echo "ncu not found: no counters" > "$OUT/ncu.txt"
        record ncu 0 0 "(skipped: no ncu)"
    fi
fi

if wanted backbones; then
    run_step backbones 75 "$OUT/backbones.md" "$PY" benchmarks/backbones_gpu.py \
        --json "$OUT/backbones_h200.json" --size 800x1333 --batch 2 --repeats 5
fi

echo "gpu_check: $( [ "$status" -eq 0 ] && echo PASS || echo FAIL ) (steps: $STEPS)" | tee -a "$SUMMARY"
exit "$status"
