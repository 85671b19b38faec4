"""Independent reference implementation of the losses, for the correctness preflight.

Written from the formulas (docs/architecture.md and the sources pinned in each plugin's
docstring), not from the plugin code: plain Python floats (float64), one
token at a time, explicit if/else branches, closed-form gradients d(loss)/d(logp).
Slow by design; meant for fixtures of a few thousand tokens.

- GRPO (Tinker `ppo`): l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); dl/dlogp = -A*r
  unless the clipped branch is strictly smaller (A > 0, r > 1+eps_high or A < 0,
  r < 1-eps_low), where it is 0.
- DPPO (Stable-RL @ c6af1d1 compute_policy_loss_with_mask): w = min(exp(min(logp -
  logp_s, 20)), c); l = -A*w*keep*logp; dl/dlogp = -A*w*keep; keep from the binary TV /
  binary KL rule with the A > 0 / A <= 0 directions.
- CPPO (UniRL @ e1211ee cppo.py::_cppo_mask, arXiv 2606.10968 Eq. 8-11, 22): DPPO's l and dl/dlogp with
  keep from CPPO's rule, walked token by token along each sequence's loss tokens t = 1..T: D_t = |p - p_a|,
  w_t = w_min + (1 - w_min)(T - t)/(T - 1) (1 when T = 1), Z_t = w_t D_t, running sums S and W of the
  earlier Z and w, b = clamp(P90 of the sequence's D, delta_b, 2 delta_b), c_t = min(delta, delta + b W - S);
  dropped iff A (r_a - 1) > 0 and Z_t > c_t; by the per-token threshold if Z_t > delta, else by the budget.
- Importance sampling (Tinker `importance_sampling`): l = -r*A; dl/dlogp = -A*r.
- CISPO (Tinker `cispo`): w = clip(r, low, high); l = -w*A*logp; dl/dlogp = -A*w.
- GSPO (Tinker `gspo`, GSPO-token): s = exp(mean of logp - logp_s over the sequence's loss
  tokens); l = -min(s*A, clip(s, 1-eps_low, 1+eps_high)*A) on each token; dl/dlogp_t = -A*s
  unless the clipped branch is strictly smaller, where it is 0.
- Recomputed anchor a: the GRPO/GSPO clip is on the ratio to a and the clipped branch carries
  w = pi_a/mu (decoupled PPO); the DPPO rule is on a, its weight on the sampler.
- KL to the initial weights: k3 = exp(d) - 1 - d, d = ref - logp; dk3/dlogp = 1 - exp(d);
  the loss adds kl_coef times k3 aggregated like the policy term.
- Aggregation weights: sum 1; token_mean 1/N; seq_mean_token_sum 1/S; seq_mean_token_mean
  1/(S*n_i); seq_mean_token_sum_norm 1/(S*H) with N loss tokens, S non-empty sequences, n_i
  tokens of sequence i, H the configured constant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainer.config.losses import RULE_DEFAULTS, RULE_NAMES

Rows = Sequence[Sequence[float]]


@dataclass
class RefResult:
    value: float
    grad: list[list[float]]
    metrics: dict[str, float] = field(default_factory=dict)


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


def ref_cppo_causes(lp_row: Sequence[float], alp_row: Sequence[float], a_row: Sequence[float],
                    m_row: Sequence[float], delta: float, w_min: float, delta_b: float) -> list[str | None]:
    """Per position of one sequence: why CPPO drops the token ("token": Z_t > delta; "budget": only the
    prefix budget's c_t < delta), or None (kept, or not a loss token)."""
    idx = [j for j, m in enumerate(m_row) if m != 0]
    big_t = len(idx)
    div = [abs(math.exp(lp_row[j]) - math.exp(alp_row[j])) for j in idx]
    budget = min(max(_quantile(sorted(div), 0.9), delta_b), 2.0 * delta_b) if div else 0.0
    out: list[str | None] = [None] * len(m_row)
    spent = weights = 0.0
    for t, (j, d) in enumerate(zip(idx, div), start=1):
        w = w_min + (1.0 - w_min) * (big_t - t) / (big_t - 1) if big_t > 1 else 1.0
        z = w * d
        c = min(delta, delta + budget * weights - spent)
        r_a = math.exp(min(max(lp_row[j] - alp_row[j], -20.0), 20.0))
        if a_row[j] * (r_a - 1.0) > 0 and z > c:
            out[j] = "token" if z > delta else "budget"
        spent += z
        weights += w
    return out


def _weights(mask: Rows, aggregation: str, norm_length: float | None = None) -> list[list[float]]:
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
        elif aggregation == "seq_mean_token_sum_norm":
            if norm_length is None:
                raise ValueError("seq_mean_token_sum_norm needs norm_length")
            w = 1.0 / (n_seqs * norm_length)
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


def ref_clip_token(
    lp: float, slp: float, alp: float, a: float, eps_low: float, eps_high: float
) -> tuple[float, float]:
    """(loss, dloss/dlogp) of one token under the PPO clip anchored at `alp` (alp = slp: Tinker ppo)."""
    r, r_a, w = math.exp(lp - slp), math.exp(lp - alp), math.exp(alp - slp)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    # the clipped branch is the smaller one exactly when the clip binds in the direction of A
    # (decided on r_a itself: r and r_a * w agree only up to rounding)
    if (a > 0 and r_a > hi) or (a < 0 and r_a < lo):
        return -(lo if r_a < lo else hi) * w * a, 0.0
    return -r * a, -a * r


def ref_cispo_token(lp: float, slp: float, a: float, low: float, high: float) -> tuple[float, float]:
    w = min(max(math.exp(min(lp - slp, 20.0)), low), high)
    return -w * a * lp, -w * a


def ref_is_token(lp: float, slp: float, a: float) -> tuple[float, float]:
    r = math.exp(lp - slp)
    return -r * a, -r * a


def _seq_mean(row_a: Sequence[float], row_b: Sequence[float], m_row: Sequence[float]) -> float:
    diffs = [x - y for x, y, m in zip(row_a, row_b, m_row) if m != 0]
    return sum(diffs) / len(diffs) if diffs else 0.0


def _seq_ratios(logp: Rows, sampler_logp: Rows, anchor_logp: Rows, mask: Rows) -> list[tuple[float, float, float]]:
    """Per sequence: (s, s_a, w) = exp of the mean log-ratios current/sampler, current/anchor, anchor/sampler."""
    return [
        (math.exp(_seq_mean(lp, slp, m)), math.exp(_seq_mean(lp, alp, m)), math.exp(_seq_mean(alp, slp, m)))
        for lp, slp, alp, m in zip(logp, sampler_logp, anchor_logp, mask)
    ]


def ref_gspo_token(
    s: float, s_a: float, w: float, a: float, eps_low: float, eps_high: float
) -> tuple[float, float]:
    """(loss, dloss/dlogp_t) of one token of a sequence with ratios (s, s_a, w) under GSPO-token."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    if (a > 0 and s_a > hi) or (a < 0 and s_a < lo):
        return -(lo if s_a < lo else hi) * w * a, 0.0
    return -s * a, -a * s


#: The rule settings of the diagnostics (each loss's defaults; a plugin overrides its own). The names and
#: defaults come from the rule table; each rule's formula below is this module's own.
DEFAULT_RULES: dict[str, Any] = dict(RULE_DEFAULTS)


def ref_diagnostics(
    logp: Rows,
    sampler_logp: Rows,
    adv: Rows,
    mask: Rows,
    *,
    rules: dict[str, Any] | None = None,
    anchor_logp: Rows | None = None,
    cap: float = 1e4,
) -> dict[str, float]:
    """The shared diagnostics, token by token (see trainer.losses.diagnostics for meanings)."""
    rl = {**DEFAULT_RULES, **(rules or {})}
    anchor = sampler_logp if anchor_logp is None else anchor_logp
    seq = _seq_ratios(logp, sampler_logp, anchor, mask)
    counts = {k: 0 for k in ("n", "pos", "neg", "nonzero", "dppo_nonzero", "cap_hits")}
    hits = {f"{rule}{sfx}": 0 for rule in RULE_NAMES for sfx in ("", "_pos", "_neg")}
    ratio_sum = k3_sum = nll_sum = 0.0
    ratio_max = -math.inf
    abs_dp: list[float] = []
    for i, (lp_row, s_row, a_row, m_row, al_row) in enumerate(zip(logp, sampler_logp, adv, mask, anchor)):
        s_a = seq[i][1]
        cppo = ref_cppo_causes(lp_row, al_row, a_row, m_row, rl["cppo_delta"], rl["cppo_w_min"],
                               rl["cppo_delta_b"])
        for lp, slp, a, m, alp, why in zip(lp_row, s_row, a_row, m_row, al_row, cppo):
            if m == 0:
                continue
            r, r_a = math.exp(lp - slp), math.exp(lp - alp)
            acts = {
                "dppo_masked": ref_dppo_dropped(
                    lp, alp, a, rl["dppo_mode"], rl["dppo_delta_low"], rl["dppo_delta_high"]
                ),
                "grpo_clip": (a > 0 and r_a > 1.0 + rl["grpo_eps_high"]) or (a < 0 and r_a < 1.0 - rl["grpo_eps_low"]),
                "cispo_clip": r > rl["cispo_high"] or r < rl["cispo_low"],
                "gspo_clip": (a > 0 and s_a > 1.0 + rl["gspo_eps_high"]) or (a < 0 and s_a < 1.0 - rl["gspo_eps_low"]),
                "cppo_masked": why is not None,
                "cppo_token_masked": why == "token",
                "cppo_budget_masked": why == "budget",
            }
            if set(acts) != set(RULE_NAMES):
                raise ValueError(f"ref_diagnostics has formulas for {sorted(acts)}, the rule table names "
                                 f"{sorted(RULE_NAMES)}: add the new rule's formula here")
            counts["n"] += 1
            counts["pos"] += a > 0
            counts["neg"] += a < 0
            counts["nonzero"] += a != 0
            counts["dppo_nonzero"] += a != 0 and acts["dppo_masked"]
            for rule, hit in acts.items():
                hits[rule] += hit
                hits[f"{rule}_pos"] += hit and a > 0
                hits[f"{rule}_neg"] += hit and a < 0
            counts["cap_hits"] += r > cap
            ratio_sum += r
            ratio_max = max(ratio_max, r)
            k3_sum += r - 1.0 - (lp - slp)
            nll_sum += -slp
            abs_dp.append(abs(math.exp(lp) - math.exp(slp)))
    abs_dp.sort()
    n = counts["n"]

    def frac(k: int, among: int) -> float:
        return k / among if among else 0.0

    out = {
        "loss/dppo_masked_frac_nonzero_adv": frac(counts["dppo_nonzero"], counts["nonzero"]),
        "drift/abs_p_q50": _quantile(abs_dp, 0.5),
        "drift/abs_p_q90": _quantile(abs_dp, 0.9),
        "drift/abs_p_q99": _quantile(abs_dp, 0.99),
        "drift/abs_p_max": abs_dp[-1],
        "drift/kl_sampler_current": k3_sum / n,
        "ratio/mean": ratio_sum / n,
        "ratio/max": ratio_max,
        "ratio/cap_hits": float(counts["cap_hits"]),
        "entropy/sampled_token_estimate": nll_sum / n,
        "loss/n_tokens": float(n),
    }
    for rule in RULE_NAMES:
        out[f"loss/{rule}_frac"] = hits[rule] / n
        out[f"loss/{rule}_frac_adv_pos"] = frac(hits[f"{rule}_pos"], counts["pos"])
        out[f"loss/{rule}_frac_adv_neg"] = frac(hits[f"{rule}_neg"], counts["neg"])
    return out


def _reduce(
    token_fn, logp: Rows, sampler_logp: Rows, adv: Rows, mask: Rows, aggregation: str,
    norm_length: float | None = None, anchor_logp: Rows | None = None,
) -> RefResult:
    """`token_fn(i, t, lp, slp, alp, a) -> (loss, dloss/dlogp)` (sequence i, position t) reduced with the
    aggregation weights."""
    weights = _weights(mask, aggregation, norm_length)
    anchor = sampler_logp if anchor_logp is None else anchor_logp
    value = 0.0
    grad = []
    for i, (lp_row, s_row, a_row, w_row, al_row) in enumerate(zip(logp, sampler_logp, adv, weights, anchor)):
        g_row = []
        for t, (lp, slp, a, w, alp) in enumerate(zip(lp_row, s_row, a_row, w_row, al_row)):
            if w == 0.0:
                g_row.append(0.0)
                continue
            loss_t, grad_t = token_fn(i, t, lp, slp, alp, a)
            value += w * loss_t
            g_row.append(w * grad_t)
        grad.append(g_row)
    return RefResult(value=value, grad=grad)


def _add_kl(res: RefResult, logp: Rows, ref_logp: Rows, mask: Rows, aggregation: str,
            norm_length: float | None, kl_coef: float) -> None:
    weights = _weights(mask, aggregation, norm_length)
    total = n = 0.0
    for i, (lp_row, r_row, w_row, m_row) in enumerate(zip(logp, ref_logp, weights, mask)):
        for t, (lp, ref, w, m) in enumerate(zip(lp_row, r_row, w_row, m_row)):
            if m == 0:
                continue
            d = ref - lp
            k3 = math.exp(d) - 1.0 - d
            res.value += kl_coef * w * k3
            res.grad[i][t] += kl_coef * w * (1.0 - math.exp(d))
            total += k3
            n += 1
    res.metrics["loss/kl_ref"] = total / n


def ref_loss(
    loss: str,
    logp: Rows,
    sampler_logp: Rows,
    adv: Rows,
    mask: Rows,
    *,
    aggregation: str = "sum",
    norm_length: float | None = None,
    anchor_logp: Rows | None = None,
    ref_logp: Rows | None = None,
    kl_coef: float = 0.0,
    rules: dict[str, Any] | None = None,
    cap: float = 1e4,
    **params: Any,
) -> RefResult:
    """Reference value, gradient and diagnostics of `loss` (grpo | dppo | cppo | importance_sampling |
    cispo | gspo) on `[B][T]` nested lists. `params` are the loss's own settings:
    grpo eps_low/eps_high; dppo mode/delta_low/delta_high (cap = c); cppo delta/w_min/delta_b (cap = c);
    cispo low/high; gspo eps_low/eps_high. `rules` overrides the diagnostics' counterfactual settings."""
    anchor = sampler_logp if anchor_logp is None else anchor_logp
    rl = dict(rules or {})
    if loss == "grpo":
        el, eh = params.get("eps_low", 0.2), params.get("eps_high", 0.2)
        rl.update(grpo_eps_low=el, grpo_eps_high=eh)

        def fn(i, t, lp, slp, alp, a):
            return ref_clip_token(lp, slp, alp, a, el, eh)
    elif loss == "dppo":
        mode = params.get("mode", "binary_tv")
        dl, dh = params.get("delta_low", 0.15), params.get("delta_high", 0.15)
        rl.update(dppo_mode=mode, dppo_delta_low=dl, dppo_delta_high=dh)

        def fn(i, t, lp, slp, alp, a):
            w = min(math.exp(min(lp - slp, 20.0)), cap)
            keep = 0.0 if ref_dppo_dropped(lp, alp, a, mode, dl, dh) else 1.0
            return -a * w * keep * lp, -a * w * keep
    elif loss == "cppo":
        delta, w_min = params.get("delta", 0.15), params.get("w_min", 0.8)
        delta_b = params.get("delta_b", 0.02)
        rl.update(cppo_delta=delta, cppo_w_min=w_min, cppo_delta_b=delta_b)
        causes = [ref_cppo_causes(lp_row, al_row, a_row, m_row, delta, w_min, delta_b)
                  for lp_row, al_row, a_row, m_row in zip(logp, anchor, adv, mask)]

        def fn(i, t, lp, slp, alp, a):
            w = min(math.exp(min(lp - slp, 20.0)), cap)
            keep = 0.0 if causes[i][t] is not None else 1.0
            return -a * w * keep * lp, -a * w * keep
    elif loss == "importance_sampling":

        def fn(i, t, lp, slp, alp, a):
            return ref_is_token(lp, slp, a)
    elif loss == "cispo":
        low, high = params.get("low", 0.0), params.get("high", 4.0)
        rl.update(cispo_low=low, cispo_high=high)

        def fn(i, t, lp, slp, alp, a):
            return ref_cispo_token(lp, slp, a, low, high)
    elif loss == "gspo":
        el, eh = params.get("eps_low", 3e-4), params.get("eps_high", 4e-4)
        rl.update(gspo_eps_low=el, gspo_eps_high=eh)
        seq = _seq_ratios(logp, sampler_logp, anchor, mask)

        def fn(i, t, lp, slp, alp, a):
            return ref_gspo_token(*seq[i], a, el, eh)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    res = _reduce(fn, logp, sampler_logp, adv, mask, aggregation, norm_length, anchor_logp)
    res.metrics = ref_diagnostics(logp, sampler_logp, adv, mask, rules=rl, anchor_logp=anchor_logp, cap=cap)
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        _add_kl(res, logp, ref_logp, mask, aggregation, norm_length, kl_coef)
    return res


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
    return ref_loss("grpo", logp, sampler_logp, adv, mask, aggregation=aggregation, cap=cap, eps_low=eps_low,
                    eps_high=eps_high, rules={"dppo_delta_low": cf_dppo_delta, "dppo_delta_high": cf_dppo_delta})


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
    return ref_loss("dppo", logp, sampler_logp, adv, mask, aggregation=aggregation, cap=cap, mode=mode,
                    delta_low=delta_low, delta_high=delta_high,
                    rules={"grpo_eps_low": cf_grpo_eps, "grpo_eps_high": cf_grpo_eps})
