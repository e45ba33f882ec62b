"""tools/analysis command lines and benchmarks/backbones.py helpers (no timing asserted)."""
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from _shared import ROOT, TOOLS, TOY_CONFIG, run_tool

from benchmarks import backbones as bench
from lapformer_mm.analysis import attention_maps, model_zoo

DPI = 72  # the analysis figures' resolution


def run_cli(script, *args):
    """Run tools/analysis/<script> with this interpreter; return its stdout+stderr."""
    return run_tool([sys.executable, osp.join(TOOLS, 'analysis', script), *args])


def read_png(path):
    """(H, W, 3) float RGB in [0, 1]."""
    import matplotlib.image
    return matplotlib.image.imread(path)[..., :3]


def colour_pixels(image, hex_colour, tol=0.02):
    """Number of pixels within ``tol`` of ``hex_colour`` in every channel."""
    rgb = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image - rgb) <= tol).all(-1).sum())


@pytest.mark.slow
def test_qk_distances_cli_writes_plots_and_tables(tmp_path):
    run_cli('qk_distances.py', '--models', 'laplacianformer-t', '--num-images', '1',
            '--size', '32', '32', '--max-queries', '16', '--max-keys', '16',
            '--out', str(tmp_path))
    # One column per stage (3.2 inches each), rows ℓ1 (C0 blue) and squared ℓ2 (C1 orange).
    histograms = read_png(tmp_path / 'qk_distances_laplacianformer-t.png')
    assert histograms.shape[:2] == (int(5.4 * DPI), int(4 * 3.2 * DPI))
    assert colour_pixels(histograms, '#1f77b4') > 1000
    assert colour_pixels(histograms, '#ff7f0e') > 1000
    normalised = read_png(tmp_path / 'qk_distances_normalised.png')
    assert normalised.shape[:2] == (int(3.6 * DPI), 10 * DPI)
    assert colour_pixels(normalised, '#1f77b4') > 100  # the one model's step histograms
    data = json.loads((tmp_path / 'qk_distance_stats.json').read_text())
    stats = data['stats']['laplacianformer-t']
    assert sorted(stats) == ['0', '1', '2', '3']
    assert stats['0']['l1']['n'] == 16 * 16 * 2  # one block, 2 heads, 16 x 16 sampled pairs
    table = (tmp_path / 'qk_distance_stats.md').read_text()
    assert table.count('| laplacianformer-t |') == 8
    assert data['weights'] == {'laplacianformer-t': 'random init'}


