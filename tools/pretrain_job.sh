#!/usr/bin/env bash
# The pretraining chain on CPU: pretrain LaplacianFormer-T on the toy ImageNet-format
# set, convert the classifier into a backbone checkpoint, and train + evaluate the toy
# Mask R-CNN from it (same detection config and budget as `make main`, which starts
# from scratch).
#
#   1. tools/make_toy_imagenet.py             -> data/toy_imagenet (deterministic, seconds)
#   2. tools/train.py configs/cls/lapformer_t_toy.py -> $WORK_DIR/cls, top-1 (mmpretrain Accuracy)
#   3. tools/convert_cls_to_backbone.py       -> $WORK_DIR/backbone_lapformer_t_toy.pth
#   4. tools/make_toy_coco.py                 -> data/toy_coco
#   5. tools/train.py configs/toy/maskrcnn_lapformer_t_toy_pretrained.py -> $WORK_DIR/det;
#      fails unless the backbone loaded with no missing and no unexpected keys
#   6. tools/test.py (mmdet CocoMetric)       -> APb/APm table, $WORK_DIR/det/metrics.json
#
# Environment: PYTHON (default: python on PATH), WORK_DIR (default work_dirs/pretrain),
# SEED (default 0), LAPFORMER_NUM_THREADS (torch CPU threads, default 1, as in
# tools/main_job.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-work_dirs/pretrain}
SEED=${SEED:-0}
CLS_CONFIG=configs/cls/lapformer_t_toy.py
DET_CONFIG=configs/toy/maskrcnn_lapformer_t_toy_pretrained.py
BACKBONE=$WORK_DIR/backbone_lapformer_t_toy.pth
THREADS=${LAPFORMER_NUM_THREADS:-1}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)

stamp() { echo "[pretrain_job $(date +%H:%M:%S), $(( $(date +%s) - START ))s] $*"; }

stamp "1/6 writing the toy ImageNet-format set to data/toy_imagenet"
"$PYTHON" tools/make_toy_imagenet.py --out data/toy_imagenet

stamp "2/6 pretraining $CLS_CONFIG (seed $SEED, $THREADS thread(s)) into $WORK_DIR/cls"
rm -rf "$WORK_DIR"
mkdir -p "$WORK_DIR"
"$PYTHON" tools/train.py "$CLS_CONFIG" --work-dir "$WORK_DIR/cls" \
    --cfg-options randomness.seed="$SEED" > "$WORK_DIR/cls.log" 2>&1 \
    || { tail -n 40 "$WORK_DIR/cls.log"; exit 1; }
grep -E 'Epoch\(train\).*\]\[[0-9]+/[0-9]+\]' "$WORK_DIR/cls.log" | tail -n 1
TOP1=$(grep -oE 'accuracy/top1: [0-9.]+' "$WORK_DIR/cls.log" | tail -n 1)
stamp "toy classification, val split: $TOP1 (%)"
CLS_CKPT=$(ls "$WORK_DIR"/cls/epoch_*.pth | sort -V | tail -n 1)

stamp "3/6 converting $CLS_CKPT into $BACKBONE"
"$PYTHON" tools/convert_cls_to_backbone.py "$CLS_CKPT" "$BACKBONE" --arch tiny

stamp "4/6 writing the toy COCO set to data/toy_coco"
"$PYTHON" tools/make_toy_coco.py --out data/toy_coco

stamp "5/6 training $DET_CONFIG from $BACKBONE into $WORK_DIR/det"
# val_begin past the last epoch: the evaluation is step 6's, not a second one here.
"$PYTHON" tools/train.py "$DET_CONFIG" --work-dir "$WORK_DIR/det" \
    --cfg-options randomness.seed="$SEED" train_cfg.val_begin=1000000 \
    model.backbone.init_cfg.checkpoint="$BACKBONE" > "$WORK_DIR/det.log" 2>&1 \
    || { tail -n 40 "$WORK_DIR/det.log"; exit 1; }
if grep -E '(missing|unexpected) keys in' "$WORK_DIR/det.log"; then
    stamp "the backbone checkpoint did not fit the detection backbone (keys above)"
    exit 1
fi
grep -E "loaded [0-9]+ tensors from $BACKBONE" "$WORK_DIR/det.log" \
    || { stamp "no backbone load logged in $WORK_DIR/det.log"; exit 1; }
stamp "backbone loaded: 0 missing, 0 unexpected keys"
DET_CKPT=$(ls "$WORK_DIR"/det/epoch_*.pth | sort -V | tail -n 1)

stamp "6/6 evaluating $DET_CKPT with mmdet's CocoMetric on the val split"
"$PYTHON" tools/test.py "$DET_CONFIG" "$DET_CKPT" --work-dir "$WORK_DIR/det" \
    --metrics-json "$WORK_DIR/det/metrics.json" \
    --cfg-options test_evaluator.outfile_prefix="$WORK_DIR/det/results" \
    > "$WORK_DIR/test.log" 2>&1 \
    || { cat "$WORK_DIR/test.log"; exit 1; }

echo
echo "LaplacianFormer-T pretrained on toy shapes: $TOP1 (val top-1, %)"
echo "Mask R-CNN from it, toy shapes val split (COCO metrics, fractions):"
grep -A 3 '^| | AP' "$WORK_DIR/test.log"
echo
echo "classifier:  $CLS_CKPT (log $WORK_DIR/cls.log)"
echo "backbone:    $BACKBONE"
echo "detector:    $DET_CKPT (log $WORK_DIR/det.log)"
echo "metrics:     $WORK_DIR/det/metrics.json"
stamp "done in $(( $(date +%s) - START ))s"
