"""The pinned OpenMMLab stack works on CPU: compiled mmcv ops and the downstream packages."""
import importlib

import numpy as np
import pytest
import torch


def greedy_nms(boxes, scores, iou_threshold):
    """Textbook NMS in numpy: keep the best box, drop boxes overlapping it above the threshold."""
    order = list(np.argsort(-scores, kind='stable'))
    keep = []
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    while order:
        best = order.pop(0)
        keep.append(best)
        rest = []
        for other in order:
            w = min(boxes[best, 2], boxes[other, 2]) - max(boxes[best, 0], boxes[other, 0])
            h = min(boxes[best, 3], boxes[other, 3]) - max(boxes[best, 1], boxes[other, 1])
            inter = max(w, 0) * max(h, 0)
            if inter / (area[best] + area[other] - inter) <= iou_threshold:
                rest.append(other)
        order = rest
    return keep


def test_mmcv_nms_matches_greedy_nms():
    from mmcv.ops import nms

    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 50, size=(40, 2))
    wh = rng.uniform(5, 30, size=(40, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
    scores = rng.permutation(40).astype(np.float32) / 40
    dets, keep = nms(torch.from_numpy(boxes), torch.from_numpy(scores), iou_threshold=0.3)
    assert keep.tolist() == greedy_nms(boxes, scores, 0.3)
    np.testing.assert_allclose(dets[:, 4].numpy(), scores[keep.numpy()])


def bilinear(feature, y, x):
    """Bilinear sample of a (H, W) array at an interior point."""
    y0, x0 = int(np.floor(y)), int(np.floor(x))
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * feature[y0, x0] + (1 - ly) * lx * feature[y0, x0 + 1]
            + ly * (1 - lx) * feature[y0 + 1, x0] + ly * lx * feature[y0 + 1, x0 + 1])


@pytest.mark.parametrize('sampling_ratio', [1, 2])
def test_mmcv_roi_align_matches_bilinear_sampling(sampling_ratio):
    from mmcv.ops import RoIAlign

    rng = np.random.default_rng(1)
    feature = rng.standard_normal((2, 3, 16, 20)).astype(np.float32)
    rois = np.array([[0, 2.3, 3.1, 14.7, 11.9], [1, 5.0, 1.5, 17.2, 13.0]], np.float32)
    out_h, out_w, scale = 3, 4, 1.0
    op = RoIAlign((out_h, out_w), spatial_scale=scale, sampling_ratio=sampling_ratio,
                  pool_mode='avg', aligned=True)
    got = op(torch.from_numpy(feature), torch.from_numpy(rois)).numpy()

    expected = np.zeros_like(got)
    for r, (b, x1, y1, x2, y2) in enumerate(rois):
        # aligned=True: pixel centres sit at integer coordinates, so shift the box by half.
        x1, y1, x2, y2 = x1 * scale - 0.5, y1 * scale - 0.5, x2 * scale - 0.5, y2 * scale - 0.5
        bin_h, bin_w = (y2 - y1) / out_h, (x2 - x1) / out_w
        for ph in range(out_h):
            for pw in range(out_w):
                ys = [y1 + ph * bin_h + (i + 0.5) * bin_h / sampling_ratio
                      for i in range(sampling_ratio)]
                xs = [x1 + pw * bin_w + (j + 0.5) * bin_w / sampling_ratio
                      for j in range(sampling_ratio)]
                for c in range(3):
                    samples = [bilinear(feature[int(b), c], y, x) for y in ys for x in xs]
                    expected[r, c, ph, pw] = np.mean(samples)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_stack_imports_at_the_pinned_versions():
    import mmcv
    import mmdet
    import mmengine
    import mmseg

    for module in ('mmdet.models', 'mmseg.models', 'pycocotools.cocoeval', 'lapformer_mm'):
        importlib.import_module(module)
    assert mmcv.__version__.startswith('2.1.')
    assert mmengine.__version__.startswith('0.10.')
    assert mmdet.__version__.startswith('3.3.')
    assert mmseg.__version__.startswith('1.2.')