def load_cli(script):
    """tools/analysis/<script> as a module (its parse_args and main, without a process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        f'analysis_{script[:-3]}', osp.join(TOOLS, 'analysis', script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('script, argv, name', [
    ('qk_distances.py', ['--checkpoint', 'foo'], '--checkpoint'),
    ('qk_distances.py', ['--size', '0', '0'], '--size'),
    ('qk_distances.py', ['--max-queries', '0'], '--max-queries'),
    ('qk_distances.py', ['--max-samples', '1'], '--max-samples'),
    # Each backbone's own size rule, and a checkpoint of a model not run.
    ('qk_distances.py', ['--models', 'pvtv2-b1', '--size', '16', '16'], 'pvtv2-b1'),
    ('qk_distances.py', ['--models', 'swin-t', '--size', '224', '100'], 'swin-t'),
    ('qk_distances.py', ['--models', 'pvtv2-b1', '--checkpoint', 'swin-t=x.pth'], 'swin-t'),
    ('qk_distances.py', ['--checkpoint', 'laplacianformer-t=no/such.pth'], 'no/such.pth'),
    ('qk_distances.py', ['--images', 'no/such'], '--images'),
    ('attention_maps.py', ['--stage', '5'], '--stage'),
    ('attention_maps.py', ['--block', '0'], '--block'),
    ('attention_maps.py', ['--query', '1.5', '0.5'], '--query'),
    ('attention_maps.py', ['--size', '0', '0'], '--size'),
    ('attention_maps.py', ['--r-max', 'nan'], '--r-max'),
    ('attention_maps.py', ['--checkpoint', 'no/such.pth'], '--checkpoint'),
    ('attention_maps.py', ['--image', 'no/such.jpg'], '--image'),
])
def test_analysis_argument_errors(script, argv, name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_cli(script).parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert 'error: ' in err and name in err, err


def test_attention_maps_block_past_the_stage_is_an_argument_error(tmp_path, capsys):
    # The stage's block count comes with the model: checked after building it.
    with pytest.raises(SystemExit) as exit_info:
        load_cli('attention_maps.py').main(['--size', '32', '32', '--block', '9',
                                            '--out', str(tmp_path)])
    assert exit_info.value.code == 2
    assert '--block 9' in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_attention_maps_cli_writes_both_figures(tmp_path):
    out = run_cli('attention_maps.py', '--size', '32', '32', '--stage', '2', '--block', '2',
                  '--out', str(tmp_path))
    assert 'attention_maps.png' in out
    maps = read_png(tmp_path / 'attention_maps.png')
    assert maps.shape[:2] == (int(6.6 * DPI), 13 * DPI)
    assert colour_pixels(maps, '#ff0000', tol=0.1) > 20  # the query markers
    # Heat maps: viridis' dark end and bright end both occur.
    assert colour_pixels(maps, '#440154', tol=0.08) > 20
    assert colour_pixels(maps, '#fde725', tol=0.08) > 20
    gradients = read_png(tmp_path / 'kernel_gradients.png')
    assert gradients.shape[:2] == (int(3.4 * DPI), 9 * DPI)
    assert colour_pixels(gradients, '#1f77b4') > 100  # Laplacian
    assert colour_pixels(gradients, '#ff7f0e') > 100  # Gaussian


def test_attention_maps_rejects_softmax_stage():
    model = model_zoo.build_backbone('laplacianformer-t-softmax4', config_overrides=dict(
        arch=dict(embed_dims=[8, 8, 8, 8], num_heads=[1, 1, 1, 1], depths=[1, 1, 1, 1])))
    for stage, block, match in ((4, 1, 'LaplacianAttention'), (1, 2, 'block'), (0, 1, 'block')):
        with pytest.raises(ValueError, match=match):
            attention_maps.capture_block(model, torch.randn(1, 3, 32, 32), stage, block)


def _entry(cpu, wall=None):
    return bench.summarise([(wall or cpu, cpu)] * 3, max_call_s=100, load='0', peak_mib=10.0)


def test_benchmark_table_ratios_and_growth():
    results = {'fwd': {
        '1024x1024': {'laplacianformer-t': _entry(2.0), 'swin-t': _entry(3.0)},
        '2048x2048': {'laplacianformer-t': _entry(8.5), 'swin-t': _entry(12.0)}}}
    params = {'laplacianformer-t': 12e6, 'swin-t': 28e6}
    table = bench.format_table(results, params, [(1024, 1024), (2048, 2048)], ['fwd'],
                               'median_cpu_s')
    assert '| 1024x1024 | swin-t | 28.0 | 3.000 | 3.000 | 1.50 | 10 |' in table
    assert bench.growth(results, 'fwd', 'laplacianformer-t', (1024, 1024), (2048, 2048),
                        'median_cpu_s') == pytest.approx(4.25)
    assert bench.growth(results, 'fwdbwd', 'swin-t', (1024, 1024), (2048, 2048),
                        'median_cpu_s') is None
    entry = bench.summarise([(5.0, 1.0), (1.0, 3.0), (2.0, 2.0)], max_call_s=4.0,
                            load='1', peak_mib=None)
    assert entry['median_s'] == 2.0 and entry['median_cpu_s'] == 2.0
    assert entry['slow']


def test_benchmark_planned_configs():
    args = bench.parse_args(['--sizes', '64x64', '2048x2048', '--modes', 'fwd', 'fwdbwd'])
    assert bench.planned_configs(args) == [('fwd', (64, 64)), ('fwd', (2048, 2048)),
                                           ('fwdbwd', (64, 64))]


@pytest.mark.parametrize('module, argv, name', [
    ('backbones', ['--skip', 'resnet@64x64'], '--skip'),
    ('backbones', ['--sizes', '64by64'], '--sizes'),
    ('backbones', ['--device', 'gpu'], '--device'),
    ('backbones', ['--device', 'cuda'], '--device cuda'),
    ('backbones', ['--threads', '-2'], '--threads'),
    ('backbones', ['--max-call-s', '-1'], '--max-call-s'),
    ('backbones', ['--fwdbwd-max-pixels', '-1'], '--fwdbwd-max-pixels'),
    ('backbones', ['--from-json', 'no/such.json'], '--from-json'),
    ('padding', ['--image', '64x64'], '--image'),
    ('padding', ['--image', '50x70'], '--image'),
    ('padding', ['--image', '192x160', '--canvas', '256x256', '128x128'], '--canvas'),
    ('inference', ['configs/nonexist.py'], 'nonexist.py'),
    ('inference', [TOY_CONFIG, '--shape', '0', '0'], '--shape'),
    ('inference', [TOY_CONFIG, '--device', 'cuda'], '--device cuda'),
    ('inference', [TOY_CONFIG, '--device', 'gpu'], '--device'),
])
def test_benchmark_argument_errors(module, argv, name, monkeypatch, capsys):
    import importlib
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)  # a GPU machine too
    entry = 'main' if module == 'padding' else 'parse_args'
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(f'benchmarks.{module}'), entry)(argv)
    assert exit_info.value.code == 2
    assert 'error: ' in (err := capsys.readouterr().err) and name in err, err


def test_benchmark_fwdbwd_call_leaves_no_gradients():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    wrapped = lambda x: (model(x), )  # noqa: E731  backbones return tuples
    wrapped.zero_grad = model.zero_grad
    bench.run_once(wrapped, torch.randn(1, 3, 8, 8), 'fwdbwd')
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
def test_benchmark_memory_child_reports_a_positive_peak():
    # A fresh interpreter: the memory phase forks before any model exists, as main() does.
    code = ('import torch; from benchmarks import backbones as b; '
            "mib, error = b.measure_memory('laplacianformer-t', (64, 64), 'fwd', "
            "torch.device('cpu'), timeout=600); print('RESULT', mib, error)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         cwd=ROOT, timeout=900,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    result = [line.split() for line in out.stdout.splitlines() if line.startswith('RESULT')]
    assert result, out.stderr[-2000:]
    _, mib, error = result[-1]
    assert error == 'None' and float(mib) > 0


def test_padding_benchmark_compares_the_image_region_alone_and_padded():
    """benchmarks/padding.py: no change at the image's own size; features move with padding."""
    from benchmarks import padding
    from lapformer_mm.models import LaplacianFormer
    torch.manual_seed(0)
    model = LaplacianFormer(dict(embed_dims=[16, 32, 32, 64], num_heads=[1, 1, 1, 2],
                                 depths=[1, 1, 1, 1])).eval()
    image = torch.randn(1, 3, 160, 128)
    assert padding.change(model, image, (160, 128)) == [0.0] * 4
    moved = padding.change(model, image, (192, 192))
    assert len(moved) == 4 and min(moved) > 0.1, moved
    assert padding.parse_size('192x160') == (192, 160)
