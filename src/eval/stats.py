"""Paired statistics for two arms evaluated on the same items (numpy + stdlib only, no scipy).

Inputs are per-item correctness arrays of one shape: `[n]` for one seed, or `[S, n]` for S seeds
on the same n items. All functions are pure.

Several seeds: one item's results across seeds are correlated (the same question), so the (seed, item)
pairs are not independent draws and must not be counted as S*n samples. The unit of independence is
the item: each item contributes its seed-mean difference d_i = mean_s(correct_T - correct_B), still in
[-1, 1], and the tests run over the n items (at S = 1 this is the single-seed test exactly).

Formulas (textbook, pinned here so the tests can check them independently):
- Hoeffding (1963), Thm 2: for i.i.d. X_i in [a, b], P(|mean - mu| >= t) <= 2 exp(-2 n t^2 / (b-a)^2).
  Per-item differences d_i = correct_T - correct_B lie in [-1, 1] (range 2), so the two-sided
  1-alpha half-width is t = sqrt(2 ln(2/alpha) / n)  (~0.0748 at n = 1319, alpha = 0.05).
- Exact McNemar: under H0 the discordant pairs split b ~ Binomial(b + c, 1/2);
  p = min(1, 2 * sum_{k <= min(b, c)} C(b+c, k) / 2^(b+c)); p = 1 when b + c = 0. With several seeds it
  is the same exact sign test over items: b = items with d_i > 0, c = items with d_i < 0.
- Wilson (1927) score interval for a binomial proportion.
- Paired percentile bootstrap of the mean difference, resampling items (with several seeds an
  item is resampled with all of its seeds, so the correlation of one item across seeds is kept).

Two estimands. The tests above condition on the trained checkpoints: they say whether *these*
checkpoints differ on the item population. Whether the *training procedure* (the loss) makes a
difference is a question about seeds: the unit is the seed pair, the per-seed paired difference
D_s = mean_i(T_si - B_si), and
- Student t interval over seeds: mean(D) +- t_{S-1, 1-alpha/2} sd(D) / sqrt(S). The t CDF for an
  integer df is the finite series of Abramowitz & Stegun (1964) 26.7.3 (odd df) / 26.7.4 (even df).
- Two-level percentile bootstrap: resample S seeds with replacement, then n items with replacement
  within each drawn seed (Davison & Hinkley 1997, sec. 3.8, the "resample both stages" scheme).
- Holm (1979) step-down adjustment when several treatments share one baseline.
Scores may be 0/1 correctness or per-item values in [0, 1] (area under an item's eval curve).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np

METHOD = "paired_hoeffding"

DECISION_RULE = (
    "Paired Hoeffding {conf:g}% CI on the per-item difference in correctness (treatment - baseline; "
    "with several seeds, each item's difference averaged over its seeds), each difference in [-1, 1] "
    "so the half-width is sqrt(2 ln(2/alpha) / n) with n = the number of items. "
    "`validated` only if the lower bound > 0; `worse` if the upper bound < 0; `inconclusive` otherwise."
)


def wilson_interval(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Two-sided 1-alpha Wilson score interval for k successes out of n."""
    _check_alpha(alpha)
    if not (isinstance(n, (int, np.integer)) and n >= 1):
        raise ValueError(f"wilson_interval: n must be an integer >= 1, got {n!r}")
    if not (isinstance(k, (int, np.integer)) and 0 <= k <= n):
        raise ValueError(f"wilson_interval: k must be an integer in [0, n={n}], got {k!r}")
    z = NormalDist().inv_cdf(1.0 - alpha / 2.0)
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2.0 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n))
    # the closed form is exact at k = 0 / k = n; clamp rounding noise only
    return max(0.0, centre - half), min(1.0, centre + half)


