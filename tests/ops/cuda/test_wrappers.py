"""The CUDA backend imports where the GPU check runs: torch and CuPy, no OpenMMLab package.

Its host code is covered by ``test_host_path.py`` (a fake CuPy), its kernels by
``test_fused_emulation.py`` and, on a GPU, ``test_attention_gpu.py``.
"""


def test_cuda_backend_imports_without_openmmlab():
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
import lapformer_mm.ops.backends.cuda
import lapformer_mm.ops.attention
print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED))
'''
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[]'
