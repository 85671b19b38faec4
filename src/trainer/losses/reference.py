"""Independent reference implementation of the losses, for the correctness preflight.

Written from the formulas (docs/architecture.md, /work/shared/references/losses-spec.md
sections 2a, 3a, 3b, 6), not from the plugin code: plain Python floats (float64), one
token at a time, explicit if/else branches, closed-form gradients d(loss)/d(logp).
Slow by design; meant for fixtures of a few thousand tokens.

- GRPO (Tinker `ppo`): l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); dl/dlogp = -A*r
  unless the clipped branch is strictly smaller (A > 0, r > 1+eps_high or A < 0,
  r < 1-eps_low), where it is 0.
- DPPO (Stable-RL @ c6af1d1 compute_policy_loss_with_mask): w = min(exp(min(logp -
  logp_s, 20)), c); l = -A*w*keep*logp; dl/dlogp = -A*w*keep; keep from the binary TV /
  binary KL rule with the A > 0 / A <= 0 directions.
- Aggregation weights: sum 1; token_mean 1/N; seq_mean_token_sum 1/S; seq_mean_token_mean
  1/(S*n_i) with N loss tokens, S non-empty sequences, n_i tokens of sequence i.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

Rows = Sequence[Sequence[float]]


@dataclass
class RefResult:
    value: float
    grad: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


def ref_grpo_token(lp: float, slp: float, a: float, eps_low: float, eps_high: float) -> tuple[float, float]:
    """(loss, dloss/dlogp) of one token under the PPO clip."""
    r = math.exp(lp - slp)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    r_clipped = lo if r < lo else (min(r, hi))
    unclipped, clipped = r * a, r_clipped * a
    if clipped < unclipped:
        return -clipped, 0.0
    return -unclipped, -a * r


def ref_binary_kl(lp: float, slp: float) -> float:
    ps = math.exp(slp)
    p = min(math.exp(lp), 1.0)
    return ps * (slp - lp) + (1.0 - ps) * math.log((1.0 - ps + 1e-8) / (1.0 - p + 1e-8))


def ref_dppo_dropped(lp: float, slp: float, a: float, mode: str, delta_low: float, delta_high: float) -> bool:
    p, ps = math.exp(lp), math.exp(slp)
    if mode == "binary_tv":
        if a > 0:
            return p - ps > delta_high
        return p - ps < -delta_low
    if mode == "binary_kl":
        kl = ref_binary_kl(lp, slp)
        if a > 0:
            return kl > delta_high and p > ps
        return kl > delta_low and p < ps
    raise ValueError(f"unknown DPPO mode {mode!r}")


def ref_dppo_token(
    lp: float, slp: float, a: float, mode: str, delta_low: float, delta_high: float, cap: float
) -> tuple[float, float]:
    """(loss, dloss/dlogp) of one token under DPPO."""
    w = min(math.exp(min(lp - slp, 20.0)), cap)
    keep = 0.0 if ref_dppo_dropped(lp, slp, a, mode, delta_low, delta_high) else 1.0
    return -a * w * keep * lp, -a * w * keep


def _weights(mask: Rows, aggregation: str) -> list[list[float]]:
    counts = [sum(1 for m in row if m != 0) for row in mask]
    n_tokens = sum(counts)
    n_seqs = sum(1 for c in counts if c > 0)
    out = []
    for row, c in zip(mask, counts):
        if aggregation == "sum":
            w = 1.0
        elif aggregation == "token_mean":
            w = 1.0 / n_tokens
        elif aggregation == "seq_mean_token_sum":
            w = 1.0 / n_seqs
        elif aggregation == "seq_mean_token_mean":
            w = 1.0 / (n_seqs * c) if c else 0.0
        else:
            raise ValueError(f"unknown aggregation {aggregation!r}")
        out.append([w if m != 0 else 0.0 for m in row])
    return out


def _quantile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy / torch default)."""
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def ref_diagnostics(
    logp: Rows,
    sampler_logp: Rows,
    adv: Rows,
    mask: Rows,
    *,
    drop_mode: str,
    drop_delta_low: float,
    drop_delta_high: float,
    clip_eps_low: float,
    clip_eps_high: float,
    cap: float,
) -> dict[str, float]:
    """The shared diagnostics, token by token (see trainer.losses.diagnostics for meanings)."""
    n = n_nonzero = dropped = dropped_nonzero = clipped = cap_hits = 0
    ratio_sum = k3_sum = 0.0
    ratio_max = -math.inf
    abs_dp: list[float] = []
    for lp_row, s_row, a_row, m_row in zip(logp, sampler_logp, adv, mask):
        for lp, slp, a, m in zip(lp_row, s_row, a_row, m_row):
            if m == 0:
                continue
            n += 1
            r = math.exp(lp - slp)
            is_dropped = ref_dppo_dropped(lp, slp, a, drop_mode, drop_delta_low, drop_delta_high)
            dropped += is_dropped
            if a != 0:
                n_nonzero += 1
                dropped_nonzero += is_dropped
            if (a > 0 and r > 1.0 + clip_eps_high) or (a < 0 and r < 1.0 - clip_eps_low):
                clipped += 1
            cap_hits += r > cap
            ratio_sum += r
            ratio_max = max(ratio_max, r)
            k3_sum += r - 1.0 - (lp - slp)
            abs_dp.append(abs(math.exp(lp) - math.exp(slp)))
    abs_dp.sort()
    return {
        "loss/dppo_masked_frac": dropped / n,
        "loss/dppo_masked_frac_nonzero_adv": dropped_nonzero / n_nonzero if n_nonzero else 0.0,
        "loss/grpo_clip_frac": clipped / n,
        "drift/abs_p_q50": _quantile(abs_dp, 0.5),
        "drift/abs_p_q90": _quantile(abs_dp, 0.9),
        "drift/abs_p_q99": _quantile(abs_dp, 0.99),
        "drift/abs_p_max": abs_dp[-1],
        "drift/kl_sampler_current": k3_sum / n,
        "ratio/mean": ratio_sum / n,
        "ratio/max": ratio_max,
        "ratio/cap_hits": float(cap_hits),
        "loss/n_tokens": float(n),
    }


