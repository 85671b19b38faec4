"""CISPO plugin (clipped IS-weight policy optimisation), equal in value and gradient to Tinker's
built-in `cispo`."""

from __future__ import annotations

import math

import torch

from trainer.losses.base import PolicyLoss
from trainer.losses.registry import register_loss
from trainer.losses.trust_region import TrustRegionRules, cispo_token_loss

# Tinker docs /tinker/losses/cispo and tinker-cookbook tutorials/202_loss_functions.py: 0.0 / 4.0.
DEFAULT_CLIP_LOW = 0.0
DEFAULT_CLIP_HIGH = 4.0


@register_loss("cispo")
class CISPOLoss(PolicyLoss):
    """Token loss `-sg(clip(r, clip_low_threshold, clip_high_threshold)) * A * logp`.

    Pinned to Tinker's built-in `cispo` (docs /tinker/losses/cispo; `loss_fn_config` keys
    `clip_low_threshold` / `clip_high_threshold`, defaults 0.0 / 4.0; token sum), after MiniMax-M1
    (arXiv 2506.13585). The weight is truncated, the token is never dropped: the gradient
    is -A*clip(r) on every token. Thresholds are absolute bounds on r: 0 <= low <= 1 <= high
    (inf allowed). Its own rule, `loss/cispo_clip_frac`, counts the truncated tokens. CISPO has no
    anchored trust region; `anchor` only moves the other losses' counterfactual rules.
    """

    def __init__(
        self,
        name: str = "cispo",
        clip_low_threshold: float = DEFAULT_CLIP_LOW,
        clip_high_threshold: float = DEFAULT_CLIP_HIGH,
        aggregation: str = "sum",
        norm_length: float | None = None,
        anchor: str = "sampler",
        kl_coef: float = 0.0,
    ) -> None:
        super().__init__(name, aggregation, norm_length, anchor, kl_coef)
        owner = "CISPOLoss"
        for key, value in (("clip_low_threshold", clip_low_threshold), ("clip_high_threshold", clip_high_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{owner}: {key} must be a number, got {value!r}")
        if not 0.0 <= clip_low_threshold <= 1.0:
            raise ValueError(f"{owner}: clip_low_threshold must be in [0, 1], got {clip_low_threshold!r}")
        if not clip_high_threshold >= 1.0:
            raise ValueError(f"{owner}: clip_high_threshold must be >= 1 (inf allowed), got {clip_high_threshold!r}")
        self.clip_low = float(clip_low_threshold)
        self.clip_high = float(clip_high_threshold)
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
