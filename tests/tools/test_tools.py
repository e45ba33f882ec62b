"""The user-facing tools on a tiny generated data set (CPU)."""
import contextlib
import gc
import importlib.util
import io
import json
import os
import os.path as osp
import re
import socket
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _runner_helpers import assert_refused_with_hint
from _shared import ROOT, TOOLS, TOY_CONFIG, run_tool, toy_data_options, toy_run_options
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from lapformer_mm.checkpoint import safe_load
from lapformer_mm.cli import coco_eval, make_toy_coco
from lapformer_mm.cli import test as cli_test
from lapformer_mm.cli import train as cli_train
from lapformer_mm.models.validation import ConfigError


def test_make_toy_coco_is_deterministic_and_valid(tmp_path):
    outs = [str(tmp_path / name) for name in 'ab']
    for out in outs:
        with contextlib.redirect_stdout(io.StringIO()):
            make_toy_coco.main(['--out', out, '--num-train', '3', '--num-val', '2',
                                '--img-size', '96'])
    for rel in ('annotations/instances_train.json', 'train/000002.png', 'val/000001.png'):
        with open(osp.join(outs[0], rel), 'rb') as fa, open(osp.join(outs[1], rel), 'rb') as fb:
            assert fa.read() == fb.read(), rel
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(osp.join(outs[0], 'annotations/instances_train.json'))
    assert len(coco.getImgIds()) == 3
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(make_toy_coco.CLASSES)
    for ann in coco.loadAnns(coco.getAnnIds()):
        # bbox and area are those of the polygon mask itself
        mask = coco.annToMask(ann)
        ys, xs = np.nonzero(mask)
        x, y, w, h = ann['bbox']
        assert ann['area'] == pytest.approx(mask.sum(), abs=1)
        assert xs.min() >= np.floor(x) and xs.max() <= np.ceil(x + w)
        assert ys.min() >= np.floor(y) and ys.max() <= np.ceil(y + h)


def write_eval_fixture(tmp_path):
    """A 2-image GT file and a results file (RLE masks) with hits, misses and a dup."""
    rng = np.random.default_rng(0)
    anns, results = [], []
    for i, (img_id, cat, box) in enumerate([
            (1, 1, [10, 10, 20, 15]), (1, 2, [40, 5, 30, 40]),
            (2, 1, [5, 30, 8, 8]), (2, 2, [20, 10, 50, 45])]):
        x, y, w, h = box
        anns.append(dict(id=i + 1, image_id=img_id, category_id=cat, bbox=box,
                         area=float(w * h), iscrowd=0,
                         segmentation=[[x, y, x + w, y, x + w, y + h, x, y + h]]))
        for _ in range(2):
            dx, dy, dw, dh = rng.uniform(-3, 3, 4)
            dbox = [x + dx, y + dy, max(w + dw, 1), max(h + dh, 1)]
            m = np.zeros((60, 80), np.uint8, order='F')
            m[int(dbox[1]):int(dbox[1] + dbox[3]), int(dbox[0]):int(dbox[0] + dbox[2])] = 1
            rle = mask_utils.encode(m)
            results.append(dict(image_id=img_id, category_id=cat,
                                bbox=[float(v) for v in dbox],
                                segmentation=dict(rle, counts=rle['counts'].decode()),
                                score=float(rng.uniform(0.1, 1))))
    gt = dict(images=[dict(id=i, width=80, height=60, file_name=f'{i}.png') for i in (1, 2)],
              annotations=anns, categories=[dict(id=1, name='a'), dict(id=2, name='b')])
    ann_file, res_file = tmp_path / 'gt.json', tmp_path / 'res.json'
    ann_file.write_text(json.dumps(gt))
    res_file.write_text(json.dumps(results))
    return str(ann_file), str(res_file), results


def pycocotools_stats(ann_file, results, iou_type):
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(ann_file)
        if iou_type == 'segm':  # mask areas, as mmdet's CocoMetric does
            results = [{k: v for k, v in r.items() if k != 'bbox'} for r in results]
        ev = COCOeval(gt, gt.loadRes(results), iou_type)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return [float(v) for v in ev.stats[:6]]


