"""Diagnostics logged with identical keys by every loss arm.

All statistics are over loss tokens (mask == 1), computed in float64 under no_grad from
detached tensors. The rule masks come from the arm's `TrustRegionRules`, so each arm reports
its own rule and every other loss's rule as a counterfactual, point by point comparable:
- `loss/dppo_masked_frac`: fraction of loss tokens the DPPO rule drops;
- `loss/dppo_masked_frac_nonzero_adv`: the same among loss tokens with A != 0 (Stable-RL's
  `pg_clipfrac` denominator); 0.0 when there are none;
- `loss/grpo_clip_frac`: fraction where the PPO clip binds (clipped branch, zero gradient);
- `loss/cispo_clip_frac`: fraction whose CISPO importance weight is truncated (r outside
  [low, high]; the gradient is kept, scaled);
- `loss/gspo_clip_frac`: fraction in sequences whose GSPO sequence-ratio clip binds;
- `loss/cppo_masked_frac`: fraction CPPO's position-weighted, prefix-budgeted rule drops, split by cause
  into `loss/cppo_token_masked_frac` (Z_t = w_t D_t above delta: the per-token threshold) and
  `loss/cppo_budget_masked_frac` (Z_t <= delta, dropped only because the spent prefix budget put c_t
  below delta); the two add up to the first;
- `loss/<rule>_frac_adv_pos`, `loss/<rule>_frac_adv_neg`: each rule's fraction among the loss
  tokens with A > 0, resp. A < 0 (0.0 when there are none), the share it acts on by sign;
- `drift/abs_p_q50|q90|q99|max`: quantiles (linear interpolation) of |p - p_sampler|;
- `drift/kl_sampler_current`: mean k3 estimator of KL(sampler || current) with tokens
  sampled from the sampler: k3 = (r - 1) - log r, r = p / p_sampler (unbiased, >= 0);
- `ratio/mean`, `ratio/max`: of r = exp(logp - sampler_logp), unclamped;
- `ratio/cap_hits`: number of loss tokens with r > c (c = the DPPO IS cap; 1e4 elsewhere);
- `entropy/sampled_token_estimate`: mean of -log mu(y) over the sampled loss tokens, the
  sampled-token estimator of the sampler's per-token entropy (unbiased for
  E_t H(mu(.|prefix)) because y ~ mu); the exact entropy needs full logits and is logged
  separately where the engine returns it (`entropy/exact`);
- `loss/n_tokens`: number of loss tokens.
With a recomputed anchor the DPPO, CPPO, GRPO and GSPO rules are evaluated against it (the drift
keys stay sampler-relative).
"""

from __future__ import annotations

import torch

from trainer.config.losses import RULE_NAMES as RULES

RULE_KEYS: tuple[str, ...] = tuple(
    f"loss/{rule}_frac{suffix}" for rule in RULES for suffix in ("", "_adv_pos", "_adv_neg")
)

DIAGNOSTIC_KEYS: tuple[str, ...] = (
    *RULE_KEYS,
    "loss/dppo_masked_frac_nonzero_adv",
    "drift/abs_p_q50",
    "drift/abs_p_q90",
    "drift/abs_p_q99",
    "drift/abs_p_max",
    "drift/kl_sampler_current",
    "ratio/mean",
    "ratio/max",
    "ratio/cap_hits",
    "entropy/sampled_token_estimate",
    "loss/n_tokens",
)

_QUANTILES = (0.5, 0.9, 0.99)


def _frac(hit: torch.Tensor, among: torch.Tensor) -> float:
    n = int(among.sum().item())
    return float((hit & among).sum().item()) / n if n else 0.0


@torch.no_grad()
def compute_diagnostics(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rule_masks: dict[str, torch.Tensor],
    is_cap: float,
) -> dict[str, float]:
    """The DIAGNOSTIC_KEYS dict (floats) for one batch; see the module docstring."""
    if set(rule_masks) != set(RULES):
        raise ValueError(f"compute_diagnostics: rule_masks must have keys {list(RULES)}, got {sorted(rule_masks)}")
    sel = mask.detach() != 0
    n = int(sel.sum().item())
    if n == 0:
        raise ValueError("compute_diagnostics: mask has no loss tokens")
    lp = logp.detach()[sel].double()
    slp = sampler_logp.detach()[sel].double()
    adv = advantages.detach()[sel]
    every = torch.ones_like(adv, dtype=torch.bool)
    pos, neg, nonzero = adv > 0, adv < 0, adv != 0

    out: dict[str, float] = {}
    for rule in RULES:
        hit = rule_masks[rule].detach().expand_as(mask)[sel].bool()
        out[f"loss/{rule}_frac"] = _frac(hit, every)
        out[f"loss/{rule}_frac_adv_pos"] = _frac(hit, pos)
        out[f"loss/{rule}_frac_adv_neg"] = _frac(hit, neg)
        if rule == "dppo_masked":
            out["loss/dppo_masked_frac_nonzero_adv"] = _frac(hit, nonzero)

    log_ratio = lp - slp
    ratio = torch.exp(log_ratio)
    abs_dp = (torch.exp(lp) - torch.exp(slp)).abs()
    q50, q90, q99 = torch.quantile(abs_dp, torch.tensor(_QUANTILES, dtype=torch.float64)).tolist()
    out.update({
        "drift/abs_p_q50": q50,
        "drift/abs_p_q90": q90,
        "drift/abs_p_q99": q99,
        "drift/abs_p_max": float(abs_dp.max().item()),
        "drift/kl_sampler_current": float((ratio - 1.0 - log_ratio).mean().item()),
        "ratio/mean": float(ratio.mean().item()),
        "ratio/max": float(ratio.max().item()),
        "ratio/cap_hits": float((ratio > is_cap).sum().item()),
        "entropy/sampled_token_estimate": float((-slp).mean().item()),
        "loss/n_tokens": float(n),
    })
    return {key: out[key] for key in DIAGNOSTIC_KEYS}
