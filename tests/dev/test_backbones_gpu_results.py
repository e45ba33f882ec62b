"""benchmarks/backbones_gpu.py's JSON file and verdict, on the CPU (the timing needs a GPU)."""
import json

import pytest

from benchmarks import backbones_gpu as bench


def rows(ours_ms, pvt_ms=10.0, swin_ms=12.0, graphed_ours=1.0):
    out = []
    for mode in bench.MODES:
        for dtype in bench.DTYPES:
            out.append(bench.make_row('laplacianformer-t', mode, dtype, False, ours_ms, 50, 900))
            out.append(bench.make_row('laplacianformer-t', mode, dtype, True, graphed_ours, 50))
            out.append(bench.make_row('pvtv2-b1', mode, dtype, False, pvt_ms, 150, 1200.5))
            out.append(bench.make_row('swin-t', mode, dtype, False, swin_ms, 200, 1500))
    return out


def test_json_has_exactly_the_issue_format(tmp_path):
    path = tmp_path / 'sub' / 'backbones_h200.json'
    bench.write_results(path, rows(7.0), 'NVIDIA H200', 'python3 benchmarks/backbones_gpu.py',
                        date='2026-12-02')
    doc = json.loads(path.read_text())
    assert list(doc) == ['date', 'device', 'command', 'rows']
    assert doc['date'] == '2026-12-02' and doc['device'] == 'NVIDIA H200'
    assert len(doc['rows']) == 4 * len(bench.MODES) * len(bench.DTYPES)
    for row in doc['rows']:
        assert list(row) == ['model', 'mode', 'dtype', 'graphed', 'ms', 'launches', 'peak_mib']
        assert row['model'] in ('laplacianformer-t', 'pvtv2-b1', 'swin-t')
        assert row['mode'] in ('fwd', 'fwdbwd') and row['dtype'] in ('fp32', 'bf16', 'fp16')
        assert isinstance(row['graphed'], bool) and isinstance(row['ms'], float)
        assert row['launches'] is None or isinstance(row['launches'], int)
        assert row['peak_mib'] is None or isinstance(row['peak_mib'], float)
    graphed = [r for r in doc['rows'] if r['graphed']]
    assert graphed and all(r['peak_mib'] is None for r in graphed)
    default_date = bench.results_document([], 'cpu', 'x')['date']
    assert len(default_date) == 10 and default_date[4] == '-' and default_date[7] == '-'


def test_rows_outside_the_format_are_refused():
    with pytest.raises(ValueError, match="'vit-b'"):
        bench.make_row('vit-b', 'fwd', 'fp32', False, 1.0)
    with pytest.raises(ValueError, match="'tf32'"):
        bench.make_row('swin-t', 'fwd', 'tf32', False, 1.0)


def test_verdict_compares_eager_rows_with_the_faster_baseline():
    # 8 ms against min(10, 12) = 10: ratio 0.8 passes; 8.1 fails; graphed rows never count.
    passed = bench.verdicts(rows(8.0, graphed_ours=100.0))
    assert len(passed) == 6 and all(v[-1] == 'PASS' for v in passed)
    assert all(v[3] == 'pvtv2-b1' and v[5] == pytest.approx(0.8) for v in passed)
    failed = bench.verdicts(rows(8.1))
    assert all(v[-1] == 'FAIL' for v in failed)
    swin_faster = bench.verdicts(rows(9.0, pvt_ms=20.0, swin_ms=11.5))
    assert all(v[3] == 'swin-t' and v[-1] == 'PASS' for v in swin_faster)


def test_verdict_marks_missing_sides_not_measured():
    some = [r for r in rows(5.0) if not (r['model'] != 'laplacianformer-t' and r['mode'] == 'fwd'
                                         and r['dtype'] == 'fp16')]
    some = [r for r in some if not (r['model'] == 'laplacianformer-t' and r['mode'] == 'fwdbwd'
                                    and r['dtype'] == 'bf16' and not r['graphed'])]
    by_key = {(v[0], v[1]): v[-1] for v in bench.verdicts(some)}
    assert by_key[('fwd', 'fp16')] == 'FAIL (not measured)'
    assert by_key[('fwdbwd', 'bf16')] == 'FAIL (not measured)'
    assert by_key[('fwd', 'fp32')] == 'PASS'
    text = bench.markdown(some, bench.verdicts(some))
    assert 'FAIL (not measured)' in text and '| laplacianformer-t | fwd | fp32 | True |' in text


def test_the_script_needs_a_gpu(monkeypatch):
    monkeypatch.setattr('torch.cuda.is_available', lambda: False)
    with pytest.raises(SystemExit, match='needs a CUDA device'):
        bench.main([])


def test_the_json_holds_each_row_as_soon_as_it_is_measured(monkeypatch, tmp_path):
    """The file is written after each row, not at the end (a time limit may stop the run)."""
    path = tmp_path / 'backbones_h100.json'
    seen = []

    def measure(name, args, keep):
        if path.exists():
            seen.append([row['model'] for row in json.loads(path.read_text())['rows']])
        keep(bench.make_row(name, 'fwd', 'fp32', False, 1.0))
        return []
    monkeypatch.setattr('torch.cuda.is_available', lambda: True)
    monkeypatch.setattr('torch.cuda.get_device_name', lambda device=None: 'NVIDIA H100')
    monkeypatch.setattr(bench, 'measure', measure)
    assert bench.main(['--json', str(path), '--models', 'pvtv2-b1', 'swin-t']) == 0
    assert seen == [['pvtv2-b1']]
    assert [row['model'] for row in json.loads(path.read_text())['rows']] == ['pvtv2-b1', 'swin-t']
