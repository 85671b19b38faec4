"""Per-token trust-region rules shared by the losses and their counterfactual diagnostics.

Element-wise torch only (no Python branching on tensor values, no `.item()`), so the same
functions run inside the batch loss and inside the torch.fx-traced per-datum loss.
Every returned mask is computed from detached inputs: no gradient flows through it.
"""

from __future__ import annotations

import torch

DPPO_MODES: tuple[str, ...] = ("binary_tv", "binary_kl")

# Stable-RL @ c6af1d1, core_algos.py::compute_policy_loss_with_mask clamps the log-ratio
# at +20 before exp when it builds the IS weight (compute_policy_loss_vanilla: to [-20, 20]).
LOG_RATIO_CLAMP = 20.0
# Stable-RL @ c6af1d1, core_algos.py::_compute_token_mask_for_policy_loss, binary KL guard.
KL_EPS = 1e-8


def ppo_clip_active(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Bool mask of tokens where PPO's clipped branch is selected and zeroes the gradient.

    For `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)` this is (A > 0 and r > 1+eps_high)
    or (A < 0 and r < 1-eps_low); r = exp(logp - sampler_logp).
    """
    ratio = torch.exp(logp.detach() - sampler_logp.detach())
    adv = advantages.detach()
    return ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))


def binary_kl_sampler_current(logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """Two-outcome KL(sampler || current) on {sampled token, rest}, per token.

    Stable-RL @ c6af1d1, core_algos.py::_compute_token_mask_for_policy_loss (`dppo_binary_kl`):
    `p_s*(logp_s - logp) + (1-p_s)*log((1-p_s+1e-8)/(1-p+1e-8))`. One guard added: p is
    clamped to <= 1 inside the log (float noise can give logp slightly > 0, which would
    make the log's argument negative); identical for every valid logp <= 0.
    """
    logp = logp.detach()
    sampler_logp = sampler_logp.detach()
    p_sampler = torch.exp(sampler_logp)
    p = torch.exp(torch.clamp(logp, max=0.0))
    rest = torch.log((1.0 - p_sampler + KL_EPS) / (1.0 - p + KL_EPS))
    return p_sampler * (sampler_logp - logp) + (1.0 - p_sampler) * rest


def dppo_drop_mask(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mode: str,
    delta_low: float,
    delta_high: float,
) -> torch.Tensor:
    """Bool mask of tokens DPPO drops (the complement of Stable-RL's `valid_mask`).

    Stable-RL @ c6af1d1, core_algos.py::_compute_token_mask_for_policy_loss: a token is
    dropped only when the divergence exceeds delta *and* p moved the way A pushes it:
    - binary_tv: A > 0 and p - p_s > delta_high, or A <= 0 and p - p_s < -delta_low;
    - binary_kl: A > 0 and KL_bin > delta_high and p > p_s, or A <= 0 and KL_bin > delta_low
      and p < p_s.
    A == 0 follows the A <= 0 rule (`torch.where(advantages > 0, pos, neg)`).
    """
    logp = logp.detach()
    sampler_logp = sampler_logp.detach()
    p = torch.exp(logp)
    p_sampler = torch.exp(sampler_logp)
    if mode == "binary_tv":
        diff = p - p_sampler
        drop_pos = diff > delta_high
        drop_neg = diff < -delta_low
    elif mode == "binary_kl":
        kl = binary_kl_sampler_current(logp, sampler_logp)
        drop_pos = (kl > delta_high) & (p > p_sampler)
        drop_neg = (kl > delta_low) & (p < p_sampler)
    else:
        raise ValueError(f"DPPO mode must be one of {list(DPPO_MODES)}, got {mode!r}")
    return torch.where(advantages.detach() > 0, drop_pos, drop_neg)


def grpo_token_loss(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """PPO-clip token loss `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, r = exp(logp - sampler_logp).

    Tinker built-in `ppo` (docs /tinker/losses/ppo; spindle `_loss` branch "ppo"): no dual clip.
    Gradient -A*r on unclipped tokens, 0 where the clip binds. One guard Tinker does not document:
    the log-ratio is clamped to [-20, 20] before exp, as verl / Stable-RL do (Stable-RL @ c6af1d1,
    core_algos.py::compute_policy_loss_vanilla). Identical for |log r| <= 20; beyond it an fp32 exp
    overflows, and inf * 0 would put NaN into the gradient, even of masked tokens (a garbage sampler
    logprob) and of A > 0 tokens whose clip binds. Past the clamp the token's gradient is 0.
    """
    log_ratio = torch.clamp(logp - sampler_logp.detach(), min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    clipped = torch.clamp(ratio, min=1.0 - eps_low, max=1.0 + eps_high)
    return -torch.minimum(ratio * adv, clipped * adv)


def dppo_token_loss(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    is_cap: float,
) -> torch.Tensor:
    """DPPO token loss `-A * sg(min(exp(min(logp - logp_s, 20)), c)) * keep * logp`.

    Stable-RL @ c6af1d1, core_algos.py::compute_policy_loss_with_mask: REINFORCE-style
    surrogate whose gradient is -A*min(r, c) on kept tokens (the gradient of -r*A, with
    truncated IS weight); `keep` (0/1, detached) comes from `dppo_drop_mask`.
    """
    log_ratio = torch.clamp(logp.detach() - sampler_logp.detach(), max=LOG_RATIO_CLAMP)
    weight = torch.clamp(torch.exp(log_ratio), max=is_cap)
    return -advantages.detach() * weight * keep.detach() * logp
