"""Install lapformer_mm. The CUDA sources in ``ops/`` ship as ``lapformer_mm/_cuda_src``."""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def package_constant(name):
    """A string constant of lapformer_mm/__init__.py, read without importing torch."""
    text = (HERE / 'lapformer_mm' / '__init__.py').read_text()
    return re.search(rf"^{name} = '([^']+)'", text, re.M).group(1)


setup(
    name='lapformer_mm',
    version=package_constant('__version__'),
    description='LaplacianFormer (Laplacian-kernel linear attention) backbones for '
                'OpenMMLab detection and segmentation',
    long_description=(HERE / 'README.md').read_text(encoding='utf-8'),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.9',
    packages=find_packages(include=['lapformer_mm', 'lapformer_mm.*']) + ['lapformer_mm._cuda_src'],
    package_dir={'lapformer_mm._cuda_src': 'ops'},
    package_data={'lapformer_mm._cuda_src': ['*.cu', '*.cuh']},
    install_requires=[f"torch>={package_constant('TORCH_FLOOR')}", 'numpy', 'mmengine>=0.10,<1'],
    extras_require={
        'det': ['mmcv>=2.0.0,<2.2.0', 'mmdet>=3.3,<3.4', 'pycocotools'],
        'seg': ['mmcv>=2.0.0,<2.2.0', 'mmsegmentation>=1.2,<1.3', 'ftfy', 'regex'],
        'cls': ['mmcv>=2.0.0,<2.2.0', 'mmpretrain>=1.2,<1.3', 'torchvision'],
        'cuda12': ['cupy-cuda12x>=13'],
        'cuda13': ['cupy-cuda13x>=13'],
        # ONNX export (both exporters) and its check on ONNX Runtime (lapformer_mm.deploy).
        'deploy': ['onnx>=1.16', 'onnxscript>=0.5', 'onnxruntime>=1.17'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'License :: OSI Approved :: Apache Software License',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    zip_safe=False,
)
