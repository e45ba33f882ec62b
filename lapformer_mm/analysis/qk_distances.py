"""Query–key distance distributions per stage of LaplacianFormer, PVTv2 and Swin
(``tools/analysis/qk_distances.py``, docs/analysis.md): histograms and tail statistics of ℓ1
and squared-ℓ2 distances. Random weights unless a checkpoint is given."""
import json
import os
import os.path as osp

import numpy as np

from . import pyplot
from .model_zoo import BACKBONE_CONFIGS, build_backbone
from .qk_capture import capture_qk
from .tail_stats import METRICS, DistanceCollector, tail_statistics

METRIC_LABELS = {'l1': 'ℓ1 distance ||q - k||₁', 'sq_l2': 'squared ℓ2 distance ||q - k||₂²'}
DEFAULT_MODELS = ('laplacianformer-t', 'pvtv2-b1', 'swin-t')


def parse_checkpoints(items):
    checkpoints = {}
    for item in items or []:
        name, sep, path = item.partition('=')
        if not sep or name not in BACKBONE_CONFIGS:
            raise ValueError(f'--checkpoint must be MODEL=PATH with MODEL in '
                             f'{sorted(BACKBONE_CONFIGS)}, got {item!r}')
        checkpoints[name] = path
    return checkpoints


def collect_distances(model, batches, collector):
    for batch in batches:
        with capture_qk(model) as records:
            model(batch)
        for record in records:
            collector.add(record)
    return collector


def model_statistics(collector):
    return {stage: {metric: tail_statistics(collector.values(stage, metric))
                    for metric in METRICS}
            for stage in collector.stages()}


def plot_model_histograms(name, collector, path, bins=80):
    plt = pyplot()
    stages = collector.stages()
    fig, axes = plt.subplots(len(METRICS), len(stages), figsize=(3.2 * len(stages), 5.4),
                             squeeze=False)
    for row, metric in enumerate(METRICS):
        for col, stage in enumerate(stages):
            values = collector.values(stage, metric)
            q1, q3 = np.quantile(values, [0.25, 0.75])
            ax = axes[row, col]
            ax.hist(values, bins=bins, density=True, log=True, color=f'C{row}')
            ax.axvline(q3 + 1.5 * (q3 - q1), color='k', lw=0.8, ls='--')
            ax.set_title(f'stage {stage + 1}', fontsize=9)
            ax.tick_params(labelsize=7)
            if col == 0:
                ax.set_ylabel(f'{METRIC_LABELS[metric]}\nlog density', fontsize=8)
    fig.suptitle(f'{name}: query–key distances (dashed: Q3 + 1.5·IQR)', fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def median_normalised(values):
    # A zero median (most pairs identical tokens, e.g. Swin's padding) leaves the values.
    median = np.median(values)
    return values / median if median > 0 else values


def plot_normalised(collectors, path, bins=100):
    plt = pyplot()
    fig, axes = plt.subplots(1, len(METRICS), figsize=(10, 3.6))
    for ax, metric in zip(axes, METRICS):
        for i, (name, collector) in enumerate(collectors.items()):
            values = np.concatenate([median_normalised(collector.values(s, metric))
                                     for s in collector.stages()])
            ax.hist(values, bins=bins, density=True, log=True, histtype='step',
                    color=f'C{i}', label=name)
        ax.set_xlabel(f'{METRIC_LABELS[metric]} / stage median', fontsize=9)
        ax.set_ylabel('log density', fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def markdown_table(all_stats):
    header = ('| model | stage | metric | n | excess kurtosis | outliers > Q3+1.5IQR '
              '| q50 | q90 | q99 | q99.9 | q99/q50 |')
    lines = [header, '|' + '---|' * (header.count('|') - 1)]
    for name, stages in all_stats.items():
        for stage, metrics in stages.items():
            for metric, s in metrics.items():
                lines.append(
                    f"| {name} | {int(stage) + 1} | {metric} | {s['n']} | {s['kurtosis']:.2f} | "
                    f"{100 * s['outlier_share']:.2f}% | {s['q50']:.3g} | {s['q90']:.3g} | "
                    f"{s['q99']:.3g} | {s['q99.9']:.3g} | {s['q99_over_q50']:.2f} |")
    return '\n'.join(lines)


def distance_collectors(names, batches, checkpoints, seed, **limits):
    collectors = {}
    for name in names:
        model = build_backbone(name, checkpoints.get(name))
        collectors[name] = collect_distances(model, batches, DistanceCollector(seed=seed, **limits))
    return collectors


def write_report(collectors, weights, description, out):
    """Histograms, the markdown table and the JSON under ``out``; returns the table."""
    os.makedirs(out, exist_ok=True)
    all_stats = {name: model_statistics(c) for name, c in collectors.items()}
    for name, collector in collectors.items():
        plot_model_histograms(name, collector, osp.join(out, f'qk_distances_{name}.png'))
    plot_normalised(collectors, osp.join(out, 'qk_distances_normalised.png'))
    table = markdown_table(all_stats)
    with open(osp.join(out, 'qk_distance_stats.md'), 'w') as f:
        f.write(f'Weights: {weights}. Images: {description}.\n\n{table}\n')
    with open(osp.join(out, 'qk_distance_stats.json'), 'w') as f:
        json.dump(dict(weights=weights, stats=all_stats), f, indent=1)
    return table
