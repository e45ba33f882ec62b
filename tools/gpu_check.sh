#!/usr/bin/env bash
# GPU check of the CUDA backend and the backbone on one GPU (an H100 or H200), for a fresh
# machine: every command runs under a time limit at least twice its estimated cold time (the
# first run on a bare machine: empty page cache, CuPy kernel cache and inductor cache), and the
# limits add up to 358 s, so the whole check ends within 6 minutes.
#
#   bash tools/gpu_check.sh fetch         # here, once: the wheels the device lacks -> gpu_wheels/
#   OUT=/tmp/gpu_check bash tools/gpu_check.sh                        # every step
#   STEPS="compile tests sanitizer" OUT=... bash tools/gpu_check.sh   # a subset
#
# On a lent GPU (the device tool): run(command='OUT=$OUT bash tools/gpu_check.sh',
# carry=['gpu_wheels'], timeout_s=420); the 8 files of $OUT come back (docs/cuda.md).
#
# | step      | cold | limit | results in $OUT      | what                                        |
# |-----------|------|-------|----------------------|---------------------------------------------|
# | wheels    |   4  |    8  | env.txt              | pip installs gpu_wheels/*.whl (mmengine and |
# |           |      |       |                      | its pure-Python needs) into a folder on     |
# |           |      |       |                      | PYTHONPATH                                  |
# | env       |  13  |   26  | env.txt              | nvidia-smi; torch and the GPU; CuPy, NVRTC  |
# |           |      |       |                      | and the CUDA headers CuPy 14 compiles with  |
# |           |      |       |                      | (a kernel compiled and loaded); the backend |
# |           |      |       |                      | imports without OpenMMLab; its plans        |
# | modules   |   5  |   10  | env.txt              | each of MODULES imported: its version,      |
# |           |      |       |                      | missing, or broken (any exception, named)   |
# | compile   |  35  |   70  | env.txt              | benchmarks/cuda_compile.py: the 12 modules  |
# |           |      |       |                      | (variant x fp32, fp16, bf16) compiled by    |
# |           |      |       |                      | NVRTC in parallel processes, then loaded    |
# |           |      |       |                      | again from CuPy's kernel cache, as every    |
# |           |      |       |                      | later step loads them                       |
# | tests     |  40  |   80  | gpu_tests.txt        | pytest -m gpu tests/ops/cuda/               |
# |           |      |       |                      | test_attention_gpu.py but torch.compile; a  |
# |           |      |       |                      | skip fails it unless mmengine is missing    |
# | capture   |   6  |   15  | gpu_tests.txt        | a CUDA-graph capture with no warm-up in a   |
# |           |      |       |                      | fresh process: CaptureError, or works       |
# | compiled  |  17  |   35  | gpu_tests.txt        | the torch.compile(mode='reduce-overhead')   |
# |           |      |       |                      | test (cold inductor)                        |
# | sanitizer |  20  |   40  | sanitizer.txt        | compute-sanitizer memcheck, racecheck,      |
# |           |      |       |                      | synccheck, initcheck at once on benchmarks/ |
# |           |      |       |                      | cuda_sanitize_cases.py: our kernels' errors |
# |           |      |       |                      | (kns=nys_), no API call's                   |
# | kernels   |   7  |   14  | kernel_times.md      | per-kernel profiler times, (bh, N) =        |
# |           |      |       |                      | (4, 66600), (32, 1050)                      |
# | ncu       |  10  |   20  | ncu.txt              | Nsight Compute bank conflicts, load / store |
# |           |      |       |                      | counts of one backward pass (a host without |
# |           |      |       |                      | counter permission: a SKIP)                 |
# | backbones |  20  |   40  | backbones_<card>.json| LaplacianFormer-T vs timm PVTv2-b1, Swin-T  |
# |           |      |       | backbones.md         | at 800x1333, batch 2, fp32 and bf16, each   |
# |           |      |       |                      | row written as measured                     |
#                           summary.txt: PASS, FAIL, SKIP per step, NOTE lines (8 files in all)
# (cold, limit: seconds. STEPS names wheels env compile tests graphs sanitizer kernels ncu
# backbones: env runs modules too, graphs runs capture and compiled. A step whose tool or
# package is missing is a SKIP line.)
#
# Needs what the lent GPU machines' image has (torch with CUDA, CuPy, numpy, pytest,
# hypothesis, timm, torchvision, opencv, pyyaml, rich, compute-sanitizer, ncu) and, from
# gpu_wheels/, mmengine and its pure-Python needs (without them the mmengine tests and the
# backbones step are SKIPs). Exit status: 0 when no step failed (the backbone target's
# verdict is reported, not enforced).
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-gpu_wheels}"
# The wheels beyond the image: mmengine and its pure-Python needs, as tested here.
WHEEL_PINS="mmengine==0.10.7 addict==2.4.0 termcolor==3.3.0 yapf==0.43.0 platformdirs==4.14.8"