def hoeffding_half_width(n: int, alpha: float = 0.05, value_range: float = 2.0) -> float:
    """Two-sided Hoeffding half-width for the mean of n i.i.d. values spanning `value_range`."""
    _check_alpha(alpha)
    if n < 1:
        raise ValueError(f"hoeffding_half_width: n must be >= 1, got {n}")
    if value_range <= 0:
        raise ValueError(f"hoeffding_half_width: value_range must be > 0, got {value_range}")
    return value_range * math.sqrt(math.log(2.0 / alpha) / (2.0 * n))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b (T right, B wrong) and c.

    Summed in log space (lgamma + log-sum-exp), so it is accurate for thousands of pairs."""
    if b < 0 or c < 0:
        raise ValueError(f"mcnemar_exact_p: counts must be >= 0, got b={b}, c={c}")
    m = b + c
    if m == 0:
        return 1.0
    k_K = np.arange(min(b, c) + 1, dtype=np.float64)
    log_pmf_K = (math.lgamma(m + 1) - np.array([math.lgamma(k + 1) + math.lgamma(m - k + 1) for k in k_K])
                 - m * math.log(2.0))
    top = float(log_pmf_K.max())
    log_tail = top + math.log(float(np.exp(log_pmf_K - top).sum()))
    return min(1.0, 2.0 * math.exp(log_tail))


def bootstrap_mean_ci(diff_N: np.ndarray, alpha: float = 0.05, n_resamples: int = 10000,
                      seed: int = 0, chunk: int = 1000) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(diff_N), resampling the N entries with replacement."""
    _check_alpha(alpha)
    means_R = bootstrap_means(diff_N, n_resamples, seed, chunk)
    low, high = np.quantile(means_R, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high)


def bootstrap_means(diff_N: np.ndarray, n_resamples: int = 10000, seed: int = 0, chunk: int = 1000) -> np.ndarray:
    """The n_resamples resampled means of diff_N (items drawn with replacement)."""
    diff_N = np.asarray(diff_N, dtype=np.float64)
    if diff_N.ndim != 1 or diff_N.size == 0:
        raise ValueError(f"bootstrap_mean_ci: need a non-empty 1-D array, got shape {diff_N.shape}")
    if n_resamples < 1:
        raise ValueError(f"bootstrap_mean_ci: n_resamples must be >= 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    n = diff_N.size
    means_R = np.empty(n_resamples, dtype=np.float64)
    # chunked so that B x n indices never need more than chunk x n memory
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        idx_CN = rng.integers(0, n, size=(stop - start, n))
        means_R[start:stop] = diff_N[idx_CN].mean(axis=1)
    return means_R


def decide(ci_low: float, ci_high: float) -> str:
    """The paired-Hoeffding verdict at margin 0 (DECISION_RULE), the one paired_compare reports; eval.compare
    decides with the config's `decision` rule instead (interval_verdict / pvalue_verdict)."""
    return interval_verdict(ci_low, ci_high)


def paired_compare(correct_T: Any, correct_B: Any, alpha: float = 0.05, n_bootstrap: int = 10000,
                   seed: int = 0) -> dict[str, Any]:
    """All paired statistics of treatment vs baseline correctness.

    `correct_T`, `correct_B`: bool/0-1 arrays (or float scores in [0, 1]) of shape [n] or [S, n]
    (S seeds x n items, paired entry by entry). Returns n (paired (seed, item) results) and n_items, accuracies over all n
    results, diff, the Hoeffding CI over items (clipped to [-1, 1]; `half_width` is unclipped),
    verdict, the discordant (seed, item) counts b/c, McNemar's exact p over items (`b_items`/`c_items`:
    items whose seed-mean difference is positive/negative; equal to b/c for one seed) and the
    item-resampling bootstrap CI (None when n_bootstrap == 0)."""
    _check_alpha(alpha)
    t_SN = _as_correct(correct_T, "correct_T")
    b_SN = _as_correct(correct_B, "correct_B")
    if t_SN.shape != b_SN.shape:
        raise ValueError(f"paired_compare: shapes differ: treatment {t_SN.shape} vs baseline {b_SN.shape}")
    if t_SN.size == 0:
        raise ValueError("paired_compare: no items to compare")
    n, n_items = int(t_SN.size), int(t_SN.shape[1])
    if t_SN.dtype == np.bool_ and b_SN.dtype == np.bool_:
        k_t, k_b = int(t_SN.sum()), int(b_SN.sum())
        diff = (k_t - k_b) / n  # exact 0 on all ties; equals the mean over items of d_i
        # the item is the independent unit (see the module docstring): Hoeffding and McNemar over items
        diff_N = (t_SN.astype(np.int64) - b_SN.astype(np.int64)).sum(axis=0)  # S * d_i, exact integers
    else:  # scores in [0, 1]
        k_t, k_b = float(t_SN.sum()), float(b_SN.sum())
        diff_N = (t_SN - b_SN).sum(axis=0)
        diff = float(diff_N.sum()) / n
    half = hoeffding_half_width(n_items, alpha)
    ci_low, ci_high = max(-1.0, diff - half), min(1.0, diff + half)
    b_items, c_items = int((diff_N > 0).sum()), int((diff_N < 0).sum())
    out: dict[str, Any] = {
        "n": n,
        "n_items": n_items,
        "n_seeds": int(t_SN.shape[0]),
        "acc_treatment": k_t / n,
        "acc_baseline": k_b / n,
        "diff": diff,
        "half_width": half,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "method": METHOD,
        "alpha": alpha,
        "verdict": decide(ci_low, ci_high),
        # an item-level test: about these two checkpoints (or evals), never about a training procedure
        "verdict_scope": "fixed_checkpoints",
        "b": int((t_SN > b_SN).sum()),
        "c": int((t_SN < b_SN).sum()),
        "b_items": b_items,
        "c_items": c_items,
        "mcnemar_p": mcnemar_exact_p(b_items, c_items),
        "bootstrap_low": None,
        "bootstrap_high": None,
        "bootstrap_resamples": int(n_bootstrap),
        "bootstrap_seed": int(seed),
    }
    if n_bootstrap > 0:
        # resample items (all seeds of an item together): the mean of d_i over items is `diff`
        out["bootstrap_low"], out["bootstrap_high"] = bootstrap_mean_ci(
            diff_N / t_SN.shape[0], alpha, n_bootstrap, seed)
    return out


def _as_correct(x: Any, name: str) -> np.ndarray:
    """bool [S, n] for 0/1 input; float64 [S, n] for scores in [0, 1] given as floats."""
    a = np.asarray(x)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"{name}: expected shape [n] or [S, n], got {a.shape}")
    if a.dtype != np.bool_:
        if a.size and np.isin(a, (0, 1)).all():
            return a.astype(np.bool_)
        if not np.issubdtype(a.dtype, np.floating) or not (np.isfinite(a).all() and (a >= 0).all()
                                                            and (a <= 1).all()):
            raise ValueError(f"{name}: correctness values must be 0/1 or bool (or float scores in [0, 1])")
        a = a.astype(np.float64)
    return a


