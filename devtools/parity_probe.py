"""Issue 34 probe: which step of reference.forward amplifies fp32 rounding.

Random-weight LaplacianFormer-T, impl='reference', toy inputs; per-stage max|out-fp64|/max|fp64|
with one piece of the attention forward computed in fp64 (then cast back to fp32).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python devtools/parity_probe.py
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python devtools/parity_probe.py --pooling S

``--pooling S``: the benchmark's parity model (seed S before it is built, as in
docs/benchmarks.md) in eager fp32, impl cpu and reference, with the landmarks pooled four
ways (ATen in fp32 or fp64, the export form's bin matrices in fp32 or fp64, each cast back):
how far an eps-sized change of the landmarks alone moves each stage's error against fp64.
"""
import copy
import dataclasses
import sys
import time

import torch

from lapformer_mm import deploy
from lapformer_mm.analysis.model_zoo import build_backbone
from lapformer_mm.models.attention import LaplacianAttention
from lapformer_mm.ops import reference as R

ORIG = R.forward
D = torch.float64
STATS = []


def centred_rhs(c_k, v):
    """c_kᵀ v = (c_k − rowmean)ᵀ v + 1 (rowmeanᵀ v): exact in math; the N-sum of the part that
    varies over landmarks is taken on small values, the common part once."""
    row = c_k.mean(-1, keepdim=True)
    return (torch.matmul((c_k - row).transpose(-1, -2), v)
            + torch.matmul(row.transpose(-1, -2), v))


def chunked_rhs(c_k, v, rows=512):
    """c_kᵀ v as fp32 partial products over blocks of rows, the partials summed pairwise."""
    parts = [torch.matmul(c_k[..., i:i + rows, :].transpose(-1, -2), v[..., i:i + rows, :])
             for i in range(0, c_k.shape[-2], rows)]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def probe_forward(flags):
    def fwd(q, k, v, landmarks, opts, solver='newton', dropout_p=0.0, export=False):
        if q.dtype == D or solver != 'newton' or dropout_p or export:
            return ORIG(q, k, v, landmarks, opts, solver, dropout_p, export)
        f = torch.float32
        if 'all' in flags:
            out, c, i, s = ORIG(q.double(), None if k is None else k.double(), v.double(),
                                landmarks.double(), opts)
            return out.float(), c.float(), i.float(), s.float()
        qa, va, la = q.float(), v.float(), landmarks.float()
        def sim(x, y, dt):
            return R.similarity(x.to(dt), y.to(dt), opts.lam, opts.kernel)
        c_q = sim(qa, la, D if 'cq' in flags else f)
        c_k = c_q if k is None else sim(k, la, D if 'ck' in flags else f)
        if k is None and 'ck' in flags and 'cq' not in flags:
            c_k = sim(qa, la, D)
        P = R.landmark_system(la, opts.lam, opts.eps, opts.kernel)
        rhs_dt = D if 'rhs' in flags else f
        if 'rhs_centred64' in flags:
            rhs = R.landmark_rhs(c_k.float(), va)  # the common part in fp64, as adopted
        elif 'rhs_centred' in flags:
            rhs = centred_rhs(c_k.float(), va)
        elif 'rhs_chunk' in flags:
            rhs = chunked_rhs(c_k.float(), va)
        else:
            rhs = torch.matmul(c_k.to(rhs_dt).transpose(-1, -2), va.to(rhs_dt)).float()
        context, inverse = R.solve_context(P, rhs, opts)
        # whitening
        C = c_q if 'keep64' in flags else c_q.float()
        cdt = D if 'centre' in flags else C.dtype
        centred = (C.to(cdt) - C.to(cdt).mean(-1, keepdim=True))
        if 'centre2' in flags:
            # Two-pass centring in fp32 (exact in math): the second pass removes the first
            # mean's rounding, which is common to a row and so adds up coherently over j.
            centred = centred - centred.mean(-1, keepdim=True)
        centred = centred if 'keep64' in flags else centred.float()
        sdt = D if 'stats' in flags else centred.dtype
        cs = centred.to(sdt)
        mean = cs.mean(-2, keepdim=True)
        var = (cs - mean).square().mean(-2, keepdim=True)
        scale = R.whitening_scale(var, opts.whiten_eps)
        STATS.append((float(var.min()), float(scale.max()), float((var < 1e-5).float().mean()),
                      float(c_q.max()), float(c_q.min())))
        z = centred.to(scale.dtype) * scale + 1.0 / C.shape[-1]
        z = z if 'keep64' in flags else z.float()
        odt = D if 'out' in flags else f
        out = torch.matmul(z.to(odt), context.to(odt)).float()
        return out.to(q.dtype), context, inverse, torch.cat((mean.float(), scale.float()), -2)
    return fwd