if [ "${1:-}" = fetch ]; then
    # Pure-Python wheels for the device's Python 3.12 (the device tool's README's command).
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $WHEEL_PINS
fi

LIMIT_WHEELS=8 LIMIT_ENV=26 LIMIT_MODULES=10 LIMIT_COMPILE=70 LIMIT_TESTS=80
LIMIT_CAPTURE=15 LIMIT_COMPILED=35 LIMIT_SANITIZER=40 LIMIT_KERNELS=14 LIMIT_NCU=20
LIMIT_BACKBONES=40
# LIMIT_SCALE=N multiplies every limit (a slow machine; the CPU tests' stub GPU).
for limit in ${!LIMIT_@}; do
    [ "$limit" = LIMIT_SCALE ] || eval "$limit=$(( ${!limit} * ${LIMIT_SCALE:-1} ))"
done

OUT="${OUT:-gpu_check_out}"
STEPS="${STEPS:-wheels env compile tests graphs sanitizer kernels ncu backbones}"
mkdir -p "$OUT"
STATE=$(mktemp -d)  # what steps tell later ones (modules, card), outside $OUT
trap 'rm -rf "$STATE"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0
skipped=()

record() {  # record STEP RC SECONDS [NOTE]
    local verdict=PASS
    [ "$2" -ne 0 ] && verdict="FAIL (exit $2)" && status=1
    [ "$2" -eq 124 ] && verdict="FAIL (time limit)"
    echo "$verdict: $1 (${3}s)${4:+ $4}" | tee -a "$SUMMARY"
}

skip() {  # skip STEP WHY
    echo "SKIP: $1 ($2)" | tee -a "$SUMMARY"
    skipped+=("$1")
}

note() { echo "NOTE: $*" | tee -a "$SUMMARY"; }

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

run_timed() {  # run_timed LIMIT LOG COMMAND...: sets rc and took
    local limit=$1 log=$2 start
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >> "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    [ "$rc" -eq 124 ] && echo "killed after ${limit}s: $*" >> "$log"
    return 0
}

run_step() {  # run_step NAME LIMIT LOG COMMAND...
    local name=$1
    shift
    run_timed "$@"
    record "$name" "$rc" "$took"
    tail -n 25 "$2"
}

# lapformer_mm.models imports mmengine, which imports the modules after timm.
MODULES="hypothesis torchvision timm addict termcolor yapf platformdirs cv2 yaml rich mmengine"
MMENGINE_NEEDS="addict termcolor yapf platformdirs cv2 yaml rich mmengine"

