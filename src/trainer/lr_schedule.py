"""Learning rate per optimizer step: linear warmup, then constant, linear decay or cosine."""

from __future__ import annotations

import math


def lr_at(update: int, total_updates: int, peak_lr: float, schedule: str = "constant",
          warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """LR for 0-based optimizer step `update` out of `total_updates`."""
    if warmup_steps > 0 and update < warmup_steps:
        return peak_lr * (update + 1) / warmup_steps
    if schedule == "constant":
        return peak_lr
    span = max(1, total_updates - warmup_steps)
    progress = min(1.0, (update - warmup_steps) / span)
    floor = peak_lr * min_lr_ratio
    if schedule == "linear":
        return floor + (peak_lr - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"schedule.lr_schedule: unknown schedule {schedule!r}")
