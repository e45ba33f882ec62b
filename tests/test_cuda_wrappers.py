"""The CUDA launches' host code, driven by a fake CuPy on the CPU.

The kernels themselves are covered by ``test_cuda_fused_emulation.py`` and, on a GPU,
``test_cuda_attention_gpu.py``.
"""
import pytest

from devtools import fake_cupy as fake_cupy_module
from devtools.fake_cupy import FakeCudaTensor as FakeTensor
from lapformer_mm.ops import cuda_runtime as rt


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(**kwargs):
        return fake_cupy_module.install(rt, monkeypatch.setattr, current_device=1, **kwargs)[0]
    return install


def test_launch_compiles_once_per_dtype_on_the_tensors_device_and_stream(fake_cupy):
    fake = fake_cupy()
    name = rt.pairwise_forward_name('float', rt.LAPLACIAN)
    for _ in range(2):
        rt.launch(rt.PAIRWISE_SOURCE, name, FakeTensor(), (1, 2, 3), (16, 16, 1), (1, 2),
                  shapes='x')
    rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_backward_name('float', rt.GAUSSIAN, True),
              FakeTensor(), (1, 1, 1), (16, 16, 1), ())
    compiles = [e for e in fake.events if e[0] == 'compile']
    assert len(compiles) == 1 and name in compiles[0][1] and len(compiles[0][1]) == 6
    assert compiles[0][2] == rt.NVRTC_OPTIONS and compiles[0][3] == 'nvrtc'
    launches = [e for e in fake.events if e[0] == 'launch']
    assert launches[0] == ('launch', name, (1, 2, 3), (16, 16, 1), 2, 0, 12345)
    assert len(launches) == 3


def test_launch_opts_into_large_dynamic_shared_memory_once(fake_cupy):
    fake = fake_cupy()
    name = rt.newton_schulz_name('float', True)
    for _ in range(2):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, name, FakeTensor(), (8,), (256, 1, 1), (),
                  shared_mem=49152)
    assert [e for e in fake.events if e[0] == 'optin'] == [('optin', 49152)]


def test_compile_and_launch_failures_name_kernel_and_shapes(fake_cupy):
    fake_cupy(fail_compile=True)
    with pytest.raises(rt.CudaOpsError, match=r'pairwise_forward<float, 0>.*oops'):
        rt.launch(rt.PAIRWISE_SOURCE, rt.pairwise_forward_name('float', 0), FakeTensor(), (1,),
                  (1,), ())
    fake_cupy(fail_launch=True)
    with pytest.raises(rt.CudaOpsError,
                       match=r'newton_schulz<float, true>.*x \(2, 3\).*too many resources'):
        rt.launch(rt.NEWTON_SCHULZ_SOURCE, rt.newton_schulz_name('float', True), FakeTensor(),
                  (1,), (1,), (), shapes='x (2, 3)')


def test_cuda_ops_import_without_openmmlab():
    """The GPU check machine has torch and CuPy but no OpenMMLab package."""
    import subprocess
    import sys

    from _shared import ROOT
    code = '''
import sys
BLOCKED = {'mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain'}
class Absent:
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, Absent())
import lapformer_mm.ops.cupy_ops
import lapformer_mm.ops.attention
print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))
'''
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[]'


