"""Common machinery of the loss plugins: input checks, aggregation, anchors, KL, diagnostics.

A plugin supplies `token_loss` (per-token loss, differentiable in `logp`) and `rules` (a
`TrustRegionRules` holding its own rule's settings and the other losses' as counterfactuals);
`__call__` is the public contract

    loss(logp, sampler_logp, advantages, mask, anchor_logp=None, ref_logp=None) -> (scalar, metrics)

`anchor_logp` (the trainer's logprobs recomputed before the first update, `anchor: recomputed`)
moves the trust region of GRPO, DPPO and GSPO; `ref_logp` (logprobs of the initial weights) adds
`kl_coef * aggregate(k3)` when `kl_coef > 0`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from trainer.losses.aggregate import aggregate, check_aggregation, check_norm_length
from trainer.losses.diagnostics import compute_diagnostics
from trainer.losses.inputs import check_loss_inputs, check_optional_input
from trainer.losses.trust_region import LOG_RATIO_CLAMP, TrustRegionRules

ANCHORS: tuple[str, ...] = ("sampler", "recomputed")


def positive_param(owner: str, name: str, value: float, *, upper: float | None = None) -> float:
    """`value` as a float if it is > 0 (and <= upper when given; inf always allowed).

    inf is accepted so that identities such as "eps = inf is plain importance sampling"
    can be expressed; zero, negatives, NaN and non-numbers raise ValueError naming `name`.
    """
    allowed = f"(0, {upper}] or inf" if upper is not None else "> 0 (inf allowed)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{owner}: {name} must be a number {allowed}, got {value!r}")  # noqa: TRY004
    value = float(value)
    if math.isnan(value) or value <= 0 or (upper is not None and value > upper and not math.isinf(value)):
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return value


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
    is_cap: float = 1e4
    #: The four rules (own + counterfactuals) this arm reports; set by each plugin.
    rules: TrustRegionRules

    def __init__(
        self,
        name: str,
        aggregation: str,
        norm_length: float | None = None,
        anchor: str = "sampler",
        kl_coef: float = 0.0,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(name, str) or not name:
            raise ValueError(f"{owner}: name must be a non-empty string, got {name!r}")
        self.name = name
        self.aggregation = check_aggregation(aggregation, f"{owner}: aggregation")
        self.norm_length = check_norm_length(self.aggregation, norm_length, f"{owner}: norm_length")
        if anchor not in ANCHORS:
            raise ValueError(f"{owner}: anchor must be one of {list(ANCHORS)}, got {anchor!r}")
        self.anchor = anchor
        if isinstance(kl_coef, bool) or not isinstance(kl_coef, (int, float)) or not 0 <= kl_coef < math.inf:
            raise ValueError(f"{owner}: kl_coef must be a finite number >= 0 (0 = off), got {kl_coef!r}")
        self.kl_coef = float(kl_coef)

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
