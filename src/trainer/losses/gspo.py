"""GSPO plugin (sequence-level importance ratio with a sequence-level clip), in Tinker's
GSPO-token form."""

from __future__ import annotations

from typing import Any

import torch

from trainer.config.losses import GSPOLossConfig
from trainer.losses.base import PolicyLoss
from trainer.losses.trust_region import TrustRegionRules, gspo_token_loss


class GSPOLoss(PolicyLoss):
    """Token loss `-min(s_t*A, clip(s_t, 1-eps_low, 1+eps_high)*A)`, s_t = sg(s) * p/sg(p),
    s = exp(mean over the sequence's loss tokens of log(p/mu)).

    Pinned to the GSPO paper (arXiv 2507.18071: the sequence ratio and its GSPO-token form), to Tinker's
    built-in `gspo` (docs /tinker/losses/gspo: GSPO-token, summed over tokens; the sequence is the
    datum, the ratio's tokens are the loss mask), and to verl-project/verl @
    018f23b5f83a13340421349e40ec42530739b23a, verl/trainer/ppo/core_algos.py::
    compute_policy_loss_gspo (same token ratio; verl aggregates `seq-mean-token-mean`, which
    `aggregation: seq_mean_token_mean` reproduces and which makes the value the paper's
    (1/G) sum_i min(s_i A_i, clip(s_i) A_i)). A whole sequence is clipped or not; the paper's
    ranges are tiny because s is a geometric mean. The sequence log-ratio is clamped to [-20, 20]
    (verl clamps it at 10). With `anchor="recomputed"` the clip is on the anchor's sequence ratio.
    The knobs are named `seq_clip_eps_*`, not GRPO's `clip_eps_*`: they are a different quantity, and
    `eval.compare` requires keys that two arms' loss configs share to be equal.
    """

    config_class = GSPOLossConfig

    def __init__(self, config: GSPOLossConfig | None = None, /, **fields: Any) -> None:
        super().__init__(config, **fields)
        self.eps_low = float(self.config.seq_clip_eps_low)
        self.eps_high = float(self.config.seq_clip_eps_high)
        self.rules = TrustRegionRules(gspo_eps_low=self.eps_low, gspo_eps_high=self.eps_high)

    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return gspo_token_loss(logp, sampler_logp, advantages, mask, self.eps_low, self.eps_high, anchor_logp)

    def __repr__(self) -> str:
        return (
            f"GSPOLoss(name={self.name!r}, eps_low={self.eps_low}, eps_high={self.eps_high}, "
            f"{self._common_repr()})"
        )
