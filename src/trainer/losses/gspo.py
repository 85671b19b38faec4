"""GSPO plugin (sequence-level importance ratio with a sequence-level clip), in Tinker's
GSPO-token form."""

from __future__ import annotations

import torch

from trainer.losses.base import PolicyLoss, positive_param
from trainer.losses.registry import register_loss
from trainer.losses.trust_region import TrustRegionRules, gspo_token_loss

# GSPO paper (Zheng et al. 2025, arXiv 2507.18071) section 5.1: clipping ranges 3e-4 and 4e-4.
DEFAULT_EPS_LOW = 3e-4
DEFAULT_EPS_HIGH = 4e-4


@register_loss("gspo")
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

    def __init__(
        self,
        name: str = "gspo",
        seq_clip_eps_low: float = DEFAULT_EPS_LOW,
        seq_clip_eps_high: float = DEFAULT_EPS_HIGH,
        aggregation: str = "sum",
        norm_length: float | None = None,
        anchor: str = "sampler",
        kl_coef: float = 0.0,
    ) -> None:
        super().__init__(name, aggregation, norm_length, anchor, kl_coef)
        owner = "GSPOLoss"
        self.eps_low = positive_param(owner, "seq_clip_eps_low", seq_clip_eps_low)
        self.eps_high = positive_param(owner, "seq_clip_eps_high", seq_clip_eps_high)
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
