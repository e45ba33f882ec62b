"""The report of a sweep: a Markdown table, a loss-curve plot and a JSON of every run. A run
has ``variant`` (its row) and ``seed``, and ``final_acc`` and ``takeoff_step`` (toy task,
classification) or ``metrics``, ``classwise`` and ``final_losses`` (tested seg/det runs)."""
import json
import os
import os.path as osp
import statistics

from ..analysis import pyplot
from .toy import TAKEOFF_WINDOW, running_mean

COLUMNS = ('variant', 'attn_cfg', 'runs', 'final acc (%)', 'took off',
           'mean take-off step', 'early acc (%)')


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def _names(runs):
    return list(dict.fromkeys(run['variant'] for run in runs))


def summarize(runs):
    rows = []
    for variant in _names(runs):
        group = [run for run in runs if run['variant'] == variant]
        final_mean, final_std = _mean_std([run['final_acc'] for run in group])
        early_mean, early_std = _mean_std([run.get('early_acc') for run in group])
        takeoffs = [run['takeoff_step'] for run in group if run['takeoff_step'] is not None]
        early_steps = sorted({run.get('early_step') for run in group} - {None})
        rows.append(dict(
            variant=variant, kind=group[0].get('kind', 'variant'),
            config=group[0].get('config'), attn_cfg=group[0].get('attn_cfg', {}),
            runs=len(group),
            seeds=[run['seed'] for run in group],
            final_acc_mean=final_mean, final_acc_std=final_std,
            final_accs=[run['final_acc'] for run in group],
            took_off=len(takeoffs),
            mean_takeoff_step=statistics.fmean(takeoffs) if takeoffs else None,
            early_step=early_steps[0] if len(early_steps) == 1 else early_steps or None,
            early_acc_mean=early_mean, early_acc_std=early_std))
    return rows


def _pct(mean, std):
    return '—' if mean is None else f'{100 * mean:.1f} ± {100 * std:.1f}'


def _cfg_text(row):
    if row.get('kind', 'variant') != 'variant':
        return row['config']
    return ', '.join(f'{k}={v!r}' for k, v in row['attn_cfg'].items()) or '(defaults)'


def format_table(rows, early_label=None):
    """The rows as a Markdown table; ``early_label`` heads the last column (default: the
    early step when every row has the same)."""
    early_steps = {str(row['early_step']) for row in rows if row['early_step'] is not None}
    early = early_label or (f'acc at step {early_steps.pop()} (%)' if len(early_steps) == 1
                            else COLUMNS[-1])
    header = list(COLUMNS[:-1]) + [early]
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for row in rows:
        takeoff = ('—' if row['mean_takeoff_step'] is None
                   else f"{row['mean_takeoff_step']:.0f}")
        cells = [row['variant'], _cfg_text(row), str(row['runs']),
                 _pct(row['final_acc_mean'], row['final_acc_std']),
                 f"{row['took_off']}/{row['runs']}", takeoff,
                 _pct(row['early_acc_mean'], row['early_acc_std'])]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def _stats(values):
    """mean and sample std (0 for one value) of the values that are not None, n, values."""
    mean, std = _mean_std(values)
    return dict(mean=mean, std=std, n=sum(v is not None for v in values), values=values)


def metric_rows(runs, spec, params=None):
    """One row per name of tested runs: ``spec``'s (:data:`.real.TEST_METRICS`) headline
    metrics, the final training loss and the per-class results, each :func:`_stats` over the
    seeds; ``params`` {name: (backbone, whole model) in millions}."""
    rows = []
    for name in _names(runs):
        group = [run for run in runs if run['variant'] == name]
        classwise = {}
        for table in spec['classwise']:
            values = [run['classwise'].get(table, {}) for run in group]
            classes = dict.fromkeys(c for run_values in values for c in run_values)
            classwise[table] = {c: _stats([v.get(c) for v in values]) for c in classes}
        rows.append(dict(
            variant=name, kind=group[0]['kind'], config=group[0]['config'],
            attn_cfg=group[0]['attn_cfg'], runs=len(group),
            seeds=[run['seed'] for run in group],
            params=dict(zip(('backbone', 'total'), (params or {}).get(name, (None, None)))),
            metrics={label: _stats([run['metrics'].get(key) for run in group])
                     for label, key in spec['headline']},
            final_loss=_stats([run['final_losses'].get('loss') for run in group]),
            classwise=classwise))
    return rows


