"""`python -m eval.design +experiment=<name> [overrides] [--discordance P] [--seed-sd S] [--from DIR]
[--target-effect E] [--json]`: what the plan can detect, before the budget is spent.
`--from NAME=FILE[,FILE...]` (once per arm, no overrides, `--decision PLAN.yaml`) asks the same of per-item
files written elsewhere.

For the plan's items (eval.n_examples), seeds per arm (the sweep's `seed=` values), decision.alpha and
decision.power, the minimum detectable effect (MDE) of each method: paired Hoeffding, exact McNemar,
paired bootstrap and the seed-level t; how many items or seeds a target effect needs; the power
curves (PNG); and each item-level method's false-positive rate when the loss makes no difference but
seeds do.

Data model (one sweep of the plan): the arms of seed s differ on the item population by
delta_s = delta + tau z_s (z_s ~ N(0, 1): training noise; delta: the effect of the loss), and on item i
by d_si in {-1, 0, 1} with P(d != 0) = P (the discordance) and mean delta_s. An A/A sweep's
between-seed sd of accuracy, S_aa, measures 2 S_aa^2 = tau^2 + P / n (two seeds of one loss differ by
training noise plus the finite item sample), so tau^2 = max(0, 2 S_aa^2 - P / n).

Power is simulated (common random numbers across effects, so the power curve is monotone up to the
bootstrap's own resampling) by running each method's decision on simulated sweeps; the MDE is where
the curve crosses the target power. Closed forms, reported beside them and used for "items/seeds
needed" (a search over n or S), are the normal approximations:
  Hoeffding:  delta = m + h + z_pow sd(diff),   h = sqrt(2 ln(2/alpha) / n)
  bootstrap:  delta = m + z_{1-alpha/2} sd_items + z_pow sd(diff),   sd_items^2 = (P - delta^2) / (S n)
  McNemar (Connor 1987, one seed): delta sqrt(n) = z_{1-alpha/2} sqrt(P) + z_pow sqrt(P - delta^2)
  seed t:     power = E_V[Phi(lambda - t_crit sqrt(V / (S-1)))], V ~ chi2_{S-1}, lambda = (delta - m) sqrt(S) / sd_D
with sd(diff)^2 = tau^2 / S + (P - delta^2) / (S n) and sd_D^2 = tau^2 + (P - delta^2) / n.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

from eval.methods import (  # noqa: F401 - re-exported
    AUTO_METHOD,
    DECIDING,
    METHOD_SCOPE,
    McNemarExact,
    PairedHoeffding,
    SignFlip,
    distribution_free_seeds,
    resolve_method,
    seed_t_power,
    sign_patterns,
)
from eval.methods import METHODS as REGISTRY
from eval.stats import SCOPE_TEXT, hoeffding_half_width, t_quantile

if TYPE_CHECKING:  # the config package loads Hydra; eval.design starts without it
    from trainer.config.schema import Config

METHODS = DECIDING  # the registry's deciding methods (equal to the config's DECISION_METHODS: a test)
DEFAULT_DISCORDANCE = 0.3
_N = NormalDist()


class DesignError(ValueError):
    """Bad design input; the message names the option."""


@dataclass
class Plan:
    n_items: int
    n_seeds: int
    alpha: float = 0.05
    power: float = 0.8
    margin: float = 0.0
    discordance: float = DEFAULT_DISCORDANCE
    seed_sd: float = 0.0
    method: str = PairedHoeffding.name
    target_effect: float | None = None
    target_scope: str | None = None  # procedure | checkpoints | None (the method's own scope)
    sources: dict[str, str] = field(default_factory=dict)
    looks: list[int] | None = None  # decision.looks: seeds per arm at each look (the last = n_seeds)
    # every seed sd the inputs state (the config's or the command line's, and a pilot's observed one), by
    # where it came from: the design reports power at each
    spreads: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.n_items, int) and self.n_items >= 1):
            raise DesignError(f"n_items must be an integer >= 1, got {self.n_items!r}")
        if not (isinstance(self.n_seeds, int) and self.n_seeds >= 1):
            raise DesignError(f"seeds per arm must be an integer >= 1, got {self.n_seeds!r}")
        if not 0 < self.discordance <= 1:
            raise DesignError(f"--discordance must be in (0, 1], got {self.discordance!r}")
        if not 0 <= self.seed_sd < 1:
            raise DesignError(f"--seed-sd must be in [0, 1), got {self.seed_sd!r}")
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise DesignError(f"alpha and power must be in (0, 1), got {self.alpha!r}, {self.power!r}")
        if self.target_effect is not None and not 0 < self.target_effect <= 1:
            raise DesignError(f"--target-effect must be in (0, 1], got {self.target_effect!r}")
        if self.method not in METHODS:
            if self.method != AUTO_METHOD:
                raise DesignError(f"decision method must be one of {['auto', *METHODS]}, got {self.method!r}")
            self.method, self.sources["method"] = resolve_method(self.method, self.n_seeds, True,
                                                                 self.margin)

    @property
    def tau(self) -> float:
        """sd of the arms' population gap across seeds (training noise), from the A/A sd."""
        return math.sqrt(max(0.0, 2.0 * self.seed_sd ** 2 - self.discordance / self.n_items))


