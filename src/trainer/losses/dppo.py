"""DPPO loss plugin (binary TV / binary KL trust region), anchored to the sampler."""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, positive_param
from trainer.losses.registry import register_loss
from trainer.losses.trust_region import DPPO_MODES, TrustRegionRules, dppo_drop_mask, dppo_token_loss

# Authors' defaults: verl-project/verl examples/dppo_trainer (PR #5397 @ 182383bbb),
# run_qwen30b_dppo.sh: delta 0.15 for TV, 0.05 for KL, clip_ratio_c 10000.
DEFAULT_DELTA = {"binary_tv": 0.15, "binary_kl": 0.05}


@register_loss("dppo")
class DPPOLoss(PolicyLoss):
    """Token loss `-A * sg(min(r, c)) * keep * logp`, r = exp(min(logp - sampler_logp, 20)).

    Pinned to sail-sg/Stable-RL @ c6af1d119c0fe30d16dd9a837d35fdf695acd226,
    verl/trainer/ppo/core_algos.py::compute_policy_loss_with_mask with
    `_compute_token_mask_for_policy_loss` (modes `dppo_binary_tv`, `dppo_binary_kl`,
    anchor = rollout/sampler logprobs). `keep` = not `dppo_drop_mask(...)`.
    The value is a REINFORCE surrogate (not the IS objective -r*A); its gradient equals
    that of -r*A on kept tokens with r truncated at c.

    delta None -> 0.15 (binary_tv) / 0.05 (binary_kl); delta_low / delta_high default to
    delta. binary_tv needs deltas in (0, 1]; binary_kl deltas > 0; inf disables the rule.
    `is_cap` (c) >= 1; `cf_grpo_eps` sets the counterfactual PPO clip in `loss/grpo_clip_frac`.
    With `anchor="recomputed"` the mask is taken against the anchor and the IS weight stays on
    the sampler: Stable-RL's `dppo_binary_tv_recompute` / `dppo_binary_kl_recompute`.
    """

    def __init__(
        self,
        name: str = "dppo",
        mode: str = "binary_tv",
        delta: float | None = None,
        delta_low: float | None = None,
        delta_high: float | None = None,
        is_cap: float = 1e4,
        aggregation: str = "sum",
        cf_grpo_eps: float = 0.2,
        norm_length: float | None = None,
        anchor: str = "sampler",
        kl_coef: float = 0.0,
    ) -> None:
        super().__init__(name, aggregation, norm_length, anchor, kl_coef)
        owner = "DPPOLoss"
        if mode not in DPPO_MODES:
            raise ValueError(f"{owner}: mode must be one of {list(DPPO_MODES)}, got {mode!r}")
        self.mode = mode
        upper = 1.0 if mode == "binary_tv" else None
        delta = DEFAULT_DELTA[mode] if delta is None else delta
        self.delta = positive_param(owner, "delta", delta, upper=upper)
        self.delta_low = positive_param(
            owner, "delta_low", self.delta if delta_low is None else delta_low, upper=upper
        )
        self.delta_high = positive_param(
            owner, "delta_high", self.delta if delta_high is None else delta_high, upper=upper
        )
        if isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not float(is_cap) >= 1.0:
            raise ValueError(f"{owner}: is_cap must be >= 1 (inf allowed), got {is_cap!r}")
        self.is_cap = float(is_cap)
        self.cf_grpo_eps = positive_param(owner, "cf_grpo_eps", cf_grpo_eps)
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