probe_modules() {  # each of MODULES imported; writes $STATE/missing, $STATE/broken, $STATE/card
    echo "=== modules ===" >> "$OUT/env.txt"
    run_timed "$LIMIT_MODULES" "$OUT/env.txt" "$PY" - "$STATE" $MODULES <<'EOF'
import importlib
import re
import sys
from pathlib import Path

state, names = Path(sys.argv[1]), sys.argv[2:]
missing, broken = [], []
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            missing.append(name)
            print(f'module {name}: missing')
            continue
        broken.append(name)
        print(f'module {name}: BROKEN (needs {exc.name})')
    except Exception as exc:  # a torchvision of another torch raises RuntimeError, say
        broken.append(name)
        print(f'module {name}: BROKEN ({type(exc).__name__}: {exc})'[:400])
    else:
        print(f'module {name} {getattr(module, "__version__", "")}')
(state / 'missing').write_text(' '.join(missing) + '\n')
(state / 'broken').write_text(' '.join(broken) + '\n')
try:
    import torch
    card = torch.cuda.get_device_name().lower().replace('nvidia', '')
    card = re.sub('[^a-z0-9]+', '-', card).strip('-')  # NVIDIA H100 80GB HBM3 -> h100-80gb-hbm3
except Exception:
    card = 'gpu'
(state / 'card').write_text(card or 'gpu')
EOF
    record modules "$rc" "$took"
    [ -f "$STATE/card" ] || echo gpu > "$STATE/card"  # a probe that did not finish: no more
    local kind
    for kind in missing broken; do
        [ -n "$(cat "$STATE/$kind" 2> /dev/null)" ] && note "modules $kind: $(cat "$STATE/$kind")"
    done
    return 0
}

probed() { [ -f "$STATE/card" ] || probe_modules; }  # once, by env or by the first step asking

unusable() {  # unusable MODULE...: those of them missing or broken (after probed)
    local name out=()
    for name in "$@"; do
        [[ " $(cat "$STATE/missing" "$STATE/broken" 2> /dev/null | tr '\n' ' ') " == *" $name "* ]] \
            && out+=("$name")
    done
    echo "${out[*]:-}"
}

