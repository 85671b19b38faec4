"""Common machinery of the loss plugins: input checks, aggregation, anchors, KL, diagnostics.

A plugin names its typed config (`config_class`, in the torch-free trainer/config/losses.py, which
holds every default and bound) and supplies `token_loss` (per-token loss, differentiable in `logp`)
and `rules` (a `TrustRegionRules` holding its own rule's settings and the other losses' as
counterfactuals); `__call__` is the public contract

    loss(logp, sampler_logp, advantages, mask, anchor_logp=None, ref_logp=None) -> (scalar, metrics)

`anchor_logp` (the trainer's logprobs recomputed before the first update, `anchor: recomputed`)
moves the trust region of GRPO, DPPO and GSPO; `ref_logp` (logprobs of the initial weights) adds
`kl_coef * aggregate(k3)` when `kl_coef > 0`. `needs` says which of the two the settings use, so the
loss path fetches them and the trainer need not know.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from trainer.config.enums import NEEDS_NORM_LENGTH
from trainer.config.losses import DPPOLossConfig, LossCommonConfig, make_loss_config
from trainer.losses.aggregate import aggregate
from trainer.losses.diagnostics import compute_diagnostics
from trainer.losses.inputs import LossNeeds, check_loss_inputs, check_optional_input
from trainer.losses.trust_region import LOG_RATIO_CLAMP, TrustRegionRules


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(current || reference): exp(d) - 1 - d, d = ref_logp - logp.

    Schulman's k3 ("Approximating KL divergence", 2020), the `low_var_kl` of verl-project/verl @
    018f23b5, verl/trainer/ppo/core_algos.py::kl_penalty (d clamped to [-20, 20]; verl also clamps
    the result to [-10, 10], which is not done here). Differentiable in logp; >= 0.
    """
    d = torch.clamp(ref_logp.detach() - logp, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return torch.exp(d) - 1.0 - d


class PolicyLoss(ABC):
    """Base class of the loss plugins."""

    #: The IS cap c used by `ratio/cap_hits` (and by DPPO's weight truncation).
    is_cap: float = DPPOLossConfig.is_cap
    #: The four rules (own + counterfactuals) this arm reports; set by each plugin.
    rules: TrustRegionRules

    #: The typed config of this plugin: its fields are the constructor's keywords.
    config_class: ClassVar[type[LossCommonConfig]]

    def __init__(self, config: LossCommonConfig | None = None, /, **fields: Any) -> None:
        """Build from `config` (an instance of `config_class`; None = its defaults) with `fields`
        replaced: `GRPOLoss(clip_eps=0.3)` is `GRPOLoss(GRPOLossConfig(clip_eps=0.3))`. The
        config's own checks reject a bad value with a ConfigError (a ValueError) naming the key."""
        self.config = make_loss_config(self.config_class, config, fields, owner=type(self).__name__)
        c = self.config
        self.name = c.name  # type: ignore[attr-defined]
        self.aggregation = c.aggregation
        self.norm_length = float(c.norm_length) if c.aggregation in NEEDS_NORM_LENGTH else None  # type: ignore[arg-type]
        self.anchor = c.anchor
        self.kl_coef = float(c.kl_coef)

    @property
    def needs(self) -> LossNeeds:
        """The optional inputs this loss's settings use: the recomputed anchor (`anchor: recomputed`) and
        the initial weights' logprobs (`kl_coef > 0`, which `__call__` refuses to run without).
        `LossPath.fetch_inputs` adds what it names to the datums before the step's first update."""
        return LossNeeds(anchor=self.anchor == "recomputed", reference=self.kl_coef > 0)

    @abstractmethod
    def token_loss(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token loss (same shape as the inputs), differentiable in `logp` only."""

    def __call__(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_loss_inputs(logp, sampler_logp, advantages, mask)
        anchor_logp = check_optional_input("anchor_logp", anchor_logp, logp)
        ref_logp = check_optional_input("ref_logp", ref_logp, logp)
        if self.kl_coef > 0 and ref_logp is None:
            raise ValueError(f"{self.name}: kl_coef = {self.kl_coef} needs ref_logp (logprobs of the initial weights)")
        sampler_logp = sampler_logp.detach().to(logp.dtype)
        advantages = advantages.detach().to(logp.dtype)
        mask = mask.detach()
        if anchor_logp is not None:
            anchor_logp = anchor_logp.detach().to(logp.dtype)
        token_loss = self.token_loss(logp, sampler_logp, advantages, mask, anchor_logp)
        loss = aggregate(token_loss, mask, self.aggregation, self.norm_length)
        metrics = self.diagnostics(logp, sampler_logp, advantages, mask, anchor_logp)
        if self.kl_coef > 0:
            kl_t = kl_k3(logp, ref_logp.detach().to(logp.dtype))
            loss = loss + self.kl_coef * aggregate(kl_t, mask, self.aggregation, self.norm_length)
            with torch.no_grad():
                metrics["loss/kl_ref"] = float(kl_t[mask != 0].double().mean())
        return loss, metrics

    def diagnostics(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """The shared diagnostics (trainer.losses.diagnostics) for this arm.

        Public so a trainer can also compute them from the logprobs a one-pass
        forward_backward returns.
        """
        with torch.no_grad():
            masks = self.rules.masks(logp, sampler_logp, advantages, mask, anchor_logp)
            return compute_diagnostics(logp, sampler_logp, advantages, mask, rule_masks=masks, is_cap=self.is_cap)

    def _common_repr(self) -> str:
        extra = f", norm_length={self.norm_length}" if self.norm_length is not None else ""
        return f"aggregation={self.aggregation!r}{extra}, anchor={self.anchor!r}, kl_coef={self.kl_coef}"
