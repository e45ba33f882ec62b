#!/usr/bin/env bash
# GPU check of the CUDA ops (one GPU, under 5 minutes): the GPU tests of
# tests/test_cuda_ops.py, then tools/bench_ops.py. Everything lands in $OUT:
#   env.txt         GPU, driver, torch / CuPy versions
#   gpu_tests.txt   pytest output (+ gpu_tests.xml)
#   bench_ops.md    benchmark table with the target ratios (+ .json, .txt log)
# Needs torch with CUDA, CuPy (cupy-cuda12x or cupy-cuda13x), numpy, pytest;
# no OpenMMLab package. Usage from anywhere:
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh
# Exit status: 0 when the environment works and every GPU test passed.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

{
    date -u
    nvidia-smi || echo "nvidia-smi not available"
    "$PY" - <<'EOF'
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('gpu', p.name, 'cc', f'{p.major}.{p.minor}', 'sms', p.multi_processor_count,
          'smem optin', getattr(p, 'shared_memory_per_block_optin', None))
import cupy
print('cupy', cupy.__version__)
import lapformer_mm.ops.cupy_ops  # must import without OpenMMLab packages
print('lapformer_mm.ops.cupy_ops imports')
EOF
} > "$OUT/env.txt" 2>&1 || status=1
cat "$OUT/env.txt"
if [ "$status" -ne 0 ]; then
    echo "gpu_check: environment check failed (see $OUT/env.txt)" >&2
    exit 1
fi

# -rs lists skips: a skipped GPU test here means CUDA or CuPy was not usable.
timeout 130 "$PY" -m pytest -m gpu tests/test_cuda_ops.py -q -rs -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1 || status=1
tail -n 40 "$OUT/gpu_tests.txt"
if grep -q "skipped" "$OUT/gpu_tests.txt"; then
    echo "gpu_check: GPU tests were skipped" >&2
    status=1
fi

timeout 130 "$PY" tools/bench_ops.py --out "$OUT" --budget-s 100 --min-time-s 0.1 \
    > "$OUT/bench_ops.txt" 2>&1 || { echo "gpu_check: bench_ops failed" >&2; status=1; }
if [ -f "$OUT/bench_ops.md" ]; then
    sed -n '1,25p' "$OUT/bench_ops.md"
else
    tail -n 30 "$OUT/bench_ops.txt"
fi
exit "$status"
