# LaplacianFormer-Tiny on ImageNet-1k, 16 GPUs x 64 images, 300 epochs (recipe in _base_).
_base_ = ['./_base_/lapformer_in1k.py']

model = dict(backbone=dict(arch='tiny', drop_path_rate=0.1))