# ----------------------------------------------------------------------------- closed forms
def _solve(f: Any, hi: float) -> float | None:
    """Smallest delta in (0, hi] with f(delta) >= 0 (f increasing), None if f(hi) < 0."""
    if f(hi) < 0:
        return None
    lo = 0.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if f(mid) >= 0:
            hi = mid
        else:
            lo = mid
    return hi


def power_closed_form(method: str, plan: Plan, delta: float, n: int | None = None, S: int | None = None) -> float | None:
    """Normal-approximation power of `method` at effect delta (None where no closed form is used): the
    method's own `power` (eval.methods)."""
    if method not in REGISTRY:
        raise DesignError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    return REGISTRY[method].power(plan, delta, n or plan.n_items, S or plan.n_seeds)


def mde_closed_form(method: str, plan: Plan, n: int | None = None, S: int | None = None) -> float | None:
    hi = min(plan.discordance, 1.0)
    if power_closed_form(method, plan, 0.0, n, S) is None:
        return None
    return _solve(lambda d: power_closed_form(method, plan, d, n, S) - plan.power, hi)


def items_needed(method: str, plan: Plan, target: float, S: int | None = None) -> int | None:
    """Smallest n whose closed-form MDE is <= target (None if none up to 10^7)."""
    def ok(n: int) -> bool:
        mde = mde_closed_form(method, plan, n, S)
        return mde is not None and mde <= target
    if power_closed_form(method, plan, 0.0, 10, S) is None:
        return None
    lo, hi = 1, 10 ** 7
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def seeds_needed(method: str, plan: Plan, target: float, max_seeds: int = 1000) -> int | None:
    """Smallest seeds per arm whose closed-form MDE is <= target (None if none up to max_seeds)."""
    def ok(S: int) -> bool:
        mde = mde_closed_form(method, plan, S=S)
        return mde is not None and mde <= target
    lo = REGISTRY[method].min_seeds
    if method == McNemarExact.name:
        return 1 if ok(1) else None
    if not ok(max_seeds):
        return None
    hi = max_seeds
    while lo < hi:  # the MDE falls with S
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ----------------------------------------------------------------------------- simulation
def _mcnemar_crit(n: int, alpha: float) -> np.ndarray:
    """crit[m] = the largest k with two-sided exact McNemar p(k, m - k) < alpha (-1 if none): a sweep with m
    discordant items is significant in the treatment's favour iff c <= crit[m] (and b > c)."""
    crit = np.full(n + 1, -1, dtype=np.int64)
    lg = np.array([math.lgamma(k + 1) for k in range(n + 1)])
    for m in range(1, n + 1):
        k = np.arange(0, m // 2 + 1)
        log_pmf = lg[m] - lg[k] - lg[m - k] - m * math.log(2.0)
        cdf = np.cumsum(np.exp(log_pmf))
        below = np.flatnonzero(2.0 * cdf < alpha)
        crit[m] = int(below[-1]) if below.size else -1
    return crit


class Simulator:
    """Simulated sweeps of the plan with common random numbers across effects."""

    def __init__(self, plan: Plan, n_sims: int = 1000, n_bootstrap: int = 400, seed: int = 0) -> None:
        self.plan = plan
        rng = np.random.default_rng(seed)
        S, n = plan.n_seeds, plan.n_items
        self.U = rng.random((n_sims, S, n), dtype=np.float32)
        self.Z = rng.standard_normal((n_sims, S))
        self.n_sims, self.n_bootstrap, self.seed = n_sims, n_bootstrap, seed
        self.crit = _mcnemar_crit(n, plan.alpha)
        self.h = hoeffding_half_width(n, plan.alpha)
        self.t_crit = t_quantile(1 - plan.alpha / 2, S - 1) if S >= 2 else None

    def _items(self, delta: float) -> np.ndarray:
        """d [sims, S, n]: the per-item gaps in {-1, 0, 1} of the simulated sweeps at effect delta."""
        p = self.plan
        P = p.discordance
        delta_S = np.clip(delta + p.tau * self.Z, -P, P)[:, :, None]
        up, down = self.U < (P + delta_S) / 2, self.U >= 1 - (P - delta_S) / 2
        return up.astype(np.int8) - down.astype(np.int8)

    def sequential(self, delta: float) -> dict[str, float]:
        """The plan's decision.looks on the simulated sweeps at effect delta (eval.sequential): look k decides
        with the plan's seed-level method at its spending level on the first S_k seeds, and a sweep stops at
        its first `validated`. (share validated at some look, expected seeds per arm)."""
        from eval.sequential import look_levels

        p = self.plan
        D = self._items(delta).sum(axis=2) / p.n_items - p.margin
        stopped = np.zeros(self.n_sims, bool)
        used = np.full(self.n_sims, float(p.looks[-1]))
        for S, lev in zip(p.looks, look_levels(p.looks, p.alpha)):
            hit = ~stopped & _seed_level_validates(p.method, D[:, :S], lev)
            used[hit] = S
            stopped |= hit
        return {"power": float(stopped.mean()), "expected_seeds": float(used.mean())}

    def decisions(self, delta: float, methods: tuple[str, ...] = METHODS) -> dict[str, np.ndarray]:
        """Per method, a bool per simulated sweep: did the method validate? (each method's `simulate`)"""
        p = self.plan
        S, n = p.n_seeds, p.n_items
        d = self._items(delta)
        d_N = d.sum(axis=1)  # S x the per-item mean over seeds, exact integers
        diff = d_N.sum(axis=1) / (S * n)
        out: dict[str, np.ndarray] = {}
        for k in methods:
            v = REGISTRY[k].simulate(self, d, d_N, diff)
            if v is not None:
                out[k] = v
        return out

    def bootstrap(self, d_N: np.ndarray, diff: np.ndarray) -> np.ndarray:
        """The item bootstrap's percentile lower bound > margin, per sweep: the item values take 2S+1 levels,
        so a resample of n items is a multinomial draw of the level counts (the same law as drawing items)."""
        p = self.plan
        S, n = p.n_seeds, p.n_items
        levels = np.arange(-S, S + 1)
        rng = np.random.default_rng(self.seed + 1)
        out = np.zeros(self.n_sims, dtype=bool)
        q = p.alpha / 2
        for i in range(self.n_sims):
            if diff[i] <= p.margin:
                continue  # the lower bound is below the mean
            counts = np.bincount(d_N[i] + S, minlength=2 * S + 1)
            draws = rng.multinomial(n, counts / n, size=self.n_bootstrap)
            means = draws @ levels / (S * n)
            out[i] = np.quantile(means, q) > p.margin
        return out

    def power_curve(self, deltas: np.ndarray, methods: tuple[str, ...] = METHODS) -> dict[str, list[float]]:
        curves: dict[str, list[float]] = {k: [] for k in methods}
        for delta in deltas:
            for k, v in self.decisions(float(delta), methods).items():
                curves[k].append(float(v.mean()))
        return {k: v for k, v in curves.items() if v}


def _seed_level_validates(method: str, D: np.ndarray, level: float) -> np.ndarray:
    """Per sweep, does the seed-level `method` validate on the per-seed gaps D [sims, S] (already less the
    margin) at two-sided `level`: seed t's lower bound above 0, or the exact sign-flip p below the level."""
    S = D.shape[1]
    m = D.mean(axis=1)
    if method == SignFlip.name:
        flipped = np.abs(D @ sign_patterns(S).T / S)
        p = (flipped >= np.abs(m)[:, None] - 1e-12).mean(axis=1)
        return (m > 0) & (p < level)
    sd = D.std(axis=1, ddof=1)
    return (sd > 0) & (m - t_quantile(1 - level / 2, S - 1) * sd / math.sqrt(S) > 0)


def spread_power(plan: Plan, n_sims: int, seed: int) -> list[dict[str, Any]]:
    """Power at the target of the plan's own method, with its looks when it has them and as one look at its
    seeds, at each seed sd the inputs state (plan.spreads: the assumed one and a pilot's observed one), on
    the same random numbers."""
    from dataclasses import replace

    rows = []
    for source, sd in plan.spreads.items():
        sim = Simulator(replace(plan, seed_sd=sd), n_sims, 200, seed)
        fixed = sim.decisions(plan.target_effect, (plan.method,)).get(plan.method)
        row = {"source": source, "seed_sd": sd, "tau": replace(plan, seed_sd=sd).tau,
               "power_one_look": None if fixed is None else float(fixed.mean())}
        if plan.looks and plan.looks[-1] == plan.n_seeds and plan.n_seeds >= 2:
            seq = sim.sequential(plan.target_effect)
            row.update(power_with_looks=seq["power"], expected_seeds=seq["expected_seeds"])
        rows.append(row)
    return rows


def _crossing(deltas: np.ndarray, power: list[float], target: float) -> float | None:
    """Where the (running-max) power curve first reaches `target`, linearly interpolated."""
    pw = np.maximum.accumulate(np.asarray(power))
    idx = np.flatnonzero(pw >= target)
    if not idx.size:
        return None
    j = int(idx[0])
    if j == 0:
        return float(deltas[0])
    x0, x1, y0, y1 = deltas[j - 1], deltas[j], pw[j - 1], pw[j]
    return float(x0 + (target - y0) * (x1 - x0) / (y1 - y0)) if y1 > y0 else float(x1)


def design(plan: Plan, n_sims: int = 1000, n_bootstrap: int = 400, grid: int = 31, seed: int = 0,
           plot: str | Path | None = None) -> dict[str, Any]:
    """MDEs (simulated and closed form), power at the target, items/seeds needed, false positives."""
    methods = tuple(k for k in METHODS if plan.n_seeds >= REGISTRY[k].min_seeds)
    closed = {k: mde_closed_form(k, plan) for k in METHODS}
    top = max([v for v in closed.values() if v is not None] + [plan.target_effect or 0.0, 0.02])
    d_max = min(plan.discordance, 1.6 * top)
    deltas = np.linspace(0.0, d_max, grid)
    sim = Simulator(plan, n_sims, n_bootstrap, seed)
    curves = sim.power_curve(deltas, methods)
    mde = {k: (_crossing(deltas, curves[k], plan.power) if k in curves else None) for k in METHODS}
    out: dict[str, Any] = {
        "n_items": plan.n_items, "n_seeds": plan.n_seeds, "alpha": plan.alpha, "power": plan.power,
        "margin": plan.margin, "discordance": plan.discordance, "seed_sd": plan.seed_sd, "tau": plan.tau,
        "assumptions": plan.sources, "decision_method": plan.method, "target_effect": plan.target_effect,
        "mde": mde, "mde_closed_form": closed, "n_sims": n_sims, "bootstrap_resamples": n_bootstrap,
        "power_curve": {"effect": [float(x) for x in deltas], **curves},
        "false_positive_rate": {k: v[0] for k, v in curves.items()},
    }
    out["notes"] = []
    if plan.n_seeds < 2:
        out["notes"].append("seed_t needs >= 2 seeds per arm: no seed-level MDE with one seed (the verdict would "
                            "concern two fixed checkpoints)")
    if plan.seed_sd > 0:
        out["notes"].append(f"tau = sqrt(2 seed_sd^2 - P / n) = {plan.tau:.4f} assumes the A/A sweep's seed-pair "
                            f"discordance equals the arms' discordance P = {plan.discordance:g}")
    # the exact sign-flip test's smallest p is 2 / 2^S: below this many seeds per arm only seed t's normal
    # model can make a procedure-level verdict significant
    out["distribution_free_min_seeds"] = distribution_free_seeds(plan.alpha)
    if plan.n_seeds < out["distribution_free_min_seeds"]:
        out["notes"].append(f"a distribution-free claim (sign_flip over seed pairs) needs >= "
                            f"{out['distribution_free_min_seeds']} seeds per arm at alpha {plan.alpha:g}; at "
                            f"{plan.n_seeds} a procedure-level verdict rests on seed t's normal model alone")
    out["scope"] = METHOD_SCOPE[plan.method]
    out["problems"], out["warnings"] = plan_problems(plan, out["false_positive_rate"].get(plan.method))
    if plan.target_effect is not None:
        at = sim.decisions(plan.target_effect, methods)
        out["power_at_target"] = {k: float(v.mean()) for k, v in at.items()}
        out["items_needed"] = {k: items_needed(k, plan, plan.target_effect) for k in METHODS}
        out["seeds_needed"] = {k: seeds_needed(k, plan, plan.target_effect) for k in METHODS}
        m = mde[plan.method]
        out["detectable"] = m is not None and m <= plan.target_effect
        if plan.looks and plan.looks[-1] != plan.n_seeds:
            out["notes"].append(f"decision.looks {plan.looks} end at {plan.looks[-1]} seeds per arm, the "
                                f"plan has {plan.n_seeds} (seed=...): the looks are not simulated")
        elif plan.looks and plan.n_seeds >= 2:
            seq = sim.sequential(plan.target_effect)
            out["looks"] = {"looks": plan.looks, "power_at_target": seq["power"],
                            "expected_seeds_at_target": seq["expected_seeds"]}
            # the sweep decides at the looks' levels, not at alpha: the plan's power is the sequential one
            out["detectable"] = out["detectable"] and seq["power"] >= plan.power
        out["power_by_spread"] = spread_power(plan, n_sims, seed) if plan.spreads else []
        out["warnings"] += spread_warnings(plan, out["power_by_spread"])
    if plot is not None:
        out["plot"] = str(plot_power(out, Path(plot)))
    return out


def spread_warnings(plan: Plan, rows: list[dict[str, Any]]) -> list[str]:
    """A stated (A/A) seed sd below a pilot's observed one: the plan's power is then a best case."""
    stated = [r for r in rows if not r["source"].startswith("pilot")]
    pilots = [r for r in rows if r["source"].startswith("pilot")]
    out = []
    for pr in pilots:
        for st in stated:
            if pr["seed_sd"] > st["seed_sd"]:
                key = "power_with_looks" if "power_with_looks" in st else "power_one_look"
                if st[key] is None or pr[key] is None:
                    continue
                out.append(f"the stated seed sd {st['seed_sd']:.4f} ({st['source']}) understates the "
                           f"{pr['source']} {pr['seed_sd']:.4f}: power at the target "
                           f"{100 * plan.target_effect:.2f} pts falls from {st[key]:.2f} to {pr[key]:.2f}; "
                           "plan with the larger spread (more seeds)")
    return out


def clipped_share(plan: Plan) -> float:
    """Share of seeds whose gap delta_s = tau z_s (no effect) falls outside [-P, P]: two checkpoints cannot
    differ by more than the share of items they disagree on, so the simulator clips those gaps, and its
    power curves (and false-positive rates) no longer follow the stated seed sd. 2 (1 - Phi(P / tau))."""
    if plan.tau == 0:
        return 0.0
    return 2.0 * (1.0 - _N.cdf(plan.discordance / plan.tau))


def plan_problems(plan: Plan, false_positive_rate: float | None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the plan's rule; the design gate fails on a problem (or warns, with
    decision.design_problems=warn).

    Problems: the decision method validates more than alpha of simulated sweeps at zero effect under the stated
    seed sd (a calibrated rule validates alpha / 2: the bound is twice that, leaving room for the Monte Carlo
    error of a few hundred sweeps, se ~ 0.008 at 400); an item-level method for a target stated as a gain of the
    training procedure (it counts no training noise); the seed sd left at its default 0 with several seeds per
    arm (every MDE and false-positive rate is then a best case). Warning: more than 1% of seeds clipped."""
    problems, warnings = [], []
    if false_positive_rate is not None and false_positive_rate > plan.alpha:
        problems.append(f"{plan.method} validates {100 * false_positive_rate:.1f}% of simulated sweeps with no effect "
                        f"(seed sd {plan.seed_sd:g}, {plan.n_seeds} seed(s) per arm), above alpha = {plan.alpha:g}: "
                        "its verdicts would be mostly training noise; decide with seed_t (decision.method=auto) "
                        "over >= 2 seeds")
    if plan.target_scope == "procedure" and METHOD_SCOPE[plan.method] == "fixed_checkpoints":
        problems.append(f"decision.target_scope = procedure but {plan.method} is item-level (its verdict is about these "
                        "checkpoints, training noise not counted): use seed_t over >= 2 seeds per arm")
    if plan.n_seeds >= 2 and plan.sources.get("seed_sd", "").startswith("assumed"):
        problems.append(f"seed sd not stated for a {plan.n_seeds}-seed plan (assumed 0: no training noise, a best case "
                        "for every MDE and false-positive rate): set decision.seed_sd, --seed-sd, or --from an A/A sweep")
    share = clipped_share(plan)
    if share > 0.01:
        warnings.append(f"discordance {plan.discordance:g} and seed sd {plan.seed_sd:g} (tau {plan.tau:.4f}) "
                        f"force clipping: {100 * share:.1f}% of simulated seed gaps exceed +-{plan.discordance:g} and "
                        "are clipped, so the simulated MDEs and false-positive rates understate the seed noise; "
                        f"two seeds {2 * plan.tau:.3f} apart need a discordance of at least that")
    return problems, warnings


def plot_power(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trainer.utils.io import atomic_replace

    path.parent.mkdir(parents=True, exist_ok=True)
    pc = result["power_curve"]
    x = 100 * np.asarray(pc["effect"])
    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for k in METHODS:
            if k in pc:
                mde = result["mde"][k]
                lab = f"{k} (MDE {100 * mde:.1f} pts)" if mde is not None else f"{k} (MDE > {x[-1]:.1f} pts)"
                ax.plot(x, pc[k], marker=".", label=lab)
        ax.axhline(result["power"], color="grey", linestyle=":")
        if result.get("target_effect"):
            ax.axvline(100 * result["target_effect"], color="black", linestyle="--", label="target effect")
        ax.set_xlabel("true effect of the loss (accuracy points)")
        ax.set_ylabel("power (share of sweeps validated)")
        ax.set_title(f"Power: {result['n_items']} items x {result['n_seeds']} seed(s), alpha {result['alpha']:g}, "
                     f"discordance {result['discordance']:.2f}, seed sd {result['seed_sd']:.3f}", fontsize="small")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        atomic_replace(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"), suffix=".png")
    finally:
        plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the plan's numbers
def plan_jobs(overrides: list[str]) -> tuple[list[str], list[list[str]]]:
    """(overrides of the first job, every job's overrides) from the command line and the experiment's
    sweeper params (`seed=0,1,2` or `loss=grpo,dppo,cppo` on either), in Hydra's order."""
    from trainer.config.compose import compose_config, sweep_jobs

    try:
        first = sweep_jobs(overrides)[0] if overrides else []
        params = compose_config(first, return_hydra_config=True).hydra.sweeper.get("params") or {}
        given = {a.split("=", 1)[0].lstrip("+~") for a in overrides if "=" in a}
        full = list(overrides) + [f"{k}={v}" for k, v in params.items() if k not in given]
        return first, sweep_jobs(full)
    except Exception as e:  # noqa: BLE001 - Hydra's parse/compose errors name the override
        raise DesignError(f"config: {e}") from None


def job_values(jobs: list[list[str]], key: str) -> list[str | None]:
    """The value each job gives `key` (its last override of it; None where it gives none), first-seen order,
    each once."""
    values: list[str | None] = []
    for job in jobs:
        given = [a.split("=", 1)[1] for a in job if "=" in a and a.lstrip("+~").split("=", 1)[0] == key]
        value = given[-1] if given else None
        if value not in values:
            values.append(value)
    return values


def plan_seeds(overrides: list[str]) -> tuple[list[str], int]:
    """(overrides of the first job, seeds per arm) from the command line and the experiment's sweeper
    params (`seed=0,1,2` on either)."""
    first, jobs = plan_jobs(overrides)
    return first, max(1, len(job_values(jobs, "seed")))


def pilot_estimates(path: str | Path) -> dict[str, Any]:
    """Discordance and between-seed sd from a pilot's final eval files: an A/A sweep (one loss: seed-pair
    discordance, sd of accuracy), an A/B sweep (between-arm discordance; with >= 2 seeds the per-seed gaps'
    sd / sqrt(2)) or one run (discordance bounded by 2 p (1 - p), the chance agreement of two independent
    runs at accuracy p; no seed sd)."""
    from eval.runs import CompareError, check_item_sets, discover_runs, load_records, load_run

    path = Path(path).resolve()
    try:
        if (path / "config.yaml").is_file():
            run = load_run(path, None)
            load_records(run)
            p = float(np.mean([r["correct"] for r in run.records]))
            return {"discordance": max(2 * p * (1 - p), 1.0 / len(run.records)), "seed_sd": None,
                    "source": f"one run {path} (accuracy {p:.3f}; discordance = 2p(1-p), the independence bound)"}
        runs = [load_run(p, None, job) for job, p in discover_runs(path)]
        for r in runs:
            load_records(r)
        check_item_sets(runs)
    except (CompareError, ValueError, FileNotFoundError) as e:
        raise DesignError(f"--from {path}: {e}") from None
    order = sorted(r["index"] for r in runs[0].records)
    c = {(r.loss, r.seed): np.array([{x["index"]: x["correct"] for x in r.records}[i] for i in order]) for r in runs}
    losses = sorted({r.loss for r in runs})
    seeds = sorted({r.seed for r in runs})
    if len(losses) == 1:
        if len(seeds) < 2:
            raise DesignError(f"--from {path}: one run of one loss; pass a run folder or a sweep of >= 2 seeds")
        accs = [c[losses[0], s].mean() for s in seeds]
        disc = [float(np.mean(c[losses[0], a] != c[losses[0], b])) for i, a in enumerate(seeds) for b in seeds[i + 1:]]
        return {"discordance": max(float(np.mean(disc)), 1.0 / len(order)), "seed_sd": float(np.std(accs, ddof=1)),
                "source": f"A/A sweep {path} ({losses[0]}, seeds {seeds})"}
    base = "grpo" if "grpo" in losses else losses[0]
    disc, gaps = [], []
    for t in (x for x in losses if x != base):
        for s in seeds:
            if (t, s) in c and (base, s) in c:
                disc.append(float(np.mean(c[t, s] != c[base, s])))
                gaps.append(float(c[t, s].mean() - c[base, s].mean()))
    if not disc:
        raise DesignError(f"--from {path}: no seed has both a baseline ({base}) and a treatment run")
    sd = float(np.std(gaps, ddof=1) / math.sqrt(2)) if len(gaps) >= 2 else None
    return {"discordance": max(float(np.mean(disc)), 1.0 / len(order)), "seed_sd": sd,
            "source": f"A/B sweep {path} ({losses}, seeds {seeds})"}


def _first_given(*candidates: tuple[Any, str]) -> tuple[float, str]:
    """(value, where it came from) of the first candidate that is set: command line, pilot, config, default."""
    return next((float(v), src) for v, src in candidates if v is not None)


def plan_from_config(cfg: Config, n_seeds: int, discordance: float | None = None,
                     seed_sd: float | None = None, target_effect: float | None = None,
                     pilot: str | Path | None = None) -> Plan:
    """The plan's design inputs: the config's decision group, overridden by the command line or a pilot."""
    from trainer.config.schema import eval_items

    d = cfg.decision
    sources = {}
    est = pilot_estimates(pilot) if pilot is not None else {}
    P, sources["discordance"] = _first_given(
        (discordance, "--discordance"), (est.get("discordance"), est.get("source")),
        (d.discordance, "decision.discordance"),
        (DEFAULT_DISCORDANCE, f"assumed {DEFAULT_DISCORDANCE} (no --discordance, --from or decision.discordance)"))
    sd, sources["seed_sd"] = _first_given(
        (seed_sd, "--seed-sd"), (est.get("seed_sd"), est.get("source")), (d.seed_sd, "decision.seed_sd"),
        (0.0, "assumed 0 (no training noise: a lower bound on every MDE; pass --seed-sd or --from an A/A sweep)"))
    stated = ((seed_sd, "--seed-sd"), (d.seed_sd, "decision.seed_sd"))
    spreads = {f"stated ({where})": float(v) for v, where in stated if v is not None}
    if est.get("seed_sd") is not None:
        spreads[f"pilot's observed ({est['source']})"] = float(est["seed_sd"])
    target = target_effect if target_effect is not None else d.target_effect
    # `auto` resolves here, at plan time, by the plan's seeds per arm; compare resolves it the same way from
    # the sweep and the gate's record holds the resolution
    binary = cfg.eval.samples_per_item == 1 and d.endpoint != "auc"  # right / wrong per item
    method, sources["method"] = resolve_method(str(d.method), n_seeds, binary, float(d.margin))
    return Plan(n_items=eval_items(cfg), n_seeds=n_seeds, alpha=float(d.alpha), power=float(d.power),
                margin=float(d.margin), discordance=float(P), seed_sd=float(sd), method=method,
                target_scope=d.target_scope,
                target_effect=None if target is None else float(target), sources=sources,
                looks=list(d.looks) if d.looks else None, spreads=spreads if target is not None else {})


def render(result: dict[str, Any]) -> str:
    pts = lambda x: "none" if x is None else f"{100 * x:.2f} pts"
    lines = [(f"design: {result['n_items']} items x {result['n_seeds']} seed(s) per arm, alpha {result['alpha']:g}, "
             f"power {result['power']:g}, margin {result['margin']:g}"),
             f"  discordance {result['discordance']:.3f} ({result['assumptions'].get('discordance')})",
             (f"  seed sd {result['seed_sd']:.4f} ({result['assumptions'].get('seed_sd')}); training-noise sd of a "
             f"seed pair's gap tau = {result['tau']:.4f}"),
             (f"  decision method {result['decision_method']} ({result['assumptions'].get('method', 'given')}; "
              f"scope: {SCOPE_TEXT[METHOD_SCOPE[result['decision_method']]]})"),
             "", f"{'method':18s} {'MDE (sim)':>11s} {'MDE (closed)':>13s} {'false pos. at 0':>16s}"]
    for k in METHODS:
        mark = " <- decision" if k == result["decision_method"] else ""
        fp = result["false_positive_rate"].get(k)
        lines.append(f"{k:18s} {pts(result['mde'][k]):>11s} {pts(result['mde_closed_form'][k]):>13s} "
                     f"{'-' if fp is None else f'{fp:.3f}':>16s}{mark}")
    if result.get("target_effect") is not None:
        lines += ["", (f"target effect {pts(result['target_effect'])}: detectable by the decision method: "
                  f"{'YES' if result['detectable'] else 'NO'}")]
        for k in METHODS:
            pw = result["power_at_target"].get(k)
            lines.append(f"  {k:18s} power {'-' if pw is None else f'{pw:.3f}'}, items needed "
                         f"{result['items_needed'][k]}, seeds needed {result['seeds_needed'][k]}")
    else:
        lines += ["", ("(no target effect: pass --target-effect E, or decision.target_effect, for the items "
                       "and seeds a gain of E needs)")]
    if result.get("looks"):
        lk = result["looks"]
        lines.append(f"  with decision.looks {lk['looks']} (alpha spent over the looks): power "
                     f"{lk['power_at_target']:.3f}, {lk['expected_seeds_at_target']:.2f} seeds per arm "
                     "expected")
    for r in result.get("power_by_spread") or []:
        seq = f", with the looks {r['power_with_looks']:.3f}" if "power_with_looks" in r else ""
        one = "-" if r["power_one_look"] is None else f"{r['power_one_look']:.3f}"
        lines.append(f"  at seed sd {r['seed_sd']:.4f} ({r['source']}): power in one look {one}{seq}")
    if any(v is None for v in list(result["mde"].values()) + list(result["mde_closed_form"].values())):
        lines.append(f"(none: no effect up to the discordance, {100 * result['discordance']:.1f} pts, reaches power "
                     f"{result['power']:g}, or no closed form for this design)")
    if result["tau"] > 0:
        lines.append("(training noise tau > 0: the item-level methods' power counts validations that are partly "
                     "seed noise, as their false-positive rate at 0 shows; only seed_t's MDE is about the loss)")
    if result.get("distribution_free_min_seeds"):
        lines.append(f"seeds per arm a distribution-free claim (sign_flip) needs: "
                     f">= {result['distribution_free_min_seeds']}")
    for n in result.get("notes", []):
        lines.append(f"note: {n}")
    for n in result.get("problems", []):
        lines.append(f"PROBLEM: {n}")
    for n in result.get("warnings", []):
        lines.append(f"warning: {n}")
    if result.get("plot"):
        lines += ["", f"power curve: {result['plot']}"]
    return "\n".join(lines)


def _plan_from_files(args: argparse.Namespace, files: list[str], pilots: list[str]) -> Plan:
    """The plan of a question asked of per-item files (eval.items): no Hydra config is composed."""
    from eval.items import ItemsError

    if len(files) != len(pilots) or args.overrides:
        raise DesignError("--from per-item files takes no pilot folder and no Hydra overrides beside them "
                          "(the rule comes from --decision PLAN.yaml)")
    try:
        return plan_from_items(files, args.decision, args.format, args.metric, args.seeds, args.discordance,
                               args.seed_sd, args.target_effect)
    except ItemsError as e:
        raise DesignError(f"--from: {e}") from None


def plan_from_items(specs: list[str], plan_path: str | None, fmt: str | None = None,
                    metric: str | None = None, n_seeds: int | None = None, discordance: float | None = None,
                    seed_sd: float | None = None, target_effect: float | None = None) -> Plan:
    """The Plan of a question asked of per-item files: the files' items, the seeds per arm (--seeds, else
    the files'), the rule of the plan YAML (the decision block's defaults without one), and the discordance
    and seed sd measured on the files (eval.items.pilot_from_items) unless given."""
    from eval.items import load_plan, pilot_from_items
    from trainer.config.schema import DecisionConfig

    raw = load_plan(plan_path) if plan_path else {}
    d = DecisionConfig(**raw)
    est = pilot_from_items(specs, fmt, metric, raw.get("baseline"))
    S = n_seeds or est["n_seeds"]
    sources = {}
    P, sources["discordance"] = _first_given((discordance, "--discordance"),
                                             (est["discordance"], est["source"]),
                                             (DEFAULT_DISCORDANCE, "assumed"))
    sd, sources["seed_sd"] = _first_given(
        (seed_sd, "--seed-sd"), (est["seed_sd"], est["source"]), (d.seed_sd, "decision.seed_sd"),
        (0.0, "assumed 0 (the files have one seed per arm: no training noise measured; pass --seed-sd)"))
    method, sources["method"] = resolve_method(d.method, S, est["binary"], float(d.margin))
    target = target_effect if target_effect is not None else d.target_effect
    return Plan(n_items=est["n_items"], n_seeds=S, alpha=d.alpha, power=d.power, margin=d.margin,
                discordance=P, seed_sd=sd, method=method, target_effect=target, target_scope=d.target_scope,
                sources=sources)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.design", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=dppo_vs_grpo seed=0,1,2")
    p.add_argument("--discordance", type=float, default=None, help="share of items the arms disagree on, in (0, 1]")
    p.add_argument("--seed-sd", type=float, default=None, help="between-seed sd of one arm's accuracy (A/A)")
    p.add_argument("--from", dest="pilot", action="append", default=None, metavar="DIR | NAME=FILE[,FILE...]",
                   help="a pilot run or sweep folder to estimate both from; or per-item files of runs "
                        "trained elsewhere, one NAME=FILE[,FILE...] per arm (repeat --from), with no Hydra "
                        "overrides")
    p.add_argument("--decision", default=None, metavar="PLAN.yaml",
                   help="with --from files: the rule (a YAML of the decision block's keys)")
    p.add_argument("--format", default=None, help="with --from files: their format (default: detected)")
    p.add_argument("--metric", default=None, help="with --from files: the per-item metric")
    p.add_argument("--target-effect", type=float, default=None, help="the gain to detect (default decision.target_effect)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: the sweep's seed= values)")
    p.add_argument("--sims", type=int, default=1000, help="simulated sweeps per effect (default 1000)")
    p.add_argument("--bootstrap", type=int, default=400, help="bootstrap resamples per simulated sweep")
    p.add_argument("--plot", default=None,
                   help="PNG power curve path ('' = none; default: design_power.png in the --from folder, else in "
                        "outputs/design/)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    try:
        if args.discordance is not None and not 0 < args.discordance <= 1:
            raise DesignError(f"--discordance must be in (0, 1], got {args.discordance}")
        if args.sims < 10 or args.bootstrap < 10:
            raise DesignError("--sims and --bootstrap must be >= 10")
        pilots = args.pilot or []
        files = [x for x in pilots if "=" in x or Path(x.split(",")[0]).is_file()]
        if files:
            plan = _plan_from_files(args, files, pilots)
        else:
            if len(pilots) > 1 or args.decision or args.format or args.metric:
                raise DesignError("--from DIR takes one pilot folder; --decision, --format and --metric go "
                                  "with --from per-item files")
            from trainer.config.compose import compose_config
            from trainer.config.schema import ConfigError, validate

            first, n_seeds = plan_seeds(args.overrides)
            try:
                cfg = validate(compose_config(first))
            except ConfigError as e:
                raise DesignError(f"config: {e}") from None
            plan = plan_from_config(cfg, args.seeds or n_seeds, args.discordance, args.seed_sd,
                                    args.target_effect, pilots[0] if pilots else None)
        plot = args.plot
        if plot is None:  # beside what it was estimated from, never loose in the working directory
            where = Path(files[0].split("=", 1)[-1].split(",")[0]).parent if files else \
                Path(pilots[0]) if pilots else Path("outputs") / "design"
            plot = str(where / "design_power.png")
            Path(plot).parent.mkdir(parents=True, exist_ok=True)
        result = design(plan, n_sims=args.sims, n_bootstrap=args.bootstrap, plot=plot or None)
    except DesignError as e:
        print(f"eval.design: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True) if args.json else render(result))
    # a plan with a PROBLEM is not one to run: a script that checks the status must see it
    return 1 if result.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