def _check_alpha(alpha: float) -> None:
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")


# ----------------------------------------------------------------------------- seed level
def t_cdf(t: float, df: int) -> float:
    """Student t CDF for an integer df >= 1 (Abramowitz & Stegun 26.7.3 / 26.7.4, exact finite series).

    With theta = atan(|t| / sqrt(df)), A = P(|T| < |t|) is
      df = 1:      2 theta / pi
      df odd > 1:  (2/pi) [theta + sin(theta) (cos + (2/3) cos^3 + ... + (2*4..(df-3))/(1*3..(df-2)) cos^(df-2))]
      df even:     sin(theta) [1 + (1/2) cos^2 + (1*3)/(2*4) cos^4 + ... + (1*3..(df-3))/(2*4..(df-2)) cos^(df-2)]
    """
    if isinstance(df, bool) or not isinstance(df, (int, np.integer)) or df < 1:
        raise ValueError(f"t_cdf: df must be an integer >= 1, got {df!r}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    sin, cos = math.sin(theta), math.cos(theta)
    if df % 2:
        term, series = cos, 0.0
        for k in range(1, df - 1, 2):  # cos * prod (2j)/(2j+1) * cos^2 ...
            if k > 1:
                term *= cos * cos * (k - 1) / k
            series += term
        a = 2.0 / math.pi * (theta + sin * series)
    else:
        term, series = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= cos * cos * (k - 1) / k
            series += term
        a = sin * series
    a = min(1.0, max(0.0, a))
    return 0.5 + 0.5 * a if t >= 0 else 0.5 - 0.5 * a


def t_quantile(q: float, df: int) -> float:
    """Inverse of t_cdf by bisection (to ~1e-12 relative)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q must be in (0, 1), got {q!r}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def seed_t_interval(diff_S: Any, alpha: float = 0.05, margin: float = 0.0) -> dict[str, Any]:
    """Student t interval of the mean of per-seed paired differences, and the one-sided p of "> margin".

    p is the two-sided t test of mean = margin when the mean is above it (1 otherwise), so that
    p < alpha exactly when the interval's lower bound is above the margin."""
    _check_alpha(alpha)
    d = np.asarray(diff_S, dtype=np.float64).ravel()
    S = int(d.size)
    if S < 2:
        raise ValueError(f"seed_t_interval: needs >= 2 seeds, got {S}")
    mean = float(d.mean())
    sd = 0.0 if np.ptp(d) == 0 else float(d.std(ddof=1))  # identical gaps: exactly 0, not rounding noise
    se = sd / math.sqrt(S)
    t_crit = t_quantile(1.0 - alpha / 2.0, S - 1)
    if se > 0:
        t_stat = (mean - margin) / se
        p = min(1.0, 2.0 * (1.0 - t_cdf(t_stat, S - 1))) if mean > margin else 1.0
    else:
        # every seed gave the same difference: the sample sd is 0, the t statistic is undefined and the
        # zero-width interval says nothing about the spread the seeds would show with more of them (with
        # discrete per-seed gaps, few items and 2 seeds, ties happen often under no effect). p = 1 and the
        # verdict is at best inconclusive (seed_t_verdict): no evidence is read from a spread never seen.
        t_stat = math.nan
        p = 1.0
    return {"n_seeds": S, "mean": mean, "sd": sd, "se": se, "df": S - 1, "t_crit": t_crit,
            "ci_low": mean - t_crit * se, "ci_high": mean + t_crit * se, "t": t_stat, "p": p,
            "degenerate": se == 0, "per_seed": [float(x) for x in d]}


def seed_t_verdict(low: float, high: float, se: float, margin: float = 0.0) -> str:
    """interval_verdict for the seed-level t, except that a zero spread over seeds (se = 0) says nothing:
    the interval [mean, mean] is an artefact of identical per-seed gaps, not a precise estimate."""
    return "inconclusive" if se == 0 else interval_verdict(low, high, margin)


#: up to this many seed pairs the sign-flip test enumerates all 2^S patterns; beyond, it draws patterns
SIGN_FLIP_EXACT_MAX = 16


def sign_flip_p(diff_S: Any, margin: float = 0.0, n_draws: int = 100_000, seed: int = 0) -> float:
    """Exact two-sided sign-flip (randomisation) p of "mean gap > margin" over S seed pairs: the share of the
    2^S sign patterns of (D_s - margin) whose |mean| is at least the observed one, when the mean is above the
    margin (1 otherwise, as seed_t_interval's p). Its smallest value is 2 / 2^S. Above SIGN_FLIP_EXACT_MAX
    seeds, n_draws random patterns give the valid Monte Carlo p (1 + hits) / (1 + n_draws)."""
    d = np.asarray(diff_S, dtype=np.float64).ravel() - margin
    S = int(d.size)
    if S < 1 or not np.isfinite(d).all():
        raise ValueError(f"sign_flip_p: need >= 1 finite per-seed gap, got {diff_S!r}")
    obs = float(d.mean())
    if obs <= 0:
        return 1.0
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))  # ties (a pattern equal to the observed) count as extreme
    if S <= SIGN_FLIP_EXACT_MAX:
        signs = 1.0 - 2.0 * ((np.arange(2 ** S)[:, None] >> np.arange(S)) & 1)
        return float(np.mean(np.abs(signs @ d) / S >= obs - tol))
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n_draws, 10_000):
        signs = rng.choice((-1.0, 1.0), size=(min(10_000, n_draws - start), S))
        hits += int((np.abs(signs @ d) / S >= obs - tol).sum())
    return (1 + hits) / (1 + n_draws)


