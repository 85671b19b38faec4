"""The loss inputs: the datum keys that carry them, their extraction from a datum, their checks.

A tinker `Datum` carries a loss's inputs in `loss_fn_inputs`: the sampler logprobs under `logprobs`
(the tinker-cookbook key), `advantages`, an optional `mask` (else `default_mask`), and the optional
recomputed anchor and initial-weights logprobs. The two-pass adapter and the one-pass per-datum
form both read this vocabulary; the loss itself checks the four tensors it is called with
(`logp`, `sampler_logp`, `advantages`, `mask`). A loss names the optional inputs it needs in a
`LossNeeds` (`PolicyLoss.needs`); the loss path fetches exactly those (`LossPath.fetch_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SAMPLER_LOGPROBS_KEY = "logprobs"
ADVANTAGES_KEY = "advantages"
MASK_KEY = "mask"
#: Optional per-datum inputs: the recomputed anchor and the initial weights' logprobs.
ANCHOR_KEY = "anchor_logprobs"
REF_KEY = "ref_logprobs"

_NAMES = ("logp", "sampler_logp", "advantages", "mask")


@dataclass(frozen=True)
class LossNeeds:
    """The optional per-token inputs a loss needs, beyond what a datum carries from its rollout.

    Each costs the trainer extra backend work every rollout step (a forward pass, a sampler's
    `compute_logprobs` over the batch), so the loss states the ones its settings use and the loss
    path fetches those and no others: the trainer never reads the loss's settings to decide.
    """

    #: `anchor_logprobs`: the trainer's logprobs from one forward pass of the current weights before
    #: the first update of the step (`anchor: recomputed`)
    anchor: bool = False
    #: `ref_logprobs`: logprobs of the initial weights (`kl_coef > 0`)
    reference: bool = False


def default_mask(sampler_logp_T: torch.Tensor, advantages_T: torch.Tensor) -> torch.Tensor:
    """Loss mask when a datum carries none: `advantages != 0 or logprobs != 0`.

    Same rule as spindle's `build_sequence_batches` (spindle: an open-source server of
    Tinker's training API, pinned in losses/aggregate.py); prompt tokens carry A = 0 and
    sampler logprob 0 in tinker-cookbook datums.
    """
    return ((advantages_T != 0) | (sampler_logp_T != 0)).to(sampler_logp_T.dtype)


def datum_inputs(datum: Any, index: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampler_logp_T, advantages_T, mask_T) of one datum, each checked to have `length`."""
    inputs = datum.loss_fn_inputs
    out = []
    for key in (SAMPLER_LOGPROBS_KEY, ADVANTAGES_KEY):
        if key not in inputs:
            raise ValueError(f"datum[{index}] has no loss_fn_inputs[{key!r}]")
        out.append(inputs[key].to_torch().reshape(-1).to(torch.float32))
    sampler_T, adv_T = out
    mask_T = inputs[MASK_KEY].to_torch().reshape(-1).to(torch.float32) if MASK_KEY in inputs else None
    if mask_T is None:
        mask_T = default_mask(sampler_T, adv_T)
    for key, t in ((SAMPLER_LOGPROBS_KEY, sampler_T), (ADVANTAGES_KEY, adv_T), (MASK_KEY, mask_T)):
        if t.numel() != length:
            raise ValueError(
                f"datum[{index}] loss_fn_inputs[{key!r}] has {t.numel()} entries, "
                f"but its current logprobs have {length}"
            )
    return sampler_T, adv_T, mask_T


def optional_input(datum: Any, key: str, index: int, length: int) -> torch.Tensor | None:
    """A datum's optional `loss_fn_inputs[key]` as float32 `[T]`, or None when absent."""
    if key not in datum.loss_fn_inputs:
        return None
    t = datum.loss_fn_inputs[key].to_torch().reshape(-1).to(torch.float32)
    if t.numel() != length:
        raise ValueError(
            f"datum[{index}] loss_fn_inputs[{key!r}] has {t.numel()} entries, but its current logprobs have {length}"
        )
    return t


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
