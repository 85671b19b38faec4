"""Tinker's built-in losses, per datum, summed over tokens (no normalisation), as the service does.

Definitions: tinker-docs `/tinker/losses` and tinker-cookbook 0.5.8 `tutorials/202_loss_functions.py`. `lp` = learner logprobs of the target
tokens, `slp` = `loss_fn_inputs["logprobs"]` (sampler), `A` = `loss_fn_inputs["advantages"]`,
`r = exp(lp - slp)`:
- cross_entropy:       sum(-lp * weights)             (weights default to ones here)
- importance_sampling: -sum(r * A)
- ppo:                 -sum(min(r * A, clip(r, lo, hi) * A)), lo/hi = clip_low/high_threshold (0.8/1.2)
- cispo:               -sum(sg(clip(r, lo, hi)) * lp * A),     defaults 0.0/4.0
- dro:                 -sum(lp * A - 0.5 * beta * (lp - slp)^2), beta required
- gspo:                -sum(min(s_t * A, clip(s_t, lo, hi) * A)), s_t = sg(s) * exp(lp - sg(lp)),
                       s = exp(mean of (lp - slp) over the positions `sequence_ratio_mask` marks)
                       (docs /tinker/losses/gspo, GSPO-token). The docs state no defaults for its
                       thresholds or mask, so the local engine requires `clip_low_threshold`,
                       `clip_high_threshold` (absolute bounds on s, as for ppo) and the mask input.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

_RL_INPUTS = ("logprobs", "advantages")
DEFAULT_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {},
    "gspo": {},
}
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": _RL_INPUTS,
    "ppo": _RL_INPUTS,
    "cispo": _RL_INPUTS,
    "dro": _RL_INPUTS,
    "gspo": _RL_INPUTS + ("sequence_ratio_mask",),
}
_ALLOWED_CONFIG = {"cross_entropy": set(), "importance_sampling": set(),
                   "ppo": {"clip_low_threshold", "clip_high_threshold"},
                   "cispo": {"clip_low_threshold", "clip_high_threshold"}, "dro": {"beta"},
                 "gspo": {"clip_low_threshold", "clip_high_threshold"}}


def resolve_config(loss_fn: str, loss_fn_config: Mapping[str, Any] | None) -> dict[str, float]:
    """Defaults merged with the caller's config; unknown loss names / keys are ValueErrors."""
    if loss_fn not in DEFAULT_CONFIG:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; the local engine implements "
                         f"{sorted(DEFAULT_CONFIG)} (and forward_backward_custom for anything else)")
    fn_config = dict(DEFAULT_CONFIG[loss_fn])
    for k, v in (loss_fn_config or {}).items():
        if k not in _ALLOWED_CONFIG[loss_fn]:
            raise ValueError(f"loss_fn_config key {k!r} is not used by {loss_fn!r} "
                             f"(allowed: {sorted(_ALLOWED_CONFIG[loss_fn])})")
        fn_config[k] = float(v)
    if loss_fn == "dro" and "beta" not in fn_config:
        raise ValueError("loss_fn 'dro' needs loss_fn_config={'beta': ...}")
    if loss_fn == "gspo" and not {"clip_low_threshold", "clip_high_threshold"} <= set(fn_config):
        raise ValueError("loss_fn 'gspo' needs loss_fn_config={'clip_low_threshold': ..., 'clip_high_threshold': ...} "
                         "on the local engine (no documented defaults)")
    return fn_config


def _ratio(lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(lp - inputs["logprobs"])


def _cross_entropy(lp, inputs, fn_config):
    w = inputs.get("weights")
    return -(lp * w).sum() if w is not None else -lp.sum()


def _importance_sampling(lp, inputs, fn_config):
    return -(_ratio(lp, inputs) * inputs["advantages"]).sum()


def _ppo(lp, inputs, fn_config):
    r, A = _ratio(lp, inputs), inputs["advantages"]
    clipped = torch.clamp(r, fn_config["clip_low_threshold"], fn_config["clip_high_threshold"])
    return -torch.minimum(r * A, clipped * A).sum()


def _cispo(lp, inputs, fn_config):
    r, A = _ratio(lp, inputs), inputs["advantages"]
    clipped = torch.clamp(r, fn_config["clip_low_threshold"], fn_config["clip_high_threshold"]).detach()
    return -(clipped * lp * A).sum()


def _dro(lp, inputs, fn_config):
    A, slp = inputs["advantages"], inputs["logprobs"]
    return -(lp * A - 0.5 * fn_config["beta"] * (lp - slp) ** 2).sum()


def _gspo(lp, inputs, fn_config):
    A, in_ratio = inputs["advantages"], inputs["sequence_ratio_mask"] != 0
    log_ratio = (lp.detach() - inputs["logprobs"])[in_ratio].mean() if bool(in_ratio.any()) else lp.new_zeros(())
    ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, fn_config["clip_low_threshold"], fn_config["clip_high_threshold"])
    return -torch.minimum(ratio * A, clipped * A).sum()


LOSSES: dict[str, Callable[[torch.Tensor, Mapping[str, torch.Tensor], dict[str, float]], torch.Tensor]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
}


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               fn_config: dict[str, float]) -> torch.Tensor:
    """Scalar loss of one datum (`lp` has the shape of its target_tokens)."""
    return LOSSES[loss_fn](lp, inputs, fn_config)
