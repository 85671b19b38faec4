"""CPPO loss plugin: DPPO's binary-TV mask made position-weighted and cumulative along each sequence."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import CPPOLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, cppo_drop_masks, dppo_token_loss


class CPPOLoss(PolicyLoss):
    """Token loss `-A * sg(min(r, c)) * keep * logp`, r = exp(min(logp - sampler_logp, 20)), DPPO's surrogate
    with CPPO's keep rule (`cppo_drop_masks`: the formulas, and the ambiguities of the paper's text as the
    reference code resolves them).

    CPPO, "Beyond Uniform Token-Level Trust Region in LLM Reinforcement Learning" (arXiv 2606.10968),
    pinned to Tencent-Hunyuan/UniRL @ e1211ee627228407787fa7d6b41b63d7e300fb28,
    unirl/algorithms/cppo.py::_cppo_mask (the keep rule) and ::_cppo_loss (the loss), with the defaults of
    its CPPOConfig and CPPO/config.yaml (w_min 0.8, delta_b 0.02; delta 0.15 for dense models per the
    paper's Table 3). The reference's loss is `-A * r * keep` with r differentiable; its gradient, -A*r on
    kept tokens, is this loss's for r <= c (c = `is_cap`, DPPO's 1e4; the reference clamps log r at 20
    only). The value is DPPO's REINFORCE surrogate, so with w_min = 1 and delta_b >= 1 this loss equals
    `DPPOLoss(mode="binary_tv", delta=delta)` in value and gradient.

    Settings, defaults and bounds: `CPPOLossConfig`. With `anchor="recomputed"` the rule is taken against
    the anchor (D_t = |p - p_anchor| and its ratio) and the importance weight stays on the sampler, as
    `DPPOLoss` does (Stable-RL's `*_recompute` modes); UniRL's `old_logp_source: replay` moves both.
    """

    config_class = CPPOLossConfig

    def __init__(self, config: CPPOLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        c = self.config
        self.delta = float(c.delta)
        self.w_min = float(c.w_min)
        self.delta_b = float(c.delta_b)
        self.is_cap = float(c.is_cap)
        self.rules = TrustRegionRules(cppo_delta=self.delta, cppo_w_min=self.w_min, cppo_delta_b=self.delta_b)

    def keep_mask(
        self, logp: torch.Tensor, anchor_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """1.0 where the token is kept, 0.0 where CPPO drops it (detached, logp's dtype)."""
        dropped, _, _ = cppo_drop_masks(logp, anchor_logp, advantages, mask, self.delta, self.w_min,
                                        self.delta_b)
        return (~dropped).to(logp.dtype)

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        keep = self.keep_mask(logp, sampler_logp if anchor_logp is None else anchor_logp, advantages, mask)
        return dppo_token_loss(logp, sampler_logp, advantages, keep, self.is_cap)

    def __repr__(self) -> str:
        return (
            f"CPPOLoss(name={self.name!r}, delta={self.delta}, w_min={self.w_min}, delta_b={self.delta_b}, "
            f"is_cap={self.is_cap}, {self._common_repr()})"
        )
