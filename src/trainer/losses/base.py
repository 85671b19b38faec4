"""Common machinery of the loss plugins: input checks, aggregation, diagnostics.

A plugin supplies `token_loss` (per-token loss, differentiable in `logp`) and
`trust_region_masks` (its own rule and the other arm's counterfactual); `__call__` is the
public contract `loss(logp, sampler_logp, advantages, mask) -> (scalar, metrics)`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from trainer.losses.aggregate import aggregate, check_aggregation
from trainer.losses.diagnostics import compute_diagnostics
from trainer.losses.inputs import check_loss_inputs

if TYPE_CHECKING:
    from trainer.losses.per_datum import PerDatumLoss


def positive_param(owner: str, name: str, value: float, *, upper: float | None = None) -> float:
    """`value` as a float if it is > 0 (and <= upper when given; inf always allowed).

    inf is accepted so that identities such as "eps = inf is plain importance sampling"
    can be expressed; zero, negatives, NaN and non-numbers raise ValueError naming `name`.
    """
    allowed = f"(0, {upper}] or inf" if upper is not None else "> 0 (inf allowed)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {name} must be a number {allowed}, got {value!r}")  # noqa: TRY004
    value = float(value)
    if math.isnan(value) or value <= 0 or (upper is not None and value > upper and not math.isinf(value)):
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return value


class PolicyLoss(ABC):
    """Base class of the loss plugins (GRPO, DPPO)."""

    #: The IS cap c used by `ratio/cap_hits` (and by DPPO's weight truncation).
    is_cap: float

    def __init__(self, name: str, aggregation: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(self).__name__}: name must be a non-empty string, got {name!r}")
        self.name = name
        self.aggregation = check_aggregation(aggregation, f"{type(self).__name__}: aggregation")

    @abstractmethod
    def token_loss(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor
    ) -> torch.Tensor:
        """Per-token loss (same shape as the inputs), differentiable in `logp` only."""

    @abstractmethod
    def trust_region_masks(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dppo_drop, grpo_clip) bool masks, detached: the own rule and the counterfactual."""

    def __call__(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_loss_inputs(logp, sampler_logp, advantages, mask)
        sampler_logp = sampler_logp.detach().to(logp.dtype)
        advantages = advantages.detach().to(logp.dtype)
        mask = mask.detach()
        token_loss = self.token_loss(logp, sampler_logp, advantages)
        loss = aggregate(token_loss, mask, self.aggregation)
        return loss, self.diagnostics(logp, sampler_logp, advantages, mask)

    def diagnostics(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """The shared diagnostics (trainer.losses.diagnostics) for this arm.

        Public so a trainer can also compute them from the logprobs a one-pass
        forward_backward returns.
        """
        with torch.no_grad():
            dppo_drop, grpo_clip = self.trust_region_masks(logp, sampler_logp, advantages)
            return compute_diagnostics(
                logp,
                sampler_logp,
                advantages,
                mask,
                dppo_drop=dppo_drop,
                grpo_clip=grpo_clip,
                is_cap=self.is_cap,
            )

    def per_datum_fn(self) -> PerDatumLoss:
        """The torch.fx-traceable per-datum form for `ServiceClient.create_custom_loss` (sum only)."""
        from trainer.losses.per_datum import make_per_datum_fn

        return make_per_datum_fn(self)