def _reduce(token_fn, logp: Rows, sampler_logp: Rows, adv: Rows, mask: Rows, aggregation: str) -> RefResult:
    weights = _weights(mask, aggregation)
    value = 0.0
    grad = []
    for lp_row, s_row, a_row, w_row in zip(logp, sampler_logp, adv, weights):
        g_row = []
        for lp, slp, a, w in zip(lp_row, s_row, a_row, w_row):
            if w == 0.0:
                g_row.append(0.0)
                continue
            loss_t, grad_t = token_fn(lp, slp, a)
            value += w * loss_t
            g_row.append(w * grad_t)
        grad.append(g_row)
    return RefResult(value=value, grad=grad)


def ref_grpo(
    logp: Rows,
    sampler_logp: Rows,
    adv: Rows,
    mask: Rows,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: str = "sum",
    cf_dppo_delta: float = 0.15,
    cap: float = 1e4,
) -> RefResult:
    """Reference GRPO loss value, gradient and diagnostics on `[B][T]` nested lists."""
    res = _reduce(
        lambda lp, slp, a: ref_grpo_token(lp, slp, a, eps_low, eps_high),
        logp,
        sampler_logp,
        adv,
        mask,
        aggregation,
    )
    res.metrics = ref_diagnostics(
        logp,
        sampler_logp,
        adv,
        mask,
        drop_mode="binary_tv",
        drop_delta_low=cf_dppo_delta,
        drop_delta_high=cf_dppo_delta,
        clip_eps_low=eps_low,
        clip_eps_high=eps_high,
        cap=cap,
    )
    return res


def ref_dppo(
    logp: Rows,
    sampler_logp: Rows,
    adv: Rows,
    mask: Rows,
    *,
    mode: str = "binary_tv",
    delta_low: float = 0.15,
    delta_high: float = 0.15,
    cap: float = 1e4,
    aggregation: str = "sum",
    cf_grpo_eps: float = 0.2,
) -> RefResult:
    """Reference DPPO loss value, gradient and diagnostics on `[B][T]` nested lists."""
    res = _reduce(
        lambda lp, slp, a: ref_dppo_token(lp, slp, a, mode, delta_low, delta_high, cap),
        logp,
        sampler_logp,
        adv,
        mask,
        aggregation,
    )
    res.metrics = ref_diagnostics(
        logp,
        sampler_logp,
        adv,
        mask,
        drop_mode=mode,
        drop_delta_low=delta_low,
        drop_delta_high=delta_high,
        clip_eps_low=cf_grpo_eps,
        clip_eps_high=cf_grpo_eps,
        cap=cap,
    )
    return res
