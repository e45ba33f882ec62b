"""The hot loops of the CUDA kernels compile to the instruction counts docs/cuda.md states.

NVRTC (sm_90, CuPy's options) and nvdisasm from pip; no GPU. The bounds hold the
desk-review fixes in place: |x - y| folded into the FADD as an operand modifier
(2 FADDs per Laplacian term, down from 5.2 instructions), the gradient's sign as a
3-way select (6 per term, down from 9) and Newton–Schulz products from shared memory
with 16-byte loads (1.4 per FMA, down from 3.75 with generic loads).
"""
import pytest

from devtools import sass

# Compiling and disassembling every kernel takes about 50 s on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope='module')
def rows():
    if not sass.find_nvdisasm():
        pytest.fail('nvdisasm not found: pip install nvidia-cuda-nvdisasm (requirements/tests.txt)')
    return {r['kernel']: r for r in sass.report()}


@pytest.mark.parametrize('kernel, max_per_term', [
    ('pairwise_forward<float, 0>', 3.3),
    ('pairwise_backward<float, 0, false>', 6.0),
    ('pairwise_backward<float, 0, true>', 6.0),
    ('newton_schulz<float, true>', 1.4),
    # The fused attention's kernel tiles (ops/nystrom_attention.cu), 2026-12-01: 3.28, 3.47,
    # 3.22 and 4.05 (its 32-row tile stages 6 values per 8 terms).
    ('nys_forward_stats<float, 0>', 3.3),
    ('nys_forward_out<float, 0>', 3.5),
    ('nys_backward_reduce<float, 0>', 3.3),
    ('nys_backward_grads<float, 0>', 4.1),
])
def test_hot_loop_instructions_per_term(rows, kernel, max_per_term):
    row = rows[kernel]
    assert row['terms'] > 0 and row['per_term'] <= max_per_term, row


def test_laplacian_terms_use_the_abs_modifier_and_no_integer_sign(rows):
    forward = rows['pairwise_forward<float, 0>']['histogram']
    assert forward['FADD'] == 2 * 256 and 'FSETP' not in forward
    backward = rows['pairwise_backward<float, 0, false>']['histogram']
    assert 'I2FP' not in backward and 'FFMA' not in backward
    for name in ('nys_forward_stats', 'nys_forward_out', 'nys_backward_reduce',
                 'nys_backward_grads'):
        row = rows[f'{name}<float, 0>']
        assert row['histogram']['FADD'] == 2 * row['terms'] and 'FSETP' not in row['histogram']


def test_newton_schulz_reads_shared_memory_directly(rows):
    """P in shared memory is a template argument: no generic (LD) loads in the products."""
    shared = rows['newton_schulz<float, true>']['histogram']
    assert 'LD' not in shared and 'LDG' not in shared and shared['LDS'] == 8
    global_p = rows['newton_schulz<float, false>']['histogram']
    assert 'LD' not in global_p and global_p['LDG'] == 16