if wanted wheels; then
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
        echo "=== wheels: $(cd "$WHEELS" && echo *.whl) ===" >> "$OUT/env.txt"
        run_step wheels "$LIMIT_WHEELS" "$OUT/env.txt" "$PY" -m pip install -q --no-index \
            --no-deps --no-compile --no-cache-dir --target "$STATE/site" "$WHEELS"/*.whl
        export PYTHONPATH="$PYTHONPATH:$STATE/site"
    else
        skip wheels "no $WHEELS/*.whl: bash tools/gpu_check.sh fetch, and carry $WHEELS"
    fi
fi

if wanted env; then
    {
        date -u
        echo "=== env ==="
    } >> "$OUT/env.txt"
    run_timed "$LIMIT_ENV" "$OUT/env.txt" "$PY" - <<'EOF'
import subprocess
import sys

failed = []


def fail(package, exc):
    failed.append(package)
    print(f'BROKEN {package}: {type(exc).__name__}: {exc}'[:600])


try:
    print(subprocess.run(['nvidia-smi'], capture_output=True, text=True, timeout=10).stdout)
except Exception as exc:
    print('nvidia-smi not available:', type(exc).__name__, exc)
try:
    import torch
    print('torch', torch.__version__, 'cuda', torch.version.cuda)
    p = torch.cuda.get_device_properties(0)
    print('gpu', p.name, 'cc', f'{p.major}.{p.minor}', 'sms', p.multi_processor_count,
          'smem optin', getattr(p, 'shared_memory_per_block_optin', None))
except Exception as exc:
    fail('torch (no usable GPU: nothing else can run)', exc)
    sys.exit(2)
try:
    import cupy
    print('cupy', cupy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())
except Exception as exc:
    fail('cupy', exc)
else:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        print('CUDA headers (cuda.pathfinder):', find_nvidia_header_directory('cudart'))
    except Exception as exc:
        print('CUDA headers: cuda.pathfinder does not say', type(exc).__name__, exc)
    try:
        # CuPy 14 compiles every module with the CUDA headers' folder: missing, it raises here.
        probe = cupy.RawKernel('extern "C" __global__ void lap_probe(int* x) { *x = 1; }',
                               'lap_probe')
        probe.compile()
        print('CuPy compiled and loaded a kernel (NVRTC, CUDA headers, driver)')
    except Exception as exc:
        fail('cupy: compiling a kernel (CuPy 14 needs the CUDA headers: pip install '
             '"cupy-cuda13x[ctk]", or set CUDA_PATH)', exc)


class NoOpenMMLab:  # the op and its backends must import where no OpenMMLab package is
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)


try:
    sys.meta_path.insert(0, NoOpenMMLab())
    import lapformer_mm.ops  # noqa: F401
    from lapformer_mm.ops.backends import cuda
    del sys.meta_path[0]
    print('lapformer_mm.ops and its CUDA backend import without OpenMMLab packages')
    limits = cuda.device_limits(torch.device('cuda'))
    print('backend limits', limits)
    for m, dv in ((49, 32), (64, 64)):
        print(f'plan m={m} dv={dv}:', cuda.plan(m, dv, limits.smem_optin))
except Exception as exc:
    fail('lapformer_mm.ops', exc)
sys.exit(1 if failed else 0)
EOF
    record env "$rc" "$took"
    if [ "$rc" -eq 2 ] || [ "$rc" -eq 124 ]; then
        tail -n 25 "$OUT/env.txt"
        echo "gpu_check: no usable GPU (see $OUT/env.txt)" | tee -a "$SUMMARY" >&2
        exit 1
    fi
    probe_modules
fi

if wanted compile; then
    echo "=== compile: benchmarks/cuda_compile.py ===" >> "$OUT/env.txt"
    run_step compile "$LIMIT_COMPILE" "$OUT/env.txt" "$PY" benchmarks/cuda_compile.py
fi

COMPILED_TEST=tests/ops/cuda/test_attention_gpu.py::test_torch_compile_reduce_overhead_runs_the_kernels

# Where mmengine is installed, import lapformer_mm imports the parts that use it
# (lapformer_mm/registry.py): without one of its needs no test is even collected.
mmengine_broken() {
    local bad
    bad=$(unusable $MMENGINE_NEEDS)
    [[ -n "$bad" && " $(cat "$STATE/missing") " != *" mmengine "* ]] && echo "$bad"
}

if wanted tests; then
    probed
    bad=$(mmengine_broken)
    if [ -n "$bad" ]; then
        echo "mmengine is installed but not usable with: $bad; import lapformer_mm fails" \
            >> "$OUT/gpu_tests.txt"
        record tests 1 0 "(mmengine is installed but $bad is missing or broken, so import \
lapformer_mm fails: bring them as well, or leave mmengine out)"
    else
        # -rs lists the skips with their reasons: one means CUDA or CuPy was not usable,
        # unless the reason is a missing mmengine.
        run_step tests "$LIMIT_TESTS" "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs \
            -p no:cacheprovider --deselect "$COMPILED_TEST" tests/ops/cuda/test_attention_gpu.py
        skips=$(grep -E '^SKIPPED \[[0-9]+\]' "$OUT/gpu_tests.txt")
        if [ -n "$skips" ]; then
            if grep -qv mmengine <<< "$skips"; then
                record "tests: no skips" 1 0 "(a GPU test was skipped for a reason other than \
mmengine)"
            else
                skip "tests needing mmengine" "$(awk -F'[][]' '{n += $2} END {print n}' \
<<< "$skips") skipped: mmengine is not installed"
            fi
        fi
        # What the first run should look at, not a verdict: others' kernels (cuBLAS, cuDNN).
        while read -r line; do
            note "$line"
        done < <(grep -o 'kernels per LaplacianAttention forward: [0-9]* ours + [0-9]* others' \
            "$OUT/gpu_tests.txt" | sort -u)
    fi
fi

if wanted graphs; then
    echo "=== CUDA-graph capture without warm-up (fresh process) ===" >> "$OUT/gpu_tests.txt"
    run_step capture "$LIMIT_CAPTURE" "$OUT/gpu_tests.txt" "$PY" - <<'EOF'
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
    probed
    bad=$(unusable $MMENGINE_NEEDS)
    if [ -n "$bad" ]; then
        skip compiled "the torch.compile test builds the attention module: needs mmengine; \
missing or broken: $bad"
    else
        echo "=== torch.compile ===" >> "$OUT/gpu_tests.txt"
        run_step compiled "$LIMIT_COMPILED" "$OUT/gpu_tests.txt" "$PY" -m pytest -m gpu -q -rs \
            -p no:cacheprovider "$COMPILED_TEST"
    fi
fi

if wanted sanitizer; then
    if command -v compute-sanitizer > /dev/null; then
        # The four tools at once (each its own process and CUDA context), our kernels only
        # (kns=nys_: instrumenting every PyTorch kernel costs the time limit), failing API
        # calls not counted (torch, cuBLAS and CuPy make some at start-up by design).
        tools=(memcheck racecheck synccheck initcheck)
        pids=()
        start=$(date +%s)
        for tool in "${tools[@]}"; do
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$LIMIT_SANITIZER" compute-sanitizer \
                --tool "$tool" --kernel-name kns=nys_ --report-api-errors no \
                --error-exitcode 3 "$PY" benchmarks/cuda_sanitize_cases.py \
                > "$STATE/sanitizer_$tool.txt" 2>&1 &
            pids+=($!)
        done
        for i in "${!tools[@]}"; do
            wait "${pids[$i]}"
            rc=$?
            { echo "=== compute-sanitizer --tool ${tools[$i]} (exit $rc) ==="
              cat "$STATE/sanitizer_${tools[$i]}.txt"; } >> "$OUT/sanitizer.txt"
            record "sanitizer ${tools[$i]}" "$rc" "$(( $(date +%s) - start ))"
        done
    else
        echo "compute-sanitizer not found: nothing checked" > "$OUT/sanitizer.txt"
        skip sanitizer "no compute-sanitizer"
    fi
fi

if wanted kernels; then
    run_step kernels "$LIMIT_KERNELS" "$OUT/kernel_times.md" "$PY" benchmarks/cuda_kernels.py \
        --repeats 20
fi

if wanted ncu; then
    if command -v ncu > /dev/null; then
        # The first backward pass (one launch of each of its 5 kernels), torch.profiler off:
        # bank conflicts of shared loads and stores, shared / global load and store counts.
        run_timed "$LIMIT_NCU" "$OUT/ncu.txt" ncu --clock-control none -k regex:nys_backward \
            -c 5 --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed_op_global_st.sum \
            "$PY" benchmarks/cuda_kernels.py --repeats 1 --no-profiler
        if grep -q ERR_NVGPUCTRPERM "$OUT/ncu.txt"; then
            skip ncu "no permission to read the GPU's performance counters (ERR_NVGPUCTRPERM)"
        elif [ "$rc" -eq 0 ] && grep -q 'No kernels were profiled' "$OUT/ncu.txt"; then
            record ncu 1 "$took" "(no kernel named nys_backward was profiled)"
        else
            record ncu "$rc" "$took"
        fi
        tail -n 25 "$OUT/ncu.txt"
    else
        echo "ncu not found: no counters" > "$OUT/ncu.txt"
        skip ncu "no ncu"
    fi
fi

if wanted backbones; then
    probed
    bad=$(unusable timm torchvision $MMENGINE_NEEDS)
    if [ -n "$bad" ]; then
        echo "missing or broken: $bad (timm, mmengine and its needs): not measured" \
            > "$OUT/backbones.md"
        skip backbones "needs timm and mmengine; missing or broken: $bad"
    else
        run_step backbones "$LIMIT_BACKBONES" "$OUT/backbones.md" "$PY" \
            benchmarks/backbones_gpu.py --json "$OUT/backbones_$(cat "$STATE/card").json" \
            --size 800x1333 --batch 2 --repeats 5 --dtypes fp32 bf16
    fi
fi

verdict=$( [ "$status" -eq 0 ] && echo PASS || echo FAIL )
echo "gpu_check: $verdict (steps: $STEPS${skipped[*]:+; skipped: ${skipped[*]}})" \
    | tee -a "$SUMMARY"
exit "$status"
