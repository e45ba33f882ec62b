"""benchmarks/cuda_ops.py runs end to end (CPU rows only here; it never asserts on time)."""
import json

import torch

from benchmarks import cuda_ops as bench


def test_bench_cpu_smoke(tmp_path):
    results, failed = bench.main(['--device', 'cpu', '--n', '40', '--m', '9', '--bh', '2',
                                  '--d', '8', '--min-time-s', '0', '--sections', 'kernel',
                                  'attention', 'newton_schulz', '--out', str(tmp_path)])
    assert results and all(r['status'] == 'ok' for r in results), results
    assert {r['section'] for r in results} == {'kernel', 'attention', 'newton_schulz'}
    saved = json.loads((tmp_path / 'bench_ops.json').read_text())
    assert len(saved['results']) == len(results)
    text = (tmp_path / 'bench_ops.md').read_text()
    # No fused rows without a GPU: every target is unmeasured, which fails the run.
    assert failed and text.count('FAIL (not measured)') == len(bench.target_summary(results))


def target_rows(fused_ms, errored=False):
    """Rows of every target with the reference at 10 ms and the fast side at fused_ms."""
    n, bh = bench.TARGET_N, bench.TARGET_BH
    k = dict(section='kernel', n=n, m=49, bh=bh, mode='fwd+bwd', status='ok')
    a = dict(section='attention', n=n, bh=bh, mode='fwd+bwd', status='ok')
    rows = [dict(k, method='laplacian reference', ms=10.0),
            dict(k, method='laplacian fused', ms=fused_ms),
            dict(a, method='softmax sdpa flash', m=None, ms=10.0),
            dict(a, method='nystrom cupy', m=49, dtype='fp32', ms=fused_ms)]
    for m in (49, 64):
        ns = dict(section='newton_schulz', m=m, bh=64, mode='fwd', status='ok')
        rows += [dict(ns, method='bmm iterations', ms=10.0), dict(ns, method='fused', ms=fused_ms)]
    if errored:
        rows[1]['status'] = 'error: CudaOpsError: launch failed'
    return rows


def test_targets_pass_fail_and_errors():
    assert bench.failures(target_rows(fused_ms=1.0)) == ([], [])
    errors, missed = bench.failures(target_rows(fused_ms=1.0, errored=True))
    assert len(errors) == 1 and [t[0] for t in missed] == [bench.target_summary([])[0][0]]
    # 10 / 2.5 = 4x: the 5x kernel target is missed, the 3x solver and 1x attention ones hold.
    _, missed = bench.failures(target_rows(fused_ms=2.5))
    assert [t[2] for t in missed] == [5.0]
    assert bench.target_verdict(None, 3.0) == 'FAIL (not measured)'
    assert bench.target_verdict(3.0, 3.0) == 'PASS' and bench.target_verdict(2.99, 3.0) == 'FAIL'


def test_cdist_backward_row_left_out_past_int32_elements():
    """torch.cdist's CUDA backward faulted at (64, 66600, 49, 32) on the H200 (6.7e9 elements
    in its (batch, N, M, d) buffer): that row keeps only its forward from 2^31 elements on."""
    args = bench.parse_args(['--device', 'cpu', '--n', '66600', '--m', '49', '--bh', '4', '64',
                             '--sections', 'kernel'])
    modes = {(row['bh'], row['method']): row['modes']
             for row, _, _ in bench.kernel_rows(args, torch.device('cpu'))}
    assert modes[(64, 'laplacian cdist+exp')] == ('fwd',)
    assert modes[(4, 'laplacian cdist+exp')] == ('fwd', 'fwd+bwd')
    assert modes[(64, 'laplacian reference')] == ('fwd', 'fwd+bwd')
