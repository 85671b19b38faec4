"""Helpers shared by the engine tests: a training client's LoRA gradients."""

from __future__ import annotations

import torch


def grads(tc) -> list[torch.Tensor]:
    """Copies of the client's LoRA gradients (zeros where none accumulated)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in tc.compute.params]


def zero(tc) -> None:
    for p in tc.compute.params:
        p.grad = None
