"""CISPO plugin (clipped IS-weight policy optimisation), equal in value and gradient to Tinker's
built-in `cispo`."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import CISPOLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, cispo_token_loss


class CISPOLoss(PolicyLoss):
    """Token loss `-sg(clip(r, clip_low_threshold, clip_high_threshold)) * A * logp`.

    Pinned to Tinker's built-in `cispo` (docs /tinker/losses/cispo; `loss_fn_config` keys
    `clip_low_threshold` / `clip_high_threshold`, defaults 0.0 / 4.0; token sum), after MiniMax-M1
    (arXiv 2506.13585). The weight is truncated, the token is never dropped: the gradient
    is -A*clip(r) on every token. Thresholds are absolute bounds on r: 0 <= low <= 1 <= high
    (inf allowed). Its own rule, `loss/cispo_clip_frac`, counts the truncated tokens. CISPO has no
    anchored trust region; `anchor` only moves the other losses' counterfactual rules.
    """

    config_class = CISPOLossConfig

    def __init__(self, config: CISPOLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        self.clip_low = float(self.config.clip_low_threshold)
        self.clip_high = float(self.config.clip_high_threshold)
        self.rules = TrustRegionRules(cispo_low=self.clip_low, cispo_high=self.clip_high)

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return cispo_token_loss(logp, sampler_logp, advantages, self.clip_low, self.clip_high)

    def __repr__(self) -> str:
        return (
            f"CISPOLoss(name={self.name!r}, clip_low_threshold={self.clip_low}, "
            f"clip_high_threshold={self.clip_high}, {self._common_repr()})"
        )