VARIANTS = {
    'fp32 (probe copy)': set(), 'ORIG fp32': None, 'all fp64': {'all'},
    '(1) stats fp64': {'stats'}, '(2) centring fp64': {'centre'},
    '(1+2) centre+stats': {'centre', 'stats'},
    '(3a) c_q fp64 (cast)': {'cq'}, '(3b) c_k fp64 (cast)': {'ck'},
    '(3c) c_q+whiten fp64, no cast': {'cq', 'centre', 'stats', 'keep64'},
    '(4) rhs fp64': {'rhs'}, '(5) out fp64': {'out'},
    '(3c)+(5)': {'cq', 'centre', 'stats', 'keep64', 'out'},
    '(4)+(3b) c_k and rhs fp64, no cast': {'ck', 'rhs'},
    '(4)+(3c)': {'rhs', 'cq', 'centre', 'stats', 'keep64'},
    '(4)+(3c)+(5)': {'rhs', 'cq', 'centre', 'stats', 'keep64', 'out'},
    '(4)+(1+2)': {'rhs', 'centre', 'stats'},
    '(4b) rhs fp32, centred form': {'rhs_centred'},
    '(4c) rhs fp32, 512-row chunks pairwise': {'rhs_chunk'},
    '(4)+(1) stats': {'rhs', 'stats'},
    '(4)+(2) centring': {'rhs', 'centre'},
    '(4c)+(1+2)': {'rhs_chunk', 'centre', 'stats'},
    '(4c)+(2)': {'rhs_chunk', 'centre'},
    '(2b) two-pass centring fp32': {'centre2'},
    '(4)+(2b)': {'rhs', 'centre2'},
    '(4c)+(2b) all fp32': {'rhs_chunk', 'centre2'},
    '(4b)+(2b) centred rhs, two-pass centring, all fp32': {'rhs_centred', 'centre2'},
    '(4b)+(2) centred rhs, centring fp64': {'rhs_centred', 'centre'},
    '(4d) centred rhs, common part fp64': {'rhs_centred64'},
    '(4d)+(2b)': {'rhs_centred64', 'centre2'},
    '(4d)+(2)': {'rhs_centred64', 'centre'},
}
if len(sys.argv) > 1 and sys.argv[1] == '--fp32fix':
    VARIANTS = {k: VARIANTS[k] for k in ('ORIG fp32', 'all fp64', '(4c)+(2)',
                '(2b) two-pass centring fp32', '(4)+(2b)', '(4c)+(2b) all fp32')}
    del sys.argv[1]
if len(sys.argv) > 1 and sys.argv[1] == '--extra':
    VARIANTS = {k: VARIANTS[k] for k in ('ORIG fp32', 'all fp64', '(4) rhs fp64',
                '(4)+(1) stats', '(4)+(2) centring', '(4)+(1+2)',
                '(4c) rhs fp32, 512-row chunks pairwise', '(4c)+(1+2)', '(4c)+(2)')}
    del sys.argv[1]
if len(sys.argv) > 1 and sys.argv[1] == '--centred':
    VARIANTS = {k: VARIANTS[k] for k in (
        'ORIG fp32', 'all fp64', '(4) rhs fp64', '(4b) rhs fp32, centred form',
        '(2b) two-pass centring fp32', '(4b)+(2b) centred rhs, two-pass centring, all fp32',
        '(4)+(2b)', '(4b)+(2) centred rhs, centring fp64', '(4)+(2) centring',
        '(4d) centred rhs, common part fp64', '(4d)+(2b)', '(4d)+(2)')}
    del sys.argv[1]
if len(sys.argv) > 1 and sys.argv[1] == '--quick':
    VARIANTS = {k: VARIANTS[k] for k in ('ORIG fp32', 'all fp64', '(4) rhs fp64',
                '(4b) rhs fp32, centred form', '(4c) rhs fp32, 512-row chunks pairwise')}
    del sys.argv[1]


