"""Toy scenes: a textured background with a few filled shapes painted back to front, later
ones occluding earlier ones; every class has its own shape and colour family (with jitter).
The toy data sets (``tools/make_toy_coco.py``, ``tools/make_toy_imagenet.py``) and the
deploy checks' inputs (:func:`lapformer_mm.deploy.toy_image_input`) draw them."""
import cv2
import numpy as np

CLASSES = ('circle', 'square', 'triangle', 'star')
# One base colour per class (BGR, as OpenCV writes it); each object jitters it.
BASE_COLOURS = {
    'circle': (40, 40, 220),
    'square': (40, 200, 40),
    'triangle': (220, 90, 30),
    'star': (30, 210, 230),
}
MIN_VISIBLE_FRACTION = 0.5
MIN_VISIBLE_AREA = 30


def shape_polygon(name, centre, size, angle):
    """(K, 2) float (x, y) vertices of one shape of diameter ``size`` px, rotated by ``angle``."""
    if name == 'circle':
        t = np.linspace(0, 2 * np.pi, 40, endpoint=False)
        radii = np.full_like(t, size / 2)
    elif name == 'square':
        t = np.arange(4) * np.pi / 2 + np.pi / 4
        radii = np.full_like(t, size / 2 * np.sqrt(2) * 0.8)
    elif name == 'triangle':
        t = np.arange(3) * 2 * np.pi / 3 - np.pi / 2
        radii = np.full_like(t, size / 2)
    elif name == 'star':
        t = np.arange(10) * np.pi / 5 - np.pi / 2
        radii = np.where(np.arange(10) % 2 == 0, size / 2, size / 5)
    else:
        raise ValueError(f'name must be one of {CLASSES}, got {name!r}')
    t = t + angle
    xs = centre[0] + radii * np.cos(t)
    ys = centre[1] + radii * np.sin(t)
    return np.stack([xs, ys], axis=1)


def textured_background(rng, width, height):
    """A (height, width, 3) uint8 background: gradient + stripes + noise."""
    size = max(width, height)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32) / size
    c0 = rng.uniform(60, 190, 3)
    c1 = rng.uniform(60, 190, 3)
    direction = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(direction) * xx + np.sin(direction) * yy + 1) / 2
    img = c0 * (1 - ramp[..., None]) + c1 * ramp[..., None]
    period = rng.uniform(6, 24)
    phase = rng.uniform(0, 2 * np.pi)
    theta = rng.uniform(0, np.pi)
    stripes = np.sin((np.cos(theta) * xx + np.sin(theta) * yy) * size /
                     period * 2 * np.pi + phase)
    img = img + 12 * stripes[..., None]
    img = img + rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def rasterize(poly, width, height):
    mask = np.zeros((height, width), np.uint8)
    pts = np.round(poly * 16).astype(np.int32)  # 4 fractional bits
    cv2.fillPoly(mask, [pts], 1, lineType=cv2.LINE_8, shift=4)
    return mask


def visible_polygons(mask):
    """COCO polygons ([x1, y1, x2, y2, ...] lists) of a binary mask."""
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL,
                                   cv2.CHAIN_APPROX_SIMPLE)
    polys = []
    for c in contours:
        if len(c) >= 3:
            # Pixel-corner convention: a pixel (x, y) covers [x, x+1).
            polys.append([float(v) + 0.5 for v in c.reshape(-1)])
    return polys


def sample_objects(rng, width, height, max_objects):
    """(class, centre, size, angle, colour) of one image's objects, sized relative to the
    shorter side so that scenes look alike at any resolution."""
    img_size = min(width, height)
    n = int(rng.integers(2, max_objects + 1))
    objects = []
    for _ in range(n):
        name = CLASSES[int(rng.integers(len(CLASSES)))]
        # Log-uniform sizes: many small objects, some medium/large ones.
        size = float(np.exp(rng.uniform(np.log(0.2), np.log(0.6))) *
                     img_size)
        margin = size * 0.3
        centre = rng.uniform(margin, np.array([width, height]) - margin, 2)
        angle = float(rng.uniform(0, 2 * np.pi))
        colour = np.clip(
            np.array(BASE_COLOURS[name]) + rng.integers(-35, 36, 3), 0, 255)
        objects.append((name, centre, size, angle, colour))
    return objects


def visible_masks(full_masks):
    """Visible part of each (H, W) uint8 mask when painted in list order."""
    covered = 0
    visible = []
    for mask in full_masks[::-1]:
        visible.append(mask & (1 - covered))
        covered = covered | mask
    return visible[::-1]


def first_hidden(full_masks, visible):
    for i, (mask, vis) in enumerate(zip(full_masks, visible)):
        if (vis.sum() < MIN_VISIBLE_AREA
                or vis.sum() < MIN_VISIBLE_FRACTION * mask.sum()):
            return i
    return None


def render_image(rng, width, height, max_objects):
    """Image (H, W, 3) uint8, its annotations [(class index, polys)] and label map (0 =
    background, class index + 1); mostly hidden objects are dropped before painting, so every
    visible shape is annotated."""
    img = textured_background(rng, width, height)
    objects = sample_objects(rng, width, height, max_objects)
    full_masks = [
        rasterize(shape_polygon(name, centre, size, angle), width, height)
        for name, centre, size, angle, _ in objects
    ]
    while True:
        visible = visible_masks(full_masks)
        hidden = first_hidden(full_masks, visible)
        if hidden is None:
            break
        del objects[hidden], full_masks[hidden]
    annotations = []
    label_map = np.zeros((height, width), np.uint8)
    for (name, *_, colour), mask, vis in zip(objects, full_masks, visible):
        shade = rng.normal(0, 5, img.shape)
        painted = np.clip(colour + shade, 0, 255).astype(np.uint8)
        img[mask.astype(bool)] = painted[mask.astype(bool)]
        # Every visible pixel, even of a sliver too thin for a COCO polygon:
        # the label map describes the painted image exactly.
        label_map[vis.astype(bool)] = CLASSES.index(name) + 1
        polys = visible_polygons(vis)
        if polys:
            annotations.append((CLASSES.index(name), polys))
    return img, annotations, label_map
