"""LaplacianFormer for OpenMMLab: Laplacian-kernel linear attention backbones."""
__version__ = '0.1.0'
