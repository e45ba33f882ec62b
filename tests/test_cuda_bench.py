"""tools/bench_ops.py runs end to end (CPU rows only here; it never asserts on time)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location('bench_ops', ROOT / 'tools' / 'bench_ops.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_cpu_smoke(tmp_path):
    bench = load_bench()
    results = bench.main(['--device', 'cpu', '--n', '40', '--m', '9', '--bh', '2', '--d', '8',
                          '--min-time-s', '0', '--sections', 'kernel', 'attention', 'newton_schulz',
                          '--out', str(tmp_path)])
    assert results and all(r['status'] == 'ok' for r in results), results
    assert {r['section'] for r in results} == {'kernel', 'attention', 'newton_schulz'}
    saved = json.loads((tmp_path / 'bench_ops.json').read_text())
    assert len(saved['results']) == len(results)
    text = (tmp_path / 'bench_ops.md').read_text()
    assert 'not measured' in text  # no fused rows without a GPU
