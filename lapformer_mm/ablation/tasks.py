"""Synthetic tasks for the ablations, drawn from a generator (no files): a class with
``num_classes``, ``image_size`` and ``sample(num, generator)`` -> images (num, 3, S, S) in
[0, 1], int64 labels (num,); ``--task`` takes its key in :data:`TASKS`."""
import math

import torch

# Six saturated hues, 60° apart on the colour wheel (HSV with S = V = 1), in RGB.
HUES = torch.tensor([
    [1.0, 0.0, 0.0],  # red
    [1.0, 1.0, 0.0],  # yellow
    [0.0, 1.0, 0.0],  # green
    [0.0, 1.0, 1.0],  # cyan
    [0.0, 0.0, 1.0],  # blue
    [1.0, 0.0, 1.0],  # magenta
])


class SameColourTask:
    """"Same colour, far apart": are the two objects of the image the same hue?

    Each image is a dark noisy background (``background`` ± ``noise``) with two filled circles or
    squares of radius in ``radius`` (pixels), each of one of the six :data:`HUES`, their centres
    at least ``min_distance`` · ``image_size`` apart; label 1 when both hues agree (half the
    images). A linear head over mean-pooled per-token features scores g(a) + g(b), which cannot
    express "a equals b" over six hues: the features of one object must carry the other's hue
    across at least 0.55 of the image. Whether the local terms alone get there is what the
    sweep's control without the global term measures.
    """

    num_classes = 2

    def __init__(self, image_size=64, radius=(3.0, 6.0), min_distance=0.55, noise=0.05,
                 background=0.1):
        if not isinstance(image_size, int) or image_size < 16:
            raise ValueError(f'image_size must be an int >= 16, got {image_size!r}')
        low, high = radius
        if not 0 < low <= high:
            raise ValueError(f'radius must be (low, high) with 0 < low <= high, got '
                             f'{radius!r}')
        # Centres lie in [high, S - 1 - high]; their greatest distance is that square's
        # diagonal.
        reach = math.sqrt(2) * (image_size - 1 - 2 * high)
        if not 0 < min_distance * image_size < reach:
            raise ValueError(f'min_distance={min_distance!r} of image_size={image_size} '
                             f'leaves no room for two objects of radius up to {high}')
        self.image_size = image_size
        self.radius = (float(low), float(high))
        self.min_distance = float(min_distance)
        self.noise = float(noise)
        self.background = float(background)

    def _centres(self, num, generator):
        """Two centres (y, x) per image (num, 2, 2), at least min_distance·S apart; about a
        third of the pairs pass at the defaults, so a few redraws suffice."""
        low, high = self.radius[1], self.image_size - 1 - self.radius[1]
        need = self.min_distance * self.image_size
        centres = torch.empty(num, 2, 2)
        todo = torch.arange(num)
        while todo.numel():
            draw = low + (high - low) * torch.rand(todo.numel(), 2, 2, generator=generator)
            far = (draw[:, 0] - draw[:, 1]).norm(dim=-1) >= need
            centres[todo[far]] = draw[far]
            todo = todo[~far]
        return centres

    def layout(self, num, generator):
        """The scenes of ``num`` images, drawn from ``generator``: a dict of ``labels``
        (num,), ``hues`` (num, 2) indices into :data:`HUES`, ``centres`` (num, 2, 2) as
        (y, x), ``radii`` (num, 2) and ``squares`` (num, 2) bools (else circles)."""
        labels = torch.randint(0, 2, (num,), generator=generator)
        first = torch.randint(0, len(HUES), (num,), generator=generator)
        # A different hue: an offset of 1..5 around the wheel.
        offset = torch.randint(1, len(HUES), (num,), generator=generator)
        second = torch.where(labels.bool(), first, (first + offset) % len(HUES))
        centres = self._centres(num, generator)
        low, high = self.radius
        radii = low + (high - low) * torch.rand(num, 2, generator=generator)
        squares = torch.rand(num, 2, generator=generator) < 0.5
        return dict(labels=labels, hues=torch.stack([first, second], dim=1),
                    centres=centres, radii=radii, squares=squares)

    def render(self, scenes, generator):
        size = self.image_size
        num = len(scenes['labels'])
        images = (self.background
                  + self.noise * torch.randn(num, 3, size, size, generator=generator))
        coords = torch.arange(size, dtype=torch.float32)
        centres = scenes['centres']
        dy = coords.view(1, 1, size, 1) - centres[..., 0, None, None]  # (num, 2, S, 1)
        dx = coords.view(1, 1, 1, size) - centres[..., 1, None, None]  # (num, 2, 1, S)
        r = scenes['radii'][..., None, None]
        inside = torch.where(scenes['squares'][..., None, None],
                             torch.maximum(dy.abs(), dx.abs()) <= r,
                             dy * dy + dx * dx <= r * r)  # (num, 2, S, S)
        for obj in range(2):
            colour = HUES[scenes['hues'][:, obj]][:, :, None, None]  # (num, 3, 1, 1)
            images = torch.where(inside[:, obj, None], colour, images)
        return images.clamp_(0.0, 1.0)

    def sample(self, num, generator):
        scenes = self.layout(num, generator)
        return self.render(scenes, generator), scenes['labels']

    def describe(self):
        return (f'same_colour: {self.image_size}x{self.image_size}, 2 objects of radius '
                f'{self.radius[0]:g}-{self.radius[1]:g} px, centres >= '
                f'{self.min_distance:g}*{self.image_size} apart, {len(HUES)} hues')


TASKS = {'same_colour': SameColourTask}


def build_task(name, **kwargs):
    return TASKS[name](**kwargs)
