"""Input images for the analyses: read from a folder, or synthesised per seed as 1/f (pink)
noise with a few soft blobs (the power spectrum of photographs, not photographs)."""
import os
import os.path as osp

import numpy as np
import torch

IMAGENET_MEAN = np.array([123.675, 116.28, 103.53], dtype=np.float32)
IMAGENET_STD = np.array([58.395, 57.12, 57.375], dtype=np.float32)
IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp')


def pink_noise(size, rng, exponent=1.0):
    height, width = size
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    freq = np.sqrt(fy ** 2 + fx ** 2)
    freq[0, 0] = 1.0
    spectrum = (rng.standard_normal(freq.shape) + 1j * rng.standard_normal(freq.shape))
    field = np.fft.irfft2(spectrum / freq ** exponent, s=(height, width))
    field -= field.min()
    return field / max(field.max(), 1e-12)


def synthetic_image(size, seed):
    rng = np.random.default_rng(seed)
    height, width = size
    image = np.stack([pink_noise(size, rng) for _ in range(3)], axis=-1)
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(rng.integers(2, 5)):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        radius = rng.uniform(0.08, 0.25) * min(height, width)
        alpha = 1.0 / (1.0 + np.exp((np.hypot(yy - cy, xx - cx) - radius) / 2.0))
        colour = rng.uniform(0, 1, size=3)
        image = image * (1 - alpha[..., None]) + colour * alpha[..., None]
    return (image * 255).clip(0, 255).astype(np.uint8)


def list_images(folder):
    names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_SUFFIXES))
    if not names:
        raise ValueError(f'no images with suffix {IMAGE_SUFFIXES} in {folder!r}')
    return [osp.join(folder, n) for n in names]


def read_image(path, size):
    import cv2
    bgr = cv2.imread(path, cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f'cannot read image {path!r}')
    bgr = cv2.resize(bgr, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return bgr[..., ::-1].copy()


def load_images(folder, num_images, size, seed=0):
    if folder:
        return [read_image(p, size) for p in list_images(folder)[:num_images]]
    return [synthetic_image(size, seed + i) for i in range(num_images)]


def to_tensor(images):
    batch = (np.stack(images).astype(np.float32) - IMAGENET_MEAN) / IMAGENET_STD
    return torch.from_numpy(batch).permute(0, 3, 1, 2).contiguous()
