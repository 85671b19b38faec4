"""Importance-sampling policy gradient plugin, equal in value and gradient to Tinker's built-in
`importance_sampling` (the cookbook's default RL loss)."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import ImportanceSamplingLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, importance_sampling_token_loss


class ImportanceSamplingLoss(PolicyLoss):
    """Token loss `-r*A`, r = exp(logp - sampler_logp): no trust region, no truncation.

    Pinned to Tinker's built-in `importance_sampling` (docs /tinker/losses/importance-sampling;
    `tinker/types/loss_fn_type.py` in tinker 0.38; token sum) and tinker-cookbook @ 9dfcc3a2,
    tinker_cookbook/rl/train.py (default `loss_fn`). Every rule in its diagnostics is a
    counterfactual at that loss's defaults. The anchor only moves those counterfactuals.
    """

    config_class = ImportanceSamplingLossConfig

    def __init__(self, config: ImportanceSamplingLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        self.rules = TrustRegionRules()

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return importance_sampling_token_loss(logp, sampler_logp, advantages)

    def __repr__(self) -> str:
        return f"ImportanceSamplingLoss(name={self.name!r}, {self._common_repr()})"
