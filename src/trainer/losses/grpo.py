"""GRPO / PPO-clip loss plugin, equal in value and gradient to Tinker's built-in `ppo`."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import DPPOLossConfig, GRPOLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, grpo_token_loss

# GRPO has no IS cap; `ratio/cap_hits` uses DPPO's default c so both arms count the same thing.
GRPO_DIAGNOSTIC_CAP = DPPOLossConfig.is_cap


class GRPOLoss(PolicyLoss):
    """Token loss `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, r = exp(logp - sampler_logp).

    Pinned to Tinker's built-in `ppo` loss (docs /tinker/losses/ppo; clip thresholds 0.8 /
    1.2 by default, token sum), which the `_loss` "ppo" branch of spindle (an open-source
    server of Tinker's training API, pinned in losses/aggregate.py) reproduces.
    Settings, defaults and bounds: `GRPOLossConfig`.
    `clip_eps_low` / `clip_eps_high` default to `clip_eps`; `cf_dppo_delta` sets the
    counterfactual DPPO binary-TV rule reported as `loss/dppo_masked_frac`. With
    `anchor="recomputed"` the clip is on the ratio to the anchor (see `grpo_token_loss`).
    """

    config_class = GRPOLossConfig

    def __init__(self, config: GRPOLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        c = self.config
        self.clip_eps = float(c.clip_eps)
        self.eps_low = float(c.clip_eps if c.clip_eps_low is None else c.clip_eps_low)
        self.eps_high = float(c.clip_eps if c.clip_eps_high is None else c.clip_eps_high)
        self.cf_dppo_delta = float(c.cf_dppo_delta)
        self.is_cap = GRPO_DIAGNOSTIC_CAP
        self.rules = TrustRegionRules(
            dppo_delta_low=self.cf_dppo_delta,
            dppo_delta_high=self.cf_dppo_delta,
            grpo_eps_low=self.eps_low,
            grpo_eps_high=self.eps_high,
        )

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return grpo_token_loss(logp, sampler_logp, advantages, self.eps_low, self.eps_high, anchor_logp)

    def __repr__(self) -> str:
        return (
            f"GRPOLoss(name={self.name!r}, eps_low={self.eps_low}, eps_high={self.eps_high}, "
            f"{self._common_repr()}, cf_dppo_delta={self.cf_dppo_delta})"
        )