def test_coco_eval_matches_pycocotools(tmp_path, capsys):
    """One file for both types (RLE masks), then one per type with polygons."""
    ann_file, res_file, results = write_eval_fixture(tmp_path)
    out_json = str(tmp_path / 'metrics.json')
    assert coco_eval.main([ann_file, res_file, '--types', 'bbox', 'segm', '--out-json',
                           out_json]) == 0
    assert capsys.readouterr().out.count('Average Precision') == 12
    with open(out_json) as f:
        metrics = json.load(f)
    for iou_type in ('bbox', 'segm'):
        assert [metrics[iou_type][k] for k in coco_eval.STAT_NAMES] == pycocotools_stats(
            ann_file, results, iou_type)
    boxes = [{k: v for k, v in r.items() if k != 'segmentation'} for r in results]
    polygons, as_rle = [], []
    for r in results:
        x, y, w, h = r['bbox']
        polygons.append(dict(image_id=r['image_id'], category_id=r['category_id'],
                             score=r['score'],
                             segmentation=[[x, y, x + w, y, x + w, y + h, x, y + h]]))
        rle = mask_utils.merge(mask_utils.frPyObjects(polygons[-1]['segmentation'], 60, 80))
        as_rle.append(dict(polygons[-1], segmentation=dict(rle, counts=rle['counts'].decode())))
    files = []
    for name, entries in (('res.bbox.json', boxes), ('res.segm.json', polygons)):
        files.append(str(tmp_path / name))
        (tmp_path / name).write_text(json.dumps(entries))
    metrics = coco_eval.evaluate(ann_file, files, ('bbox', 'segm'), verbose=False)
    assert [metrics['bbox'][k] for k in coco_eval.STAT_NAMES] == pycocotools_stats(
        ann_file, results, 'bbox')
    assert [metrics['segm'][k] for k in coco_eval.STAT_NAMES] == pycocotools_stats(
        ann_file, as_rle, 'segm')
    assert 0 < metrics['segm']['AP'] < 1


