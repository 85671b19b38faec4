"""Validation of the four loss inputs (`logp`, `sampler_logp`, `advantages`, `mask`)."""

from __future__ import annotations

import torch

_NAMES = ("logp", "sampler_logp", "advantages", "mask")


def check_loss_inputs(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> None:
    """Raise a ValueError (TypeError for non-tensors) naming the offending tensor.

    Checks: all four are tensors of one shape, `[T]` or `[B, T]`; logp / sampler_logp /
    advantages are floating point and finite everywhere (padding included: a NaN there
    would still poison the gradient through exp); mask is 0/1 and has at least one 1.
    """
    tensors = dict(zip(_NAMES, (logp, sampler_logp, advantages, mask)))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"loss input {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if logp.dim() not in (1, 2):
        raise ValueError(f"loss input 'logp' must be [T] or [B, T], got shape {tuple(logp.shape)}")
    for name, t in tensors.items():
        if t.shape != logp.shape:
            raise ValueError(
                f"loss input {name!r} has shape {tuple(t.shape)}, expected logp's shape {tuple(logp.shape)}"
            )
    for name in ("logp", "sampler_logp", "advantages"):
        t = tensors[name]
        if not t.is_floating_point():
            raise ValueError(f"loss input {name!r} must be a floating-point tensor, got {t.dtype}")
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            raise ValueError(
                f"loss input {name!r} has {int(bad.sum())} non-finite value(s) (NaN/inf), "
                f"first at index {tuple(bad.nonzero()[0].tolist())}"
            )
    m = mask.detach()
    if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("loss input 'mask' must contain only 0 and 1")
    if not bool((m != 0).any()):
        raise ValueError("loss input 'mask' is empty: it selects no loss tokens")


def check_optional_input(name: str, t: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor | None:
    """None, or `t` checked like the required inputs (tensor, logp's shape, floating, finite)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"loss input {name!r} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != logp.shape:
        raise ValueError(f"loss input {name!r} has shape {tuple(t.shape)}, expected logp's shape {tuple(logp.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"loss input {name!r} must be a floating-point tensor, got {t.dtype}")
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        raise ValueError(f"loss input {name!r} has {int(bad.sum())} non-finite value(s) (NaN/inf)")
    return t
