"""One ablation run on a toy task: the small LaplacianFormer classifier, trained from a seed.

The model (about 155 k parameters): LaplacianFormer with dims [32, 64, 128, 256], heads
[2, 2, 4, 8], depths [2, 2, 1, 1], of which only the stem and the first two stages are
built (``num_stages=2``, stride 8), the stage-2 tokens mean-pooled, a linear head.
AdamW, a linear warm-up then a cosine decay, gradients clipped at norm 5.
"""
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..models.backbone import LaplacianFormer, init_layer

TOY_ARCH = dict(embed_dims=[32, 64, 128, 256], num_heads=[2, 2, 4, 8], depths=[2, 2, 1, 1])
TOY_NUM_STAGES = 2
# The validation set's seed: one set for every variant and run seed.
VAL_SEED = 2**31 - 1
# The training stream's seed is the run seed plus this, so that it is not the stream of
# the model's initialisation.
DATA_SEED_OFFSET = 10**6
# Take-off: the running mean of the training loss over TAKEOFF_WINDOW steps falls below
# TAKEOFF_FRACTION of ln(num_classes), the loss of a uniform guess (the plateau).
TAKEOFF_WINDOW = 25
TAKEOFF_FRACTION = 0.8


class ToyClassifier(nn.Module):
    """The ablation model: the two-stage backbone, mean-pooled tokens, a linear head."""

    def __init__(self, attn_cfg, num_classes, in_channels=3):
        super().__init__()
        self.backbone = LaplacianFormer(
            arch=TOY_ARCH, in_channels=in_channels, num_stages=TOY_NUM_STAGES,
            out_indices=(TOY_NUM_STAGES - 1, ), drop_path_rate=0.0, attn_cfg=attn_cfg)
        self.head = nn.Linear(self.backbone.embed_dims[-1], num_classes)
        self.backbone.init_weights()
        init_layer(self.head)

    def forward(self, images):
        # Images in [0, 1] -> about zero mean, unit range.
        features = self.backbone((images - 0.5) / 0.5)[-1]
        return self.head(features.mean(dim=(2, 3)))


def running_mean(values, window):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def takeoff_step(losses, num_classes, window=TAKEOFF_WINDOW, fraction=TAKEOFF_FRACTION,
                 steps=None):
    """The first of ``steps`` (default 1, 2, ...) at which the running mean of ``losses`` over
    ``window`` records is below ``fraction`` · ln(num_classes), or None."""
    steps = range(1, len(losses) + 1) if steps is None else steps
    threshold = fraction * math.log(num_classes)
    return next((step for i, (step, mean) in enumerate(zip(steps, running_mean(losses, window)))
                 if i + 1 >= window and mean < threshold), None)


def lr_factor(step, steps, warmup, floor=0.01):
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 down to ``floor``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def accuracy(model, images, labels, batch_size=250):
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(labels), batch_size):
        logits = model(images[start:start + batch_size])
        correct += (logits.argmax(dim=1) == labels[start:start + batch_size]).sum().item()
    model.train(was_training)
    return correct / len(labels)


def validation_set(task, size):
    return task.sample(size, torch.Generator().manual_seed(VAL_SEED))


def train_run(task, attn_cfg, seed, steps, val_set, warmup=30, batch_size=32, lr=1e-3,
              weight_decay=0.05, early_step=None, progress=None, log_every=100):
    """Train one model on ``task`` from ``seed``; return the run's record (``early_acc`` None
    when ``early_step`` is None or past ``steps``)."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = ToyClassifier(attn_cfg, task.num_classes).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, steps, warmup))
    stream = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    val_images, val_labels = val_set
    losses, early_acc = [], None
    for step in range(1, steps + 1):
        images, labels = task.sample(batch_size, stream)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step == early_step:
            early_acc = accuracy(model, val_images, val_labels)
        if progress is not None and (step % log_every == 0 or step == steps):
            recent = losses[-min(len(losses), TAKEOFF_WINDOW):]
            progress(f'step {step}/{steps} loss {sum(recent) / len(recent):.3f} '
                     f'({time.perf_counter() - start:.0f} s)')
    final_acc = accuracy(model, val_images, val_labels)
    return dict(seed=seed, attn_cfg=dict(attn_cfg), losses=losses,
                takeoff_step=takeoff_step(losses, task.num_classes),
                early_step=early_step if early_acc is not None else None,
                early_acc=early_acc, final_acc=final_acc,
                seconds=time.perf_counter() - start)
