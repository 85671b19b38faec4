"""GRPO / PPO-clip loss plugin, equal in value and gradient to Tinker's built-in `ppo`."""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, positive_param
from trainer.losses.registry import register_loss
from trainer.losses.trust_region import dppo_drop_mask, grpo_token_loss, ppo_clip_active

# GRPO has no IS cap; `ratio/cap_hits` uses DPPO's default c so both arms count the same thing.
GRPO_DIAGNOSTIC_CAP = 1e4


@register_loss("grpo")
class GRPOLoss(PolicyLoss):
    """Token loss `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, r = exp(logp - sampler_logp).

    Pinned to Tinker's built-in `ppo` loss (docs /tinker/losses/ppo; clip thresholds 0.8 /
    1.2 by default, token sum), which spindle's `_loss` "ppo" branch reproduces.
    `clip_eps_low` / `clip_eps_high` default to `clip_eps`; `cf_dppo_delta` sets the
    counterfactual DPPO binary-TV rule reported as `loss/dppo_masked_frac`.
    """

    def __init__(
        self,
        name: str = "grpo",
        clip_eps: float = 0.2,
        clip_eps_low: float | None = None,
        clip_eps_high: float | None = None,
        aggregation: str = "sum",
        cf_dppo_delta: float = 0.15,
    ) -> None:
        super().__init__(name, aggregation)
        owner = "GRPOLoss"
        self.clip_eps = positive_param(owner, "clip_eps", clip_eps)
        self.eps_low = positive_param(
            owner, "clip_eps_low", self.clip_eps if clip_eps_low is None else clip_eps_low
        )
        self.eps_high = positive_param(
            owner, "clip_eps_high", self.clip_eps if clip_eps_high is None else clip_eps_high
        )
        self.cf_dppo_delta = positive_param(owner, "cf_dppo_delta", cf_dppo_delta, upper=1.0)
        self.is_cap = GRPO_DIAGNOSTIC_CAP

    def token_loss(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor
    ) -> torch.Tensor:
        return grpo_token_loss(logp, sampler_logp, advantages, self.eps_low, self.eps_high)

    def trust_region_masks(
        self, logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        drop = dppo_drop_mask(
            logp, sampler_logp, advantages, "binary_tv", self.cf_dppo_delta, self.cf_dppo_delta
        )
        clip = ppo_clip_active(logp, sampler_logp, advantages, self.eps_low, self.eps_high)
        return drop, clip

    def __repr__(self) -> str:
        return (
            f"GRPOLoss(name={self.name!r}, eps_low={self.eps_low}, eps_high={self.eps_high}, "
            f"aggregation={self.aggregation!r}, cf_dppo_delta={self.cf_dppo_delta})"
        )