def _cell(stats, digits):
    if stats['mean'] is None:
        return '—'
    text = f"{stats['mean']:.{digits}f}"
    return text + (f" ± {stats['std']:.{digits}f}" if stats['n'] > 1 else '')


def format_metric_table(rows, spec):
    digits = spec['digits']
    labels = [label for label, _ in spec['headline']
              if any(row['metrics'][label]['mean'] is not None for row in rows)]
    header = (['row', 'attn_cfg or config', 'params (M): backbone / all', 'seeds'] + labels
              + ['final train loss'])
    lines = ['Mean ± sample standard deviation (n − 1) over the seeds; one seed: its value.',
             '', '| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for row in rows:
        params = row['params']
        size = ('—' if params['backbone'] is None
                else f"{params['backbone']:.2f} / {params['total']:.2f}")
        cells = ([row['variant'], _cfg_text(row), size, str(row['runs'])]
                 + [_cell(row['metrics'][label], digits) for label in labels]
                 + [_cell(row['final_loss'], 4)])
        lines.append('| ' + ' | '.join(cells) + ' |')
    for table in spec['classwise']:
        classes = list(dict.fromkeys(c for row in rows for c in row['classwise'][table]))
        lines += ['', f'Per class: {table}', '',
                  '| row | ' + ' | '.join(classes) + ' |', '|' + '---|' * (len(classes) + 1)]
        for row in rows:
            cells = [_cell(row['classwise'][table][c], digits)
                     if c in row['classwise'][table] else '—' for c in classes]
            lines.append(f"| {row['variant']} | " + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot_losses(runs, path, title=None, window=TAKEOFF_WINDOW):
    """Running-mean training-loss curves, a panel per variant, a line per seed -> PNG."""
    plt = pyplot()
    variants = _names(runs)
    cols = min(3, len(variants))
    rows = -(-len(variants) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), sharex=True,
                             sharey=True, squeeze=False)
    for ax, variant in zip(axes.flat, variants):
        for run in runs:
            losses = run.get('losses')
            if run['variant'] != variant or not losses:
                continue
            steps = run.get('loss_steps') or range(1, len(losses) + 1)
            ax.plot(list(steps), running_mean(losses, window), lw=1,
                    label=f"seed {run['seed']}")
        ax.set_title(variant, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(variants):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel('step')
    for ax in axes[:, 0]:
        ax.set_ylabel(f'train loss ({window}-step mean)')
    axes.flat[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(runs, out_dir, settings, plot_title=None, early_label=None, spec=None,
                 params=None):
    """Write ``table.md``, ``runs.json`` and ``loss_curves.png`` under ``out_dir``; return
    (table text, {kind: path}). With ``spec`` the runs are tested ones."""
    os.makedirs(out_dir, exist_ok=True)
    if spec:
        rows = metric_rows(runs, spec, params)
        table = format_metric_table(rows, spec)
    else:
        rows = summarize(runs)
        table = format_table(rows, early_label)
    paths = dict(table=osp.join(out_dir, 'table.md'), json=osp.join(out_dir, 'runs.json'),
                 plot=osp.join(out_dir, 'loss_curves.png'))
    with open(paths['table'], 'w') as f:
        f.write(table + '\n')
    with open(paths['json'], 'w') as f:
        json.dump(dict(settings=settings, table=rows, runs=runs), f, indent=1)
    if any(run.get('losses') for run in runs):
        plot_losses(runs, paths['plot'], plot_title)
    else:
        del paths['plot']
    return table, paths