def main():
    torch.manual_seed(0)
    model = build_backbone('laplacianformer-t').eval()
    for layer in model.modules():
        if isinstance(layer, LaplacianAttention):
            layer.options = dataclasses.replace(layer.options, impl='reference')
    m64 = copy.deepcopy(model).double()
    seeds = [int(s) for s in sys.argv[1:]] or [3, 4]
    xs = [deploy.toy_image_input((480, 736), 1, seed=s) for s in seeds]
    with torch.no_grad():
        refs = [[o for o in m64(x.double())] for x in xs]
        names = list(VARIANTS)
        for name in names:
            flags = VARIANTS[name]
            R.forward = ORIG if flags is None else probe_forward(flags)
            STATS.clear()
            t = time.perf_counter()
            rows = []
            for x, ref in zip(xs, refs):
                outs = model(x)
                rows.append([float((o.double() - r).abs().max() / r.abs().max())
                             for o, r in zip(outs, ref)])
            R.forward = ORIG
            cells = ' | '.join(' / '.join(f'{r[i]:.1e}' for r in rows) for i in range(4))
            print(f'| {name} | {cells} | {time.perf_counter() - t:.0f}s', flush=True)
            if name == 'fp32 (probe copy)':
                per_layer = STATS[:len(STATS) // len(xs)]
                for i, (vmin, smax, frac, cmax, cmin) in enumerate(per_layer):
                    print(f'#   layer {i}: min var {vmin:.2e}, max s {smax:.1f}, share of '
                          f'columns var<1e-5 {frac:.2f}, c_q in [{cmin:.2e}, {cmax:.2e}]')


def pooling(seed, sizes=((480, 736), (608, 800)), images=3):
    """Per size, impl and pooling: the worst over ``images`` toy scenes of each stage's
    max|out - fp64| / max|fp64|, the parity table's statistic."""
    orig = R.pool_landmarks

    def pool(how):
        def fn(t, hw, grid, export=False):
            if t.dtype == D:
                return orig(t, hw, grid, export)
            wide = t.double() if how.endswith('64') else t
            out = (R.pool_landmarks_export(wide, hw, grid) if how.startswith('export')
                   else orig(wide, hw, grid, False))
            return out.to(t.dtype)
        return fn

    torch.manual_seed(seed)
    module = deploy.ExportModule(build_backbone('laplacianformer-t'))
    module64 = copy.deepcopy(module).double()
    reference = copy.deepcopy(module)
    for layer in reference.modules():
        if isinstance(layer, LaplacianAttention):
            layer.options = dataclasses.replace(layer.options, impl='reference')
    print('| size | impl | pooling | stage 1 | stage 2 | stage 3 | stage 4 |')
    print('|---|---|---|---|---|---|---|')
    with torch.no_grad():
        for size in sizes:
            xs = [deploy.toy_image_input(size, 1, seed=3 + i) for i in range(images)]
            refs = [list(module64(x.double())) for x in xs]
            for impl, model in (('cpu', module), ('reference', reference)):
                for how in ('aten', 'aten64', 'export32', 'export64'):
                    R.pool_landmarks = pool(how)
                    try:
                        errs = [[deploy.output_error([o], [r])['max_rel']
                                 for o, r in zip(model(x), ref)] for x, ref in zip(xs, refs)]
                    finally:
                        R.pool_landmarks = orig
                    cells = ' | '.join(f'{max(e[s] for e in errs):.1e}' for s in range(4))
                    print(f'| {size[0]}x{size[1]} | {impl} | {how} | {cells} |', flush=True)


def timing(repeats=20):
    """reference.forward at the first stage-1 call's arguments: fp32 vs chunked rhs, alternated."""
    torch.manual_seed(0)
    model = build_backbone('laplacianformer-t').eval()
    for layer in model.modules():
        if isinstance(layer, LaplacianAttention):
            layer.options = dataclasses.replace(layer.options, impl='reference')
    captured = []
    R.forward = lambda *a, **kw: captured.append(a) or ORIG(*a, **kw)
    with torch.no_grad():
        model(deploy.toy_image_input((480, 736), 1, seed=3))
    R.forward = ORIG
    args = captured[0]
    print('# stage-1 args:', [tuple(t.shape) if t is not None else None for t in args[:4]])
    runs = {'fp32': ORIG, 'rhs chunked': probe_forward({'rhs_chunk'}),
            'probe copy fp32': probe_forward(set()),
            'rhs chunked + centring fp64': probe_forward({'rhs_chunk', 'centre'}),
            'rhs chunked + two-pass centring fp32': probe_forward({'rhs_chunk', 'centre2'})}
    times = {k: [] for k in runs}
    with torch.no_grad():
        for _ in range(repeats):
            for name, fn in runs.items():
                t = time.perf_counter()
                fn(*args)
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        ts.sort()
        print(f'# {name}: median {1e3 * ts[len(ts) // 2]:.2f} ms, min {1e3 * ts[0]:.2f} ms')


if __name__ == '__main__':
    if sys.argv[1:] == ['--time']:
        timing()
    elif sys.argv[1:2] == ['--pooling']:
        pooling(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    else:
        main()
