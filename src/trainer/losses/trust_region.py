"""Per-token trust-region rules shared by the losses and their counterfactual diagnostics.

Element-wise torch only (no Python branching on tensor values, no `.item()`), so the same
functions run inside the batch loss and inside the torch.fx-traced per-datum loss.
Every returned mask is computed from detached inputs: no gradient flows through it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainer.config.enums import DPPO_MODES
from trainer.config.losses import RULE_DEFAULTS, RULE_TABLE

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


def clamped_ratio(logp: torch.Tensor, anchor_logp: torch.Tensor) -> torch.Tensor:
    """exp(logp - anchor_logp) with the log-ratio clamped to [-20, 20] (differentiable in logp)."""
    return torch.exp(torch.clamp(logp - anchor_logp.detach(), min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP))


def anchor_weight(anchor_logp: torch.Tensor, sampler_logp: torch.Tensor) -> torch.Tensor:
    """sg(pi_anchor / mu): the decoupled-PPO correction from the anchor back to the sampler.

    Exactly 1 when the anchor is the sampler (exp(0)); see `grpo_token_loss`.
    """
    return clamped_ratio(anchor_logp.detach(), sampler_logp).detach()


def grpo_token_loss(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    anchor_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO-clip token loss `-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)`, r = exp(logp - sampler_logp).

    With a recomputed anchor (trainer logprobs before the first update) the clip moves to the
    anchor ratio r_a = pi/pi_anchor and the sampler correction w = sg(pi_anchor/mu) multiplies
    the clipped branch: `-min(r*A, clip(r_a)*w*A)` (decoupled PPO, Hilton et al. 2022, arXiv
    2110.00641; r = r_a*w). Its gradient is -A*r where the anchor clip does not bind and 0
    where it does, as Stable-RL's `ppo_recompute` mask (anchor for the rule, sampler for the
    weight). Without an anchor r_a = r and w = 1: Tinker's `ppo`.

    Tinker built-in `ppo` (docs /tinker/losses/ppo; the `_loss` branch "ppo" of spindle, the open-source
    Tinker-API server pinned in aggregate.py): no dual clip.
    Gradient -A*r on unclipped tokens, 0 where the clip binds. One guard Tinker does not document:
    the log-ratio is clamped to [-20, 20] before exp, as verl / Stable-RL do (Stable-RL @ c6af1d1,
    core_algos.py::compute_policy_loss_vanilla). Identical for |log r| <= 20; beyond it an fp32 exp
    overflows, and inf * 0 would put NaN into the gradient, even of masked tokens (a garbage sampler
    logprob) and of A > 0 tokens whose clip binds. Past the clamp the token's gradient is 0.
    """
    ratio = clamped_ratio(logp, sampler_logp)
    adv = advantages.detach()
    if anchor_logp is None:
        clipped = torch.clamp(ratio, min=1.0 - eps_low, max=1.0 + eps_high)
    else:
        anchor_ratio = clamped_ratio(logp, anchor_logp)
        weight = anchor_weight(anchor_logp, sampler_logp)
        clipped = torch.clamp(anchor_ratio, min=1.0 - eps_low, max=1.0 + eps_high) * weight
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


