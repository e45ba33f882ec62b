#!/usr/bin/env bash
# The segmentation job: train and evaluate UperNet + LaplacianFormer-T on the
# bundled toy shapes (semantic label maps), on CPU, from scratch.
#
#   1. tools/make_toy_coco.py --seg-out  -> data/toy_seg (mmseg layout, seconds)
#   2. tools/train.py (toy config)       -> $WORK_DIR/iter_*.pth, progress every 10 iters
#   3. tools/test.py (mmseg IoUMetric)   -> per-class IoU + mIoU, $WORK_DIR/metrics.json
#   4. tools/visualize_predictions.py    -> $WORK_DIR/vis/*.png (image | GT | prediction)
#
# Environment: PYTHON (default: python on PATH), WORK_DIR (default
# work_dirs/seg_job), SEED (default 0), CONFIG (default the LaplacianFormer-T
# toy config; configs/toy/upernet_r18_toy_baseline.py runs the baseline),
# LAPFORMER_NUM_THREADS (torch CPU threads, default 1, as in tools/main_job.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-work_dirs/seg_job}
SEED=${SEED:-0}
CONFIG=${CONFIG:-configs/toy/upernet_lapformer_t_toy.py}
THREADS=${LAPFORMER_NUM_THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

stamp() { echo "[seg_job $(date +%H:%M:%S), $(( $(date +%s) - START ))s] $*"; }

stamp "1/4 writing the toy data set to data/toy_coco and its label maps to data/toy_seg"
"$PYTHON" tools/make_toy_coco.py --out data/toy_coco --seg-out data/toy_seg

stamp "2/4 training $CONFIG (seed $SEED, $THREADS thread(s)) into $WORK_DIR"
rm -rf "$WORK_DIR"
# val_begin past the last iteration: the evaluation is step 3's, not a second one here.
"$PYTHON" tools/train.py "$CONFIG" --work-dir "$WORK_DIR" \
    --cfg-options randomness.seed="$SEED" train_cfg.val_begin=1000000
CKPT=$(ls "$WORK_DIR"/iter_*.pth | sort -V | tail -n 1)

stamp "3/4 evaluating $CKPT with mmseg's IoUMetric on the val split"
"$PYTHON" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK_DIR" \
    --metrics-json "$WORK_DIR/metrics.json" \
    > "$WORK_DIR/test.log" 2>&1 || { cat "$WORK_DIR/test.log"; exit 1; }

stamp "4/4 drawing predictions"
"$PYTHON" tools/visualize_predictions.py "$CONFIG" "$CKPT" \
    --out-dir "$WORK_DIR/vis" --num 6

echo
echo "$CONFIG, toy shapes val split (mmseg IoUMetric, percent):"
grep -A 10 'per class results:' "$WORK_DIR/test.log" | tail -n 9
grep -o 'aAcc: .*mAcc: [0-9.]*' "$WORK_DIR/test.log"
echo
echo "checkpoint:  $CKPT"
echo "metrics:     $WORK_DIR/metrics.json"
echo "predictions: $WORK_DIR/vis/*.png (image | ground truth | prediction)"
stamp "done in $(( $(date +%s) - START ))s"
