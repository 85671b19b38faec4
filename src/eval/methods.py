"""The decision methods of eval.compare, one class each, and the registry everything else reads.

A method holds what belongs to it alone: its statistic on one treatment's paired scores (`row`), its
interval at a level (Holm's step-down and the sequential looks decide at levels below alpha), its verdict,
its scope (these checkpoints, or this training procedure), how the report names it, and its design
functions (closed-form power, and the decision on simulated sweeps that eval.design and the preflight
design gate run). compare, the report, eval.design and the design gate iterate over METHODS: adding a
method is one class here (plus, for a method that decides, its name in trainer.config.enums.DECISION_METHODS,
which must equal DECIDING: tests/test_decisive.py checks it) and its tests and docs.

Equivalence (decision.equivalence_margin) is the two one-sided tests (Schuirmann 1987) read from the
method's own two-sided 1 - level interval: each bound is a one-sided test at level / 2, and the interval
inside +-margin rejects both "gap <= -margin" and "gap >= +margin". A method without an interval (the exact
tests) cannot say `equivalent`, nor `not_supported` (the interval's upper bound below decision.target_effect).

The words: `validated` (lower bound above the margin), `worse` (upper bound below 0), `equivalent`
(interval of non-zero width inside +-equivalence margin), `not_supported` (upper bound below the plan's target
gain), `inconclusive` otherwise; compare adds `inert` (the switch never acted). Under no effect a sweep reads
`validated` or `worse` each at most alpha / 2 of the time, and `inconclusive` otherwise, unless the rule also
names an equivalence margin or a target (eval.calibrate verdicts).
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, ClassVar

import numpy as np

from eval.stats import (
    bootstrap_means,
    bootstrap_p,
    hoeffding_half_width,
    hoeffding_p,
    interval_verdict,
    mcnemar_directional_p,
    paired_compare,
    pvalue_verdict,
    seed_t_interval,
    seed_t_verdict,
    sign_flip_p,
    t_quantile,
    two_level_bootstrap_ci,
)

_N = NormalDist()


class Sample:
    """One treatment's paired scores against the baseline ([S, n], seeds x items) and what the methods
    share, computed once: the item-level paired_compare (no bootstrap), the per-item and per-seed gaps, and
    the item bootstrap's resampled means (on first use)."""

    def __init__(
        self, t_SN: np.ndarray, b_SN: np.ndarray, alpha: float, margin: float, n_bootstrap: int, seed: int,
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.alpha, self.margin, self.n_bootstrap, self.seed = alpha, margin, n_bootstrap, seed
        self.skip = skip  # methods left out of the table (bootstraps that decide nothing, unless asked for)
        self.item = paired_compare(t_SN, b_SN, alpha=alpha, n_bootstrap=0, seed=seed)
        self.d_SN = t_SN.astype(np.float64) - b_SN.astype(np.float64)
        self.d_N = self.d_SN.mean(axis=0)
        self.S, self.n_items, self.diff = self.item["n_seeds"], self.item["n_items"], self.item["diff"]
        self.D_S = self.d_SN.mean(axis=1) if self.S >= 2 else None
        self._means: np.ndarray | None = None

    def bootstrap_means(self) -> np.ndarray:
        if self._means is None:
            self._means = bootstrap_means(self.d_N, self.n_bootstrap, self.seed)
        return self._means


class Method:
    """One decision method. `row` gives its table entry (estimate, ci_low, ci_high, p, verdict and any
    extras) or None where it does not apply (too few seeds, bootstrap off); `interval` its two-sided
    interval at `level` (None for a test without one); `verdict_at` its verdict at `level`."""

    name: ClassVar[str]
    label: ClassVar[str]  # how compare.md and stdout name it
    scope: ClassVar[str]  # fixed_checkpoints | across_seeds
    rule_text: ClassVar[str] = ""  # the rule in words ({conf}, {alpha}); empty: cannot decide
    min_seeds: ClassVar[int] = 1
    needs_bootstrap: ClassVar[bool] = False
    #: what `worse` means for this method, when the generic sentence (about an interval) does not fit
    worse_text: ClassVar[str | None] = None

    @property
    def decides(self) -> bool:
        return bool(self.rule_text)

    def applies(self, s: Sample) -> bool:
        return (s.S >= self.min_seeds and (s.n_bootstrap > 0 or not self.needs_bootstrap)
                and self.name not in s.skip)

    def row(self, s: Sample) -> dict[str, Any]:
        raise NotImplementedError

    def interval(self, s: Sample, level: float) -> tuple[float, float] | None:
        return None

    def verdict_at(self, s: Sample, row: dict[str, Any], level: float) -> str:
        iv = self.interval(s, level)
        return interval_verdict(iv[0], iv[1], s.margin)

    # design (eval.design, the preflight design gate): `plan` is eval.design.Plan; `sim` an eval.design
    # Simulator whose draw gives d ([sims, S, n] per-item gaps in {-1, 0, 1}), d_N (their sums over seeds)
    # and diff (the mean gap per sweep)
    def power(self, plan: Any, delta: float, n: int, S: int) -> float | None:
        """Normal-approximation power at effect delta; None where no closed form is used."""
        return None

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray | None:
        """A bool per simulated sweep: did the method validate? None where it does not apply."""
        return None


def _sd_diff(plan: Any, delta: float, n: int, S: int) -> float:
    return math.sqrt(plan.tau**2 / S + max(plan.discordance - delta**2, 0.0) / (S * n))


class PairedHoeffding(Method):
    name, label, scope = "paired_hoeffding", "paired Hoeffding", "fixed_checkpoints"
    rule_text = (
        "paired Hoeffding {conf:g}% interval on the per-item difference (each item's difference "
        "averaged over its seeds, in [-1, 1]; half-width sqrt(2 ln(2/alpha) / n), n = items)"
    )

    def row(self, s: Sample) -> dict[str, Any]:
        it = s.item
        return {
            "estimate": s.diff,
            "ci_low": it["ci_low"],
            "ci_high": it["ci_high"],
            "p": hoeffding_p(s.diff, s.n_items, s.margin),
            "verdict": interval_verdict(it["ci_low"], it["ci_high"], s.margin),
        }

    def interval(self, s: Sample, level: float) -> tuple[float, float]:
        h = hoeffding_half_width(s.n_items, level)
        return max(-1.0, s.diff - h), min(1.0, s.diff + h)

    def power(self, plan: Any, delta: float, n: int, S: int) -> float:
        sd = _sd_diff(plan, delta, n, S)
        x = delta - plan.margin - hoeffding_half_width(n, plan.alpha)
        return (1.0 if x > 0 else 0.0) if sd == 0 else _N.cdf(x / sd)

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray:
        return diff - sim.h > sim.plan.margin


class McNemarExact(Method):
    name, label, scope = "mcnemar_exact", "exact McNemar (sign test over items)", "fixed_checkpoints"
    rule_text = "exact McNemar (sign) test over items at two-sided alpha = {alpha:g}"
    worse_text = (
        "significantly more items favour the baseline than the treatment (c > b), whatever the mean "
        "gap: the exact test counts items, not points"
    )

    def row(self, s: Sample) -> dict[str, Any]:
        b, c = s.item["b_items"], s.item["c_items"]
        p = mcnemar_directional_p(b, c)
        return {
            "estimate": s.diff,
            "ci_low": None,
            "ci_high": None,
            "p": p,
            "p_two_sided": s.item["mcnemar_p"],
            "b_items": b,
            "c_items": c,
            "verdict": pvalue_verdict(b, c, p, s.alpha),
        }

    def verdict_at(self, s: Sample, row: dict[str, Any], level: float) -> str:
        return pvalue_verdict(row["b_items"], row["c_items"], row["p"], level)

    def power(self, plan: Any, delta: float, n: int, S: int) -> float | None:
        P = plan.discordance
        if S != 1 or plan.tau > 0:
            return None
        if delta >= P:
            return 1.0  # every discordant item favours the treatment
        za = _N.inv_cdf(1 - plan.alpha / 2)
        return _N.cdf((delta * math.sqrt(n) - za * math.sqrt(P)) / math.sqrt(P - delta**2))

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray:
        b, c = (d_N > 0).sum(axis=1), (d_N < 0).sum(axis=1)
        return (b > c) & (c <= sim.crit[b + c])


class PairedBootstrap(Method):
    name, label, scope = "paired_bootstrap", "paired bootstrap (items)", "fixed_checkpoints"
    rule_text = (
        "paired percentile bootstrap {conf:g}% interval, resampling items (each with all of its seeds)"
    )
    needs_bootstrap = True

    def row(self, s: Sample) -> dict[str, Any]:
        means = s.bootstrap_means()
        lo, hi = (float(x) for x in np.quantile(means, [s.alpha / 2, 1 - s.alpha / 2]))
        # a p of 0 means no resample fell at or below the margin: it is below 1 / R, not 0
        return {
            "estimate": s.diff,
            "ci_low": lo,
            "ci_high": hi,
            "p": bootstrap_p(means, s.diff, s.margin),
            "p_resolution": 1.0 / s.n_bootstrap,
            "verdict": interval_verdict(lo, hi, s.margin),
        }

    def interval(self, s: Sample, level: float) -> tuple[float, float]:
        lo, hi = np.quantile(s.bootstrap_means(), [level / 2, 1 - level / 2])
        return float(lo), float(hi)

    def power(self, plan: Any, delta: float, n: int, S: int) -> float:
        # the interval is as wide as the item noise alone; the estimate also carries the seeds' noise
        sd = _sd_diff(plan, delta, n, S)
        sd_items = math.sqrt(max(plan.discordance - delta**2, 0.0) / (S * n))
        x = delta - plan.margin - _N.inv_cdf(1 - plan.alpha / 2) * sd_items
        return (1.0 if x > 0 else 0.0) if sd == 0 else _N.cdf(x / sd)

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray:
        return sim.bootstrap(d_N, diff)


class SeedT(Method):
    name, label, scope = "seed_t", "t over seeds", "across_seeds"
    rule_text = "Student t {conf:g}% interval over seeds of the per-seed paired difference"
    min_seeds = 2

    def row(self, s: Sample) -> dict[str, Any]:
        st = seed_t_interval(s.D_S, s.alpha, s.margin)
        out = {
            "estimate": st["mean"],
            "ci_low": st["ci_low"],
            "ci_high": st["ci_high"],
            "p": st["p"],
            "verdict": seed_t_verdict(st["ci_low"], st["ci_high"], st["se"], s.margin),
        }
        if st["degenerate"]:
            out["note"] = ZERO_SPREAD_NOTE
        return out

    def interval(self, s: Sample, level: float) -> tuple[float, float]:
        st = seed_t_interval(s.D_S, level)
        return st["ci_low"], st["ci_high"]

    def verdict_at(self, s: Sample, row: dict[str, Any], level: float) -> str:
        lo, hi = self.interval(s, level)
        return seed_t_verdict(lo, hi, seed_t_interval(s.D_S)["se"], s.margin)

    def power(self, plan: Any, delta: float, n: int, S: int) -> float | None:
        if S < 2:
            return None
        sd_D = math.sqrt(plan.tau**2 + max(plan.discordance - delta**2, 0.0) / n)
        return seed_t_power(delta - plan.margin, sd_D, S, plan.alpha)

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray | None:
        S, n = sim.plan.n_seeds, sim.plan.n_items
        if S < 2:
            return None
        D = d.sum(axis=2) / n
        se = D.std(axis=1, ddof=1) / math.sqrt(S)
        return D.mean(axis=1) - sim.t_crit * se > sim.plan.margin


ZERO_SPREAD_NOTE = (
    "every seed pair gave the same gap (sd 0): the t interval has no width to read, so the "
    "verdict is at best inconclusive"
)


class SignFlip(Method):
    """The exact randomisation test over seed pairs (Fisher 1935, ch. 21): under no effect of the training
    procedure each per-seed gap D_s - margin is as likely negative as positive (symmetric seed noise, no
    normality), so the 2^S sign patterns are equally likely. p is two-sided (doubled when the mean is above
    the margin, 1 otherwise, as seed t's), and cannot go below 2 / 2^S: under 6 seeds per arm no p reaches
    alpha = 0.05, whatever the data."""

    name, label, scope = "sign_flip", "exact sign-flip over seeds", "across_seeds"
    rule_text = "exact sign-flip (randomisation) test over seed pairs at two-sided alpha = {alpha:g}"
    min_seeds = 2

    def row(self, s: Sample) -> dict[str, Any]:
        mean = float(np.mean(s.D_S))
        p = sign_flip_p(s.D_S, s.margin)
        p_lower = sign_flip_p(-s.D_S)  # the same test of "the treatment scored lower"
        return {
            "estimate": mean,
            "ci_low": None,
            "ci_high": None,
            "p": p,
            "p_lower": p_lower,
            "p_min": min_sign_flip_p(s.S),
            "verdict": self._verdict(mean, p, p_lower, s.margin, s.alpha),
        }

    def verdict_at(self, s: Sample, row: dict[str, Any], level: float) -> str:
        return self._verdict(row["estimate"], row["p"], row["p_lower"], s.margin, level)

    @staticmethod
    def _verdict(mean: float, p: float, p_lower: float, margin: float, level: float) -> str:
        if mean > margin and p < level:
            return "validated"
        return "worse" if mean < 0 and p_lower < level else "inconclusive"

    def simulate(self, sim: Any, d: np.ndarray, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray | None:
        S, n = sim.plan.n_seeds, sim.plan.n_items
        if S < 2 or S > 14:  # 2^S patterns per simulated sweep
            return None
        D = d.sum(axis=2) / n - sim.plan.margin
        signs = sign_patterns(S)
        obs = D.mean(axis=1)
        flipped = np.abs(D @ signs.T / S)
        p = np.minimum(1.0, (flipped >= np.abs(obs)[:, None] - 1e-12).mean(axis=1))
        return (obs > 0) & (p < sim.plan.alpha)


def sign_patterns(S: int) -> np.ndarray:
    """Every one of the 2^S sign patterns over S seed pairs, one row each ([2^S, S] of +-1)."""
    return 1.0 - 2.0 * ((np.arange(2**S)[:, None] >> np.arange(S)) & 1)


def min_sign_flip_p(S: int) -> float:
    return min(1.0, 2.0 / 2**S)


def distribution_free_seeds(alpha: float) -> int:
    """The fewest seeds per arm at which the exact sign-flip test can reach p < alpha (2 / 2^S < alpha)."""
    S = 2
    while min_sign_flip_p(S) >= alpha:
        S += 1
    return S


class TwoLevelBootstrap(Method):
    """Descriptive only: its percentile interval uses z-like quantiles of S resampled seeds and the plug-in
    between-seed sd (biased by (S - 1) / S), so at few seeds it is too narrow and a verdict read from it
    would not hold alpha; the seed-level verdict is the t interval's."""

    name, label, scope = "two_level_bootstrap", "two-level bootstrap (seeds, then items)", "across_seeds"
    min_seeds, needs_bootstrap = 2, True

    def row(self, s: Sample) -> dict[str, Any]:
        lo, hi, _ = two_level_bootstrap_ci(s.d_SN, s.alpha, s.n_bootstrap, s.seed)
        return {
            "estimate": s.diff,
            "ci_low": lo,
            "ci_high": hi,
            "p": None,
            "verdict": None,
            "note": "descriptive: not calibrated, no verdict",
        }


#: every method, in the order of the methods table; the first four are the order compare.json always had
METHODS: dict[str, Method] = {
    m.name: m
    for m in (PairedHoeffding(), McNemarExact(), PairedBootstrap(), SeedT(), SignFlip(), TwoLevelBootstrap())
}
#: the methods decision.method may name (trainer.config.enums.DECISION_METHODS states them for the config)
DECIDING: tuple[str, ...] = tuple(k for k, m in METHODS.items() if m.decides)
METHOD_SCOPE = {k: m.scope for k, m in METHODS.items()}
ESTIMANDS = {
    k: {"fixed_checkpoints": "these fixed checkpoints", "across_seeds": "this training procedure"}[m.scope]
    for k, m in METHODS.items()
}
RULE_TEXT = {k: m.rule_text for k, m in METHODS.items() if m.decides}
LABELS = {k: m.label for k, m in METHODS.items()}


#: decision.method's value that resolves by the inputs (resolve_method)
AUTO_METHOD = "auto"


def resolve_method(method: str, n_seeds: int, binary: bool = False, margin: float = 0.0) -> tuple[str, str]:
    """(the test that decides, why): `auto` is seed_t with >= 2 seeds per arm, the only default test whose
    false-positive rate stays at alpha / 2 when training noise moves whole checkpoints (item-level tests
    treat the checkpoints as fixed). With one run per arm no seed-level test exists: on binary (right /
    wrong) scores at margin 0 the exact McNemar test, the exact paired test over items (lm-eval's users ask
    for it: lm-evaluation-harness issue #3831; Hoeffding's bound is wide at tens of items: 13 vs 1
    discordant items of 40 read p = 0.0018 exactly and `inconclusive` under Hoeffding); otherwise (fractional
    scores, a margin) paired Hoeffding."""
    if method != AUTO_METHOD:
        return method, f"decision.method = {method} (pre-registered)"
    if n_seeds >= 2:
        return SeedT.name, f"decision.method = auto -> {SeedT.name} ({n_seeds} seeds per arm)"
    if binary and margin == 0:
        return McNemarExact.name, (f"decision.method = auto -> {McNemarExact.name} ({n_seeds} run per arm, "
                                   "binary scores: the exact paired test over items)")
    why = "fractional scores" if not binary else "a margin, which the exact test cannot shift"
    return PairedHoeffding.name, (f"decision.method = auto -> {PairedHoeffding.name} ({n_seeds} seed per "
                                  f"arm, {why})")


def descriptive_bootstraps(rule_method: str) -> frozenset[str]:
    """The resampling methods that decide nothing under the rule `rule_method` (every one but the rule's
    own): compare leaves them out unless the bootstrap was asked for (--bootstrap N)."""
    return frozenset(k for k, m in METHODS.items() if m.needs_bootstrap and k != rule_method)


def method_table(
    t_SN: np.ndarray, b_SN: np.ndarray, alpha: float, margin: float, n_bootstrap: int, seed: int,
    skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], Sample]:
    """(item-level paired_compare, {method: estimate/interval/p/verdict/estimand}, the Sample the rule's
    interval is recomputed on at Holm's and the looks' levels); the methods in `skip` are left out."""
    s = Sample(t_SN, b_SN, alpha, margin, n_bootstrap, seed, skip)
    item = s.item
    methods: dict[str, dict[str, Any]] = {}
    for name, m in METHODS.items():
        if m.applies(s):
            methods[name] = {**m.row(s), "estimand": ESTIMANDS[name]}
    if PairedBootstrap.name in methods:
        item["bootstrap_low"], item["bootstrap_high"] = (
            methods[PairedBootstrap.name]["ci_low"],
            methods[PairedBootstrap.name]["ci_high"],
        )
    seed_level = None
    if s.S >= 2:
        st = seed_t_interval(s.D_S, alpha, margin)
        seed_level = {
            "per_seed_diff": st["per_seed"],
            "mean": st["mean"],
            "sd": st["sd"],
            "se": st["se"],
            "df": st["df"],
            "t_crit": st["t_crit"],
            "t_ci_low": st["ci_low"],
            "t_ci_high": st["ci_high"],
            "t_p": st["p"],
            "sign_flip_p": methods[SignFlip.name]["p"],
            "sign_flip_p_min": methods[SignFlip.name]["p_min"],
        }
        if TwoLevelBootstrap.name in methods:
            tl = methods[TwoLevelBootstrap.name]
            seed_level.update(two_level_low=tl["ci_low"], two_level_high=tl["ci_high"])
    item["seed_level"] = seed_level
    return item, methods, s


def equivalent(interval: tuple[float, float] | None, equivalence_margin: float | None) -> bool:
    """TOST from the rule's two-sided interval: both bounds inside +-margin (strictly), and the interval of
    non-zero width (a zero-width interval comes from identical per-seed gaps, not from precision)."""
    if interval is None or equivalence_margin is None or not interval[1] > interval[0]:
        return False
    return -equivalence_margin < interval[0] and interval[1] < equivalence_margin


def rules_out_target(interval: tuple[float, float] | None, target: float | None) -> bool:
    """`not_supported`: the rule's interval (of non-zero width) has its upper bound below the plan's target
    gain (decision.target_effect), a one-sided test of "the gain is at least the target" at half the level."""
    if interval is None or target is None or not interval[1] > interval[0]:
        return False
    return interval[1] < target


def seed_t_power(shift: float, sd_D: float, S: int, alpha: float, grid: int = 2000) -> float:
    """P(mean - t_crit s / sqrt(S) > 0) for S normal per-seed gaps (mean shift, sd sd_D): the noncentral-t
    tail, integrated over the chi-square of (S-1) s^2 / sd_D^2 (substituting V = u^2, trapezoid rule)."""
    nu = S - 1
    t_crit = t_quantile(1 - alpha / 2, nu)
    if sd_D == 0:
        return 1.0 if shift > 0 else 0.0
    lam = shift * math.sqrt(S) / sd_D
    u_max = math.sqrt(nu + 12 * math.sqrt(2 * nu) + 60)
    u = np.linspace(1e-9, u_max, grid)
    log_pdf = (
        (nu / 2 - 1) * np.log(u**2) - u**2 / 2 - (nu / 2) * math.log(2) - math.lgamma(nu / 2) + np.log(2 * u)
    )  # chi2 density at u^2 times dV/du
    w = np.exp(log_pdf)
    z = lam - t_crit * u / math.sqrt(nu)
    phi = _norm_cdf(z)
    num = np.trapezoid(w * phi, u)
    return float(num / np.trapezoid(w, u))


def _norm_cdf(z: np.ndarray) -> np.ndarray:
    """Vectorised standard normal CDF via erf (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-x * x)
    return 0.5 * (1.0 + np.sign(z) * erf)
