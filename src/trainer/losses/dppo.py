"""DPPO loss plugin (binary TV / binary KL trust region), anchored to the sampler."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import DPPOLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, dppo_drop_mask, dppo_token_loss


class DPPOLoss(PolicyLoss):
    """Token loss `-A * sg(min(r, c)) * keep * logp`, r = exp(min(logp - sampler_logp, 20)).

    Pinned to sail-sg/Stable-RL @ c6af1d119c0fe30d16dd9a837d35fdf695acd226,
    verl/trainer/ppo/core_algos.py::compute_policy_loss_with_mask with
    `_compute_token_mask_for_policy_loss` (modes `dppo_binary_tv`, `dppo_binary_kl`,
    anchor = rollout/sampler logprobs). `keep` = not `dppo_drop_mask(...)`.
    The value is a REINFORCE surrogate (not the IS objective -r*A); its gradient equals
    that of -r*A on kept tokens with r truncated at c.

    Settings, defaults (the authors', pinned in trainer/config/enums.py) and bounds: `DPPOLossConfig`.
    delta None -> the mode's default; delta_low / delta_high default to delta; inf disables the
    rule. `cf_grpo_eps` sets the counterfactual PPO clip in `loss/grpo_clip_frac`.
    With `anchor="recomputed"` the mask is taken against the anchor and the IS weight stays on
    the sampler: Stable-RL's `dppo_binary_tv_recompute` / `dppo_binary_kl_recompute`.
    """

    config_class = DPPOLossConfig

    def __init__(self, config: DPPOLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        c = self.config
        self.mode = c.mode
        self.delta = float(c.delta_or_default())
        self.delta_low = float(self.delta if c.delta_low is None else c.delta_low)
        self.delta_high = float(self.delta if c.delta_high is None else c.delta_high)
        self.is_cap = float(c.is_cap)
        self.cf_grpo_eps = float(c.cf_grpo_eps)
        self.rules = TrustRegionRules(
            dppo_mode=self.mode,
            dppo_delta_low=self.delta_low,
            dppo_delta_high=self.delta_high,
            grpo_eps_low=self.cf_grpo_eps,
            grpo_eps_high=self.cf_grpo_eps,
        )

    def keep_mask(
        self, logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor
    ) -> torch.Tensor:
        """1.0 where the token is kept, 0.0 where DPPO drops it (detached, logp's dtype)."""
        drop = dppo_drop_mask(logp, anchor_logp, advantages, self.mode, self.delta_low, self.delta_high)
        return (~drop).to(logp.dtype)

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        keep = self.keep_mask(logp, sampler_logp if anchor_logp is None else anchor_logp, advantages)
        return dppo_token_loss(logp, sampler_logp, advantages, keep, self.is_cap)

    def __repr__(self) -> str:
        return (
            f"DPPOLoss(name={self.name!r}, mode={self.mode!r}, delta_low={self.delta_low}, "
            f"delta_high={self.delta_high}, is_cap={self.is_cap}, {self._common_repr()}, "
            f"cf_grpo_eps={self.cf_grpo_eps})"
        )