def two_level_bootstrap_ci(diff_SN: Any, alpha: float = 0.05, n_resamples: int = 10000, seed: int = 0,
                           chunk: int = 500) -> tuple[float, float, np.ndarray]:
    """Percentile CI of the mean paired difference, resampling seeds, then items within each seed.

    `diff_SN`: per-(seed, item) differences. Returns (low, high, resampled means)."""
    _check_alpha(alpha)
    d = np.asarray(diff_SN, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 1:
        raise ValueError(f"two_level_bootstrap_ci: need [S >= 2, n >= 1] differences, got {d.shape}")
    if n_resamples < 1:
        raise ValueError(f"two_level_bootstrap_ci: n_resamples must be >= 1, got {n_resamples}")
    S, n = d.shape
    rng = np.random.default_rng(seed)
    means_R = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, chunk):
        stop = min(start + chunk, n_resamples)
        r = stop - start
        seeds_RS = rng.integers(0, S, size=(r, S))
        items_RSN = rng.integers(0, n, size=(r, S, n))
        means_R[start:stop] = d[seeds_RS[:, :, None], items_RSN].mean(axis=(1, 2))
    low, high = np.quantile(means_R, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(low), float(high), means_R


# ----------------------------------------------------------------------------- decision rules
#: what a verdict is about, by the rule's unit: the item (the trained checkpoints held fixed) or the seed
#: (a fresh training run of each arm: the procedure, training noise counted)
SCOPE_TEXT = {"fixed_checkpoints": "these checkpoints", "across_seeds": "this training procedure"}
# each method's scope, estimand, rule text and name in the report, and how `auto` resolves: eval.methods
# (the registry)


def hoeffding_p(diff: float, n_items: int, margin: float = 0.0) -> float:
    """Smallest alpha at which the Hoeffding interval's lower bound is above `margin` (1 if diff <= margin):
    2 exp(-n (diff - margin)^2 / 2), the bound of the module docstring solved for alpha."""
    if diff <= margin:
        return 1.0
    return min(1.0, 2.0 * math.exp(-n_items * (diff - margin) ** 2 / 2.0))


def bootstrap_p(means_R: np.ndarray, diff: float, margin: float = 0.0) -> float:
    """Two-sided percentile-bootstrap p of "mean > margin": 2 x the share of resampled means <= margin."""
    if diff <= margin:
        return 1.0
    return min(1.0, 2.0 * float(np.mean(np.asarray(means_R) <= margin)))


def interval_verdict(low: float, high: float, margin: float = 0.0) -> str:
    """The words an interval decides alone: `validated` if the lower bound is above the margin, `worse` if
    the upper bound is below 0 (the treatment scored lower), `inconclusive` otherwise. `equivalent` and
    `not_supported` need the rule's equivalence margin and target gain: eval.comparison.decide_all adds
    them from the same interval."""
    if low > margin:
        return "validated"
    if high < 0:
        return "worse"
    return "inconclusive"


def mcnemar_directional_p(b_items: int, c_items: int) -> float:
    """The exact McNemar p of "the treatment wins more discordant items": the two-sided p when b > c, 1
    otherwise. The direction comes from the counts the test is computed on, never from the mean
    difference: with several seeds (b, c count signs of seed-mean differences) or per-item AUC scores the
    mean can be positive while significantly more items favour the baseline."""
    return mcnemar_exact_p(b_items, c_items) if b_items > c_items else 1.0


def pvalue_verdict(b_items: int, c_items: int, p: float, alpha: float) -> str:
    """The exact McNemar (sign) test's verdicts, keyed on the discordant item counts it tests: `validated`
    if more items favour the treatment (b > c) and p < alpha; `worse` if more favour the baseline (c > b)
    and the same test's p < alpha; `inconclusive` otherwise."""
    if b_items > c_items and p < alpha:
        return "validated"
    if c_items > b_items and mcnemar_exact_p(b_items, c_items) < alpha:
        return "worse"
    return "inconclusive"


def holm_adjust(p_K: Any) -> list[float]:
    """Holm's step-down adjusted p-values: p_adj(j) = max_{i <= j} min(1, (K - i + 1) p_(i)) in sorted order."""
    p = np.asarray(p_K, dtype=np.float64).ravel()
    if p.size == 0:
        return []
    if not ((p >= 0) & (p <= 1)).all():
        raise ValueError(f"holm_adjust: p-values must be in [0, 1], got {p.tolist()}")
    order = np.argsort(p, kind="stable")
    K = p.size
    adj = np.empty(K)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (K - rank) * p[i]))
        adj[i] = running
    return [float(x) for x in adj]
