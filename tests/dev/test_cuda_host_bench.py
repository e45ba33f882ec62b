"""benchmarks/cuda_host.py runs end to end on the CPU (it never asserts on time)."""
from benchmarks import cuda_host


def test_host_benchmark_prints_times_and_counts(capsys):
    assert cuda_host.main(['--repeats', '20']) == 0
    text = capsys.readouterr().out
    assert '| entry fwd+bwd |' in text and '| register_autograd: fwd+bwd |' in text
    assert '| forward | 4 | 5 | 9 |' in text and '| forward+backward | 9 | 16 | 25 |' in text
