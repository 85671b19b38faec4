"""Diagnostics logged with identical keys by every loss arm.

All statistics are over loss tokens (mask == 1), computed in float64 under no_grad from
detached tensors. The trust-region masks are passed in by the loss, so each arm reports
its own rule and the other arm's rule as a counterfactual:
- `loss/dppo_masked_frac`: fraction of loss tokens the DPPO rule drops (counterfactual
  binary TV with `cf_dppo_delta` in the GRPO arm);
- `loss/dppo_masked_frac_nonzero_adv`: the same among loss tokens with A != 0 (Stable-RL's
  `pg_clipfrac` denominator); 0.0 when there are none;
- `loss/grpo_clip_frac`: fraction of loss tokens where the PPO clip binds (clipped branch
  selected, zero gradient); counterfactual with `cf_grpo_eps` in the DPPO arm;
- `drift/abs_p_q50|q90|q99|max`: quantiles (linear interpolation) of |p - p_sampler|;
- `drift/kl_sampler_current`: mean k3 estimator of KL(sampler || current) with tokens
  sampled from the sampler: k3 = (r - 1) - log r, r = p / p_sampler (unbiased, >= 0);
- `ratio/mean`, `ratio/max`: of r = exp(logp - sampler_logp), unclamped;
- `ratio/cap_hits`: number of loss tokens with r > c (c = the DPPO IS cap; 1e4 in GRPO);
- `loss/n_tokens`: number of loss tokens.
"""

from __future__ import annotations

import torch

DIAGNOSTIC_KEYS: tuple[str, ...] = (
    "loss/dppo_masked_frac",
    "loss/dppo_masked_frac_nonzero_adv",
    "loss/grpo_clip_frac",
    "drift/abs_p_q50",
    "drift/abs_p_q90",
    "drift/abs_p_q99",
    "drift/abs_p_max",
    "drift/kl_sampler_current",
    "ratio/mean",
    "ratio/max",
    "ratio/cap_hits",
    "loss/n_tokens",
)

_QUANTILES = (0.5, 0.9, 0.99)


@torch.no_grad()
def compute_diagnostics(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    dppo_drop: torch.Tensor,
    grpo_clip: torch.Tensor,
    is_cap: float,
) -> dict[str, float]:
    """The DIAGNOSTIC_KEYS dict (floats) for one batch; see the module docstring."""
    sel = mask.detach() != 0
    n = int(sel.sum().item())
    if n == 0:
        raise ValueError("compute_diagnostics: mask has no loss tokens")
    lp = logp.detach()[sel].double()
    slp = sampler_logp.detach()[sel].double()
    adv = advantages.detach()[sel]
    drop = dppo_drop.detach()[sel].bool()
    clip = grpo_clip.detach()[sel].bool()

    log_ratio = lp - slp
    ratio = torch.exp(log_ratio)
    abs_dp = (torch.exp(lp) - torch.exp(slp)).abs()
    q50, q90, q99 = torch.quantile(abs_dp, torch.tensor(_QUANTILES, dtype=torch.float64)).tolist()
    nonzero = adv != 0
    n_nonzero = int(nonzero.sum().item())
    masked_nonzero = float((drop & nonzero).sum().item()) / n_nonzero if n_nonzero else 0.0
    return {
        "loss/dppo_masked_frac": float(drop.sum().item()) / n,
        "loss/dppo_masked_frac_nonzero_adv": masked_nonzero,
        "loss/grpo_clip_frac": float(clip.sum().item()) / n,
        "drift/abs_p_q50": q50,
        "drift/abs_p_q90": q90,
        "drift/abs_p_q99": q99,
        "drift/abs_p_max": float(abs_dp.max().item()),
        "drift/kl_sampler_current": float((ratio - 1.0 - log_ratio).mean().item()),
        "ratio/mean": float(ratio.mean().item()),
        "ratio/max": float(ratio.max().item()),
        "ratio/cap_hits": float((ratio > is_cap).sum().item()),
        "loss/n_tokens": float(n),
    }
