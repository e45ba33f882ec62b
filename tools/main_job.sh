#!/usr/bin/env bash
# The main job: train and evaluate Mask R-CNN + LaplacianFormer-T on the bundled
# toy COCO-format data set, on CPU, from scratch (no pretrained weights).
#
#   1. tools/make_toy_coco.py           -> data/toy_coco (deterministic, seconds)
#   2. tools/train.py (toy config)      -> $WORK_DIR/epoch_*.pth, progress every 10 iters
#   3. tools/test.py (mmdet CocoMetric) -> APb/APm table, $WORK_DIR/metrics.json
#   4. tools/visualize_predictions.py   -> $WORK_DIR/vis/*.png
#
# Environment: PYTHON (default: python on PATH), WORK_DIR (default
# work_dirs/main_job), SEED (default 0), LAPFORMER_NUM_THREADS (torch CPU threads,
# default 1: one thread is immune to OpenMP over-subscription on a busy machine
# and keeps the result independent of the core count).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-work_dirs/main_job}
SEED=${SEED:-0}
CONFIG=configs/toy/maskrcnn_lapformer_t_toy.py
THREADS=${LAPFORMER_NUM_THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

stamp() { echo "[main_job $(date +%H:%M:%S), $(( $(date +%s) - START ))s] $*"; }

stamp "1/4 writing the toy data set to data/toy_coco"
"$PYTHON" tools/make_toy_coco.py --out data/toy_coco

stamp "2/4 training $CONFIG (seed $SEED, $THREADS thread(s)) into $WORK_DIR"
rm -rf "$WORK_DIR"
# val_begin past the last epoch: the evaluation is step 3's, not a second one here.
"$PYTHON" tools/train.py "$CONFIG" --work-dir "$WORK_DIR" \
    --cfg-options randomness.seed="$SEED" train_cfg.val_begin=1000000
CKPT=$(ls "$WORK_DIR"/epoch_*.pth | sort -V | tail -n 1)

stamp "3/4 evaluating $CKPT with mmdet's CocoMetric on the val split"
"$PYTHON" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK_DIR" \
    --metrics-json "$WORK_DIR/metrics.json" \
    --cfg-options test_evaluator.outfile_prefix="$WORK_DIR/results" \
    > "$WORK_DIR/test.log" 2>&1 || { cat "$WORK_DIR/test.log"; exit 1; }

stamp "4/4 drawing predictions"
"$PYTHON" tools/visualize_predictions.py "$CONFIG" "$CKPT" \
    --out-dir "$WORK_DIR/vis" --num 6 --score-thr 0.3

echo
echo "Mask R-CNN + LaplacianFormer-T, toy shapes val split (COCO metrics, fractions):"
grep -A 3 '^| | AP' "$WORK_DIR/test.log"
echo
echo "checkpoint:  $CKPT"
echo "metrics:     $WORK_DIR/metrics.json (detections: $WORK_DIR/results.{bbox,segm}.json)"
echo "predictions: $WORK_DIR/vis/*.png"
stamp "done in $(( $(date +%s) - START ))s"