def importance_sampling_token_loss(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """Tinker's built-in `importance_sampling` token loss `-r*A`, r = exp(logp - sampler_logp).

    Gradient -A*r everywhere: no trust region. The log-ratio is clamped to [-20, 20] as in
    `grpo_token_loss` (identical within it; past it the token's gradient is 0, not NaN).
    """
    return -clamped_ratio(logp, sampler_logp) * advantages.detach()


def cispo_token_loss(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """Tinker's built-in `cispo` token loss `-sg(clip(r, low, high)) * A * logp`.

    The clip truncates the IS weight but never zeroes a token's gradient: -A*clip(r) for
    every token (MiniMax-M1, arXiv 2506.13585, with the weight's bounds as absolute
    thresholds on r, as Tinker configures them).
    """
    weight = torch.clamp(torch.exp(torch.clamp(logp.detach() - sampler_logp.detach(), max=LOG_RATIO_CLAMP)),
                         min=low, max=high)
    return -weight * advantages.detach() * logp


def cispo_clip_active(logp: torch.Tensor, sampler_logp: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Bool mask of tokens whose CISPO weight is truncated: r > high or r < low (either sign of A)."""
    ratio = torch.exp(logp.detach() - sampler_logp.detach())
    return (ratio > high) | (ratio < low)


def sequence_log_ratio(logp: torch.Tensor, anchor_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached mean of logp - anchor_logp over each sequence's loss tokens, shaped to broadcast.

    GSPO's length-normalised sequence log-ratio (arXiv 2507.18071). The last dim is the
    token dim; a row without loss tokens gets 0. Clamped to [-20, 20].
    """
    sel = mask.detach() > 0
    diff = torch.where(sel, logp.detach() - anchor_logp.detach(), torch.zeros_like(logp))
    count = sel.to(logp.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
    return torch.clamp(diff.sum(dim=-1, keepdim=True) / count, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def gspo_token_loss(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    anchor_logp: torch.Tensor | None = None,
) -> torch.Tensor:
    """GSPO-token loss `-min(s_t*A, clip(s_t, 1-eps_low, 1+eps_high)*A)` per token.

    s_t = sg(s) * p/sg(p): every token carries the sequence ratio s = exp(mean log(p/mu)) and the
    gradient of its own logprob (Tinker docs /tinker/losses/gspo; verl-project/verl @ 018f23b5,
    verl/trainer/ppo/core_algos.py::compute_policy_loss_gspo). With a recomputed anchor the clip
    moves to the anchor's sequence ratio s_a and w = sg(s/s_a) multiplies the clipped branch, as in
    `grpo_token_loss`.
    """
    own = logp - logp.detach()
    seq_ratio = torch.exp(sequence_log_ratio(logp, sampler_logp, mask) + own)
    adv = advantages.detach()
    if anchor_logp is None:
        clipped = torch.clamp(seq_ratio, min=1.0 - eps_low, max=1.0 + eps_high)
    else:
        anchor_lr = sequence_log_ratio(logp, anchor_logp, mask)
        weight = torch.exp(sequence_log_ratio(anchor_logp, sampler_logp, mask))
        clipped = torch.clamp(torch.exp(anchor_lr + own), min=1.0 - eps_low, max=1.0 + eps_high) * weight
    return -torch.minimum(seq_ratio * adv, clipped * adv)


def gspo_clip_active(
    logp: torch.Tensor,
    anchor_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:
    """Bool mask of tokens where GSPO's sequence clip binds (A > 0, s > 1+eps_high or A < 0, s < 1-eps_low)."""
    seq_ratio = torch.exp(sequence_log_ratio(logp, anchor_logp, mask)).expand_as(logp)
    adv = advantages.detach()
    return ((adv > 0) & (seq_ratio > 1.0 + eps_high)) | ((adv < 0) & (seq_ratio < 1.0 - eps_low))


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Sum of the earlier entries along the last dim (0 at the first): cat([0], cumsum(x)[:-1]), the
    prefix sums S_{t-1} / W_{t-1} of CPPO, added in the same order as the reference's."""
    total = torch.cumsum(x, dim=-1)
    return torch.cat([torch.zeros_like(total[..., :1]), total[..., :-1]], dim=-1)


def masked_quantile(x: torch.Tensor, sel: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of x over the entries `sel` of each row (last dim), shaped to broadcast; 0 for a row
    without any. Linear interpolation between order statistics, as `torch.quantile` (its lerp included)
    and numpy's default; traceable (a sort and gathers, no Python branch on values)."""
    n = sel.to(x.dtype).sum(dim=-1, keepdim=True)
    last = torch.clamp(n - 1.0, min=0.0)
    ordered = torch.sort(torch.where(sel, x, torch.full_like(x, math.inf)), dim=-1)[0]
    pos = q * last
    lo = torch.floor(pos)
    hi = torch.minimum(lo + 1.0, last)
    value = torch.lerp(torch.gather(ordered, -1, lo.long()), torch.gather(ordered, -1, hi.long()), pos - lo)
    return torch.where(n > 0, value, torch.zeros_like(value))


def cppo_drop_masks(
    logp: torch.Tensor,
    anchor_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
    w_min: float,
    delta_b: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dropped, dropped by the per-token threshold, dropped by the prefix budget alone): bool masks of
    the loss tokens CPPO drops, the complement of its keep rule; the two causes partition `dropped`.

    CPPO, arXiv 2606.10968 Eq. 8-11 and 22, pinned to Tencent-Hunyuan/UniRL @
    e1211ee627228407787fa7d6b41b63d7e300fb28, unirl/algorithms/cppo.py::_cppo_mask. Per sequence (a row;
    the last dim is the token dim), t = 1..T over its loss tokens (mask != 0):
        D_t = |p_t - p_anchor,t|,  w_t = 1 - (1 - w_min)(t - 1)/max(T - 1, 1),  Z_t = w_t D_t,
        S_{t-1} = sum_{j<t} Z_j,  W_{t-1} = sum_{j<t} w_j,
        delta_b^seq = clamp(P90(D_1..T), delta_b, 2 delta_b),
        c_t = min(delta, delta + delta_b^seq W_{t-1} - S_{t-1}),
        keep iff A_t (r_t - 1) <= 0 or Z_t <= c_t,  r_t = exp(clamp(logp - anchor_logp, -20, 20)).
    The paper's text leaves open what the reference code settles:
    - S sums Z_j over *every* earlier token, kept or dropped (a cumsum of Z; the keep decisions do not
      feed back), and W is the cumulative position weight; S_0 = W_0 = 0, so c_1 = delta;
    - T is each sequence's own length and t is 1-based; w is written 1 - (1 - w_min)(t - 1)/max(T - 1, 1),
      the paper's w_min + (1 - w_min)(T - t)/(T - 1) for T > 1, and 1 for T = 1 (the UniRL README's
      formula would give w_min there; its code gives 1, and so the first token's weight is always 1);
    - P90 is over the sequence's own D_1..T (torch.quantile, linear interpolation), not the batch.
    One choice is this project's: the sequence is the row's loss tokens. UniRL's packed segments hold only
    the response (its loss_mask zeroes tokens but they still count in T, S, W and P90); a row here also
    holds prompt and padding positions, whose anchor logprobs are not a policy's, so every position with
    mask 0 is left out of T, t, S, W and P90 and is never dropped.
    With w_min = 1 and delta_b >= 1 (then c_t = delta exactly) this is DPPO's binary-TV rule at delta
    (`dppo_drop_mask`) on every token with A != 0.
    """
    logp = logp.detach()
    anchor_logp = anchor_logp.detach()
    adv = advantages.detach()
    sel = mask.detach() != 0
    zeros = torch.zeros_like(logp)
    ratio = clamped_ratio(logp, anchor_logp)
    pushes_away = adv * (ratio - 1.0) > 0.0
    div = torch.where(sel, torch.abs(torch.exp(logp) - torch.exp(anchor_logp)), zeros)
    count = sel.to(logp.dtype).sum(dim=-1, keepdim=True)
    position = torch.cumsum(sel.to(logp.dtype), dim=-1)
    weight = 1.0 - (1.0 - w_min) * (position - 1.0) / torch.clamp(count - 1.0, min=1.0)
    weight = torch.where(sel, weight, zeros)
    z = weight * div
    budget = torch.clamp(masked_quantile(div, sel, 0.9), min=delta_b, max=2.0 * delta_b)
    threshold = torch.clamp(delta + budget * exclusive_cumsum(weight) - exclusive_cumsum(z), max=delta)
    dropped = sel & pushes_away & (z > threshold)
    over_delta = z > delta
    return dropped, dropped & over_delta, dropped & ~over_delta


# The rule masks of RULE_TABLE (trainer/config/losses.py), one signature for all: the trust regions
# (DPPO, GRPO, GSPO) act on the anchor's ratio, CISPO's weight truncation on the sampler's.
def dppo_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, dppo_mode, dppo_delta_low,
                   dppo_delta_high) -> torch.Tensor:
    return dppo_drop_mask(logp, anchor_logp, advantages, dppo_mode, dppo_delta_low, dppo_delta_high)


def grpo_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, grpo_eps_low,
                   grpo_eps_high) -> torch.Tensor:
    return ppo_clip_active(logp, anchor_logp, advantages, grpo_eps_low, grpo_eps_high)


def cispo_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, cispo_low,
                    cispo_high) -> torch.Tensor:
    return cispo_clip_active(logp, sampler_logp, cispo_low, cispo_high)


def gspo_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, gspo_eps_low,
                   gspo_eps_high) -> torch.Tensor:
    return gspo_clip_active(logp, anchor_logp, advantages, mask, gspo_eps_low, gspo_eps_high)


def cppo_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, cppo_delta, cppo_w_min,
                   cppo_delta_b) -> torch.Tensor:
    return cppo_drop_masks(logp, anchor_logp, advantages, mask, cppo_delta, cppo_w_min, cppo_delta_b)[0]


def cppo_token_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, cppo_delta, cppo_w_min,
                         cppo_delta_b) -> torch.Tensor:
    return cppo_drop_masks(logp, anchor_logp, advantages, mask, cppo_delta, cppo_w_min, cppo_delta_b)[1]


def cppo_budget_rule_mask(logp, sampler_logp, anchor_logp, advantages, mask, *, cppo_delta, cppo_w_min,
                          cppo_delta_b) -> torch.Tensor:
    return cppo_drop_masks(logp, anchor_logp, advantages, mask, cppo_delta, cppo_w_min, cppo_delta_b)[2]


class TrustRegionRules:
    """The rules of RULE_TABLE that every arm evaluates: its own with its own settings (the keyword
    arguments), the others as counterfactuals at their owners' defaults (what that loss would have
    dropped, clipped or truncated on this batch): DPPO binary TV 0.15 (authors' scripts), GRPO 0.2,
    CISPO 0.0 / 4.0 (Tinker), GSPO 3e-4 / 4e-4 (arXiv 2507.18071 section 5.1)."""

    def __init__(self, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(RULE_DEFAULTS))
        if unknown:
            raise TypeError(f"TrustRegionRules: unknown rule setting(s) {unknown}; "
                            f"known: {sorted(RULE_DEFAULTS)}")
        self.settings: dict[str, Any] = {**RULE_DEFAULTS, **settings}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrustRegionRules) and self.settings == other.settings

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.settings.items())))

    def __repr__(self) -> str:
        return f"TrustRegionRules({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    def masks(
        self,
        logp: torch.Tensor,
        sampler_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        anchor_logp: torch.Tensor | None = None,
        names: tuple[str, ...] | None = None,
    ) -> dict[str, torch.Tensor]:
        """{rule: bool mask of the tokens it acts on}, detached, in RULE_TABLE's order: every rule, or those
        `names` lists (only those are computed, so a traced graph calls nothing the others need)."""
        anchor = sampler_logp if anchor_logp is None else anchor_logp
        return {spec.name: _RULE_MASKS[spec.name](logp, sampler_logp, anchor, advantages, mask,
                                                  **{k: self.settings[k] for k, _ in spec.defaults})
                for spec in RULE_TABLE if names is None or spec.name in names}


_RULE_MASKS = {spec.name: globals()[spec.mask] for spec in RULE_TABLE}