def test_coco_eval_ends_a_file_it_cannot_score_with_one_line_naming_it(tmp_path, capsys):
    gt = tmp_path / 'gt.json'
    gt.write_text(json.dumps(dict(
        images=[dict(id=1, width=40, height=30, file_name='1.png')],
        annotations=[dict(id=1, image_id=1, category_id=1, bbox=[5, 5, 10, 10], area=100.0,
                          iscrowd=0, segmentation=[[5, 5, 15, 5, 15, 15, 5, 15]])],
        categories=[dict(id=1, name='a')])))
    good = dict(image_id=1, category_id=1, bbox=[5, 5, 10, 10], score=0.9)
    cases = {'nope.json': None, 'empty.json': '[]', 'blank.json': '', 'dict.json': '{}',
             'image.json': [dict(good, image_id=7)], 'cat.json': [dict(good, category_id=9)],
             'nobox.json': [dict(image_id=1, category_id=1, score=1.0)]}
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str)
                                         else json.dumps(content))
        assert coco_eval.main([str(gt), str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert name in err and err.count('\n') == 1, err
    (tmp_path / 'boxes.json').write_text(json.dumps([good]))
    assert coco_eval.main([str(gt), str(tmp_path / 'boxes.json'), '--types', 'segm']) == 2
    assert 'segmentation' in capsys.readouterr().err
    assert coco_eval.main([str(tmp_path / 'nope.json'), str(tmp_path / 'boxes.json')]) == 2
    assert 'nope.json' in capsys.readouterr().err


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.mark.slow(seconds=35)
def test_dist_train_then_dist_test_two_processes(toy_coco, tmp_path):
    """2 gloo ranks each; each destroys its process group before exit (no warning)."""
    work = str(tmp_path / 'work')
    log = run_tool(['bash', osp.join(TOOLS, 'dist_train.sh'), TOY_CONFIG, '2', '--work-dir',
                    work] + toy_run_options(toy_coco, 1),
                   extra_env=dict(PORT=str(free_port())))
    assert 'Distributed training: True' in log
    # 8 images, 2 ranks x 2 images per step -> 2 iterations per epoch
    assert 'Epoch(train) [1][2/2]' in log
    assert safe_load(osp.join(work, 'epoch_1.pth'))['meta']['iter'] == 2
    assert 'outlives destroy_process_group' not in log
    out_pkl = str(tmp_path / 'preds.pkl')
    log = run_tool(['bash', osp.join(TOOLS, 'dist_test.sh'), TOY_CONFIG,
                    osp.join(work, 'epoch_1.pth'), '2', '--work-dir', work, '--out', out_pkl,
                    '--cfg-options', *toy_data_options(toy_coco)],
                   extra_env=dict(PORT=str(free_port())))
    assert re.search(r'Epoch\(test\) \[1/1\] +coco/bbox_mAP: [-\d.]+', log), log[-2000:]
    assert osp.isfile(out_pkl) and 'outlives destroy_process_group' not in log


def process_threads():
    return set(os.listdir('/proc/self/task'))


def wait_for_exit(threads, seconds=5):
    """Whether the OS threads ``threads`` are gone within ``seconds``."""
    deadline = time.monotonic() + seconds
    while process_threads() & threads:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_close_distributed_joins_gloo_threads_or_warns_the_group_is_held(tmp_path):
    """Destroying the group joins gloo's threads; a group still held gets a warning."""
    def start(name):
        before = process_threads()
        dist.init_process_group('gloo', init_method=f'file://{tmp_path / name}',
                                rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        started = process_threads() - before
        assert started
        return started

    try:
        gloo = start('store1')
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            cli_train.close_distributed()
        assert not dist.is_initialized() and wait_for_exit(gloo)
        gloo = start('store2')
        held = dist.group.WORLD
        with pytest.warns(RuntimeWarning, match='destroy_process_group'):
            cli_train.close_distributed()
        assert not wait_for_exit(gloo, seconds=0.5)
        del held
        gc.collect()
        assert wait_for_exit(gloo)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def get_flops_tool():
    spec = importlib.util.spec_from_file_location('get_flops', osp.join(TOOLS, 'get_flops.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_get_flops_counts_the_custom_attention_ops():
    """The backbone's kernel/Newton-Schulz handlers are used: full > visible."""
    from mmengine.config import Config

    from lapformer_mm.analysis.flops import detector_cost
    from lapformer_mm.analysis.model_zoo import build_from_config
    model, scope = build_from_config(Config.fromfile(TOY_CONFIG))
    res = detector_cost(model, scope, 64, 64)
    assert res['full'] > res['visible'] > res['backbone'] > 0
    assert res['backbone_params'] == pytest.approx(
        sum(p.numel() for p in model.backbone.parameters()) / 1e6)


def test_get_flops_counts_an_mmpretrain_classifier():
    """On an ImageNet config at 224 x 224: the count of the model-size table's classifier."""
    pytest.importorskip('mmpretrain')
    from lapformer_mm.analysis.flops import classifier_cost
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        res = get_flops_tool().main([osp.join(ROOT, 'configs/cls/lapformer_t_in1k.py')])
    assert 'input:    1x3x224x224' in printed.getvalue()
    expected = classifier_cost('tiny', 224)
    # mmpretrain's neck pools with adaptive_avg_pool2d, which the counter counts (512·7·7).
    assert res['full'] - expected['full'] == pytest.approx(512 * 7 * 7 / 1e9)
    assert res['visible'] - expected['visible'] == pytest.approx(512 * 7 * 7 / 1e9)
    assert res['params'] == pytest.approx(expected['params'])


def test_get_flops_ends_a_config_it_cannot_read_with_one_line(tmp_path, capsys):
    notes = tmp_path / 'notes.txt'
    notes.write_text('x = 1\n')
    for config in (str(tmp_path / 'nope.py'), str(notes)):
        with pytest.raises(SystemExit) as exited:
            get_flops_tool().main([config])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert config in err and err.count('\n') == 1
    log = run_tool([sys.executable, osp.join(TOOLS, 'get_flops.py'), str(notes)], returncode=2)
    assert 'Traceback' not in log


def test_test_tool_options(tmp_path, capsys):
    checkpoint = tmp_path / 'x.pth'
    checkpoint.write_bytes(b'PK')

    def cfg_of(config, *argv):
        return cli_test.build_cfg(cli_test.parse_args([osp.join(ROOT, config),
                                                       str(checkpoint), *argv]))
    # --tta wraps the model and pipeline as mmdet and mmseg do.
    cfg = cfg_of('configs/toy/retinanet_lapformer_t_toy.py', '--tta')
    assert cfg.model.type == 'DetTTAModel' and cfg.model.module.type == 'RetinaNet'
    augment = cfg.test_dataloader.dataset.pipeline[-1]
    assert augment.type == 'TestTimeAug'
    assert [t['prob'] for t in augment.transforms[0]] == [1.0, 0.0]
    cfg = cfg_of('configs/upernet_lapformer_t_ade20k.py', '--tta')
    assert cfg.model.type == 'SegTTAModel' and cfg.model.module.type == 'EncoderDecoder'
    assert cfg.test_dataloader.dataset.pipeline == cfg.tta_pipeline
    for config in ('configs/toy/maskrcnn_lapformer_t_toy.py',  # masks: DetTTAModel merges none
                   'configs/toy/upernet_lapformer_t_toy.py'):  # no tta_pipeline
        with pytest.raises(ConfigError, match='--tta'):
            cfg_of(config, '--tta')
    # mmdet's tool takes URLs and storage backends; the runner loads them.
    for url in ('https://example.com/epoch_12.pth', 's3://bucket/epoch_12.pth'):
        assert cli_test.build_cfg(cli_test.parse_args([TOY_CONFIG, url])).load_from == url
    with pytest.raises(SystemExit):
        cli_test.parse_args([TOY_CONFIG, 'x.pth', '--out', 'preds.json'])
    assert '--out' in capsys.readouterr().err
    # A segmentor's --out is a folder of masks; --show-dir draws with the config's hook.
    seg = 'configs/toy/upernet_lapformer_t_toy.py'
    with pytest.raises(ConfigError, match='--out'):
        cfg_of(seg, '--out', 'res.pkl')
    cfg = cfg_of(seg, '--show-dir', 'vis')
    assert cfg.default_hooks.visualization.draw and cfg.visualizer.save_dir == 'vis'
    with pytest.raises(ConfigError, match='visualization'):
        cfg_of(seg, '--show-dir', 'vis', '--cfg-options', 'default_hooks.visualization=None')


@pytest.mark.slow(seconds=20)
def test_test_tool_tta_evaluates_a_detector(toy_coco, tmp_path):
    from lapformer_mm.deploy import build_model
    config = osp.join(ROOT, 'configs/toy/retinanet_lapformer_t_toy.py')
    checkpoint = str(tmp_path / 'retinanet.pth')
    torch.save({'state_dict': build_model(config)[0].state_dict()}, checkpoint)
    # Random weights score below the default threshold: every box kept, so COCO evaluates.
    metrics = cli_test.main([config, checkpoint, '--tta', '--work-dir', str(tmp_path / 'work'),
                             '--cfg-options', *toy_data_options(toy_coco),
                             'model.test_cfg.score_thr=0.0'])
    assert 'coco/bbox_mAP' in metrics
    assert 'DetTTAModel' in (tmp_path / 'work').joinpath(
        next(p for p in os.listdir(tmp_path / 'work') if p.endswith('.py'))).read_text()


def test_visualize_refuses_an_out_dir_that_is_a_file(tmp_path, capsys):
    from lapformer_mm.cli import visualize_predictions
    with pytest.raises(SystemExit):
        visualize_predictions.parse_args([TOY_CONFIG, str(tmp_path / 'x.pth'), '--out-dir',
                                          __file__])
    assert '--out-dir' in capsys.readouterr().err


@pytest.mark.usefixtures('mmdet_scope')
def test_test_tool_refuses_code_running_checkpoint(evil, toy_coco, tmp_path):
    path, marker = evil
    with pytest.raises(RuntimeError) as info:
        cli_test.main([TOY_CONFIG, path, '--work-dir', str(tmp_path / 'work'),
                       '--cfg-options', *toy_data_options(toy_coco)])
    assert_refused_with_hint(str(info.value), path)
    assert not marker.exists()


@pytest.mark.slow
def test_mmdet_train_script_gives_our_result_through_custom_imports(toy_run, tmp_path):
    """mmdet's tools/train.py outside this repository, with only the config's custom_imports:
    the same weights as conftest.py's ``toy_run``."""
    import mmdet
    mmdet_train = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools', 'train.py')
    work_dir = str(tmp_path / 'mmdet')
    theirs_log = run_tool([sys.executable, mmdet_train, TOY_CONFIG, '--work-dir', work_dir] +
                          toy_run_options(toy_run.data, max_epochs=1),
                          cwd=str(tmp_path), extra_env=dict(PYTHONPATH=''))
    theirs = safe_load(osp.join(work_dir, 'epoch_1.pth'))
    ours = safe_load(toy_run.checkpoint)
    for log in (theirs_log, toy_run.log):
        assert 'SafeCheckpointHook' in log and 'Epoch(train) [1][4/4]' in log
    assert theirs['meta']['iter'] == ours['meta']['iter'] == 4
    assert theirs['state_dict'].keys() == ours['state_dict'].keys()
    for key, value in ours['state_dict'].items():
        assert torch.equal(theirs['state_dict'][key], value), key
