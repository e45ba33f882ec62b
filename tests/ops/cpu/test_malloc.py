"""lapformer_mm.cpu_malloc: large CPU tensors are reused instead of page-faulted in afresh."""
import os
import subprocess
import sys

import pytest
from _shared import ROOT

from lapformer_mm.cpu_malloc import keep_large_blocks

# Median minor page faults of allocating a fresh 64 MiB tensor (16 384 pages of 4 KiB), after
# warm-up allocations (glibc reuses a freed block once its neighbours merged: up to four).
FAULTS_PER_ALLOCATION = '''
import resource, statistics, sys
import torch
from lapformer_mm.cpu_malloc import keep_large_blocks
if sys.argv[1] == 'keep':
    assert keep_large_blocks()
x = torch.ones(16 * 2**20)
for _ in range(8):
    y = x + 1
    del y
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = x + 1
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del y
print(statistics.median(faults))
'''


def faults_per_allocation(mode):
    proc = subprocess.run([sys.executable, '-c', FAULTS_PER_ALLOCATION, mode], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1'),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='glibc malloc')
def test_large_tensors_are_reused_instead_of_faulted_in():
    pages = 64 * 2**20 / 4096
    assert faults_per_allocation('default') > 0.9 * pages  # glibc's fresh mmap per tensor
    assert faults_per_allocation('keep') < 0.05 * pages


@pytest.mark.parametrize('threshold', [0, -1, 2**31, 1.5, '1G'])
def test_threshold_must_fit_a_c_int(threshold):
    with pytest.raises(ValueError, match='threshold'):
        keep_large_blocks(threshold)
