"""The report of a sweep: a table per variant, a loss-curve plot and a JSON of every run.

A run is a dict with at least ``variant``, ``seed``, ``final_acc`` and ``takeoff_step``
(None: it never left the plateau), optionally ``early_step``/``early_acc`` and ``losses``
(with ``loss_steps``, when not every step was logged). Accuracies are fractions in [0, 1].
"""
import json
import os
import os.path as osp
import statistics

from .toy import TAKEOFF_WINDOW

COLUMNS = ('variant', 'attn_cfg', 'runs', 'final acc (%)', 'took off',
           'mean take-off step', 'early acc (%)')


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def summarize(runs):
    """One row (a dict) per variant, in the order the variants first appear."""
    order = []
    for run in runs:
        if run['variant'] not in order:
            order.append(run['variant'])
    rows = []
    for variant in order:
        group = [run for run in runs if run['variant'] == variant]
        final_mean, final_std = _mean_std([run['final_acc'] for run in group])
        early_mean, early_std = _mean_std([run.get('early_acc') for run in group])
        takeoffs = [run['takeoff_step'] for run in group if run['takeoff_step'] is not None]
        early_steps = sorted({run.get('early_step') for run in group} - {None})
        rows.append(dict(
            variant=variant, attn_cfg=group[0].get('attn_cfg', {}), runs=len(group),
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


def _cfg_text(cfg):
    return ', '.join(f'{k}={v!r}' for k, v in cfg.items()) or '(defaults)'


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
        cells = [row['variant'], _cfg_text(row['attn_cfg']), str(row['runs']),
                 _pct(row['final_acc_mean'], row['final_acc_std']),
                 f"{row['took_off']}/{row['runs']}", takeoff,
                 _pct(row['early_acc_mean'], row['early_acc_std'])]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def running_mean(values, window):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(runs, path, title=None, window=TAKEOFF_WINDOW):
    """Training-loss curves (running mean over ``window`` records), one panel per variant,
    one line per seed; saved as PNG at ``path``."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    variants = []
    for run in runs:
        if run['variant'] not in variants:
            variants.append(run['variant'])
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


def write_report(runs, out_dir, settings, plot_title=None, early_label=None):
    """Write ``table.md``, ``runs.json`` and ``loss_curves.png`` under ``out_dir``; return
    (table text, {kind: path})."""
    os.makedirs(out_dir, exist_ok=True)
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
