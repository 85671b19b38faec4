"""`python -m eval.calibrate {equivalence,looks,sign_flip,verdicts} [--sweeps N] [--seed K]`: the calibration
record of docs/verdict.md, from seeded simulations of whole sweeps.

The sweep model is eval.design's (its module docstring): the arms of seed s differ on the item population by
delta_s = delta + tau z_s (training noise tau, z_s ~ N(0, 1), or a heavier-tailed law with --noise t3), and on
item i by d_si in {-1, 0, 1} with P(d != 0) = P (the discordance); defaults n = 200 items, P = 0.3 and an
A/A between-seed sd of 5 pts (tau = sqrt(2 0.05^2 - P / n) = 0.064). Each table is what the decision rules of
eval.methods and eval.sequential do to those sweeps, computed vectorised over sweeps (the same formulas:
seed t's interval, the exact sign-flip p, the spending function's levels), so a table of 20,000 sweeps takes
seconds. The quick suite (tests/test_decisive.py) runs the same functions at fewer sweeps against the bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import numpy as np

from eval.methods import _sign_patterns
from eval.sequential import look_levels
from eval.stats import t_quantile


def gaps(
    n_sweeps: int,
    S: int,
    delta: float,
    rng: np.random.Generator,
    n: int = 200,
    P: float = 0.3,
    seed_sd: float = 0.05,
    noise: str = "normal",
) -> np.ndarray:
    """Per-seed paired gaps D [sweeps, S] of simulated sweeps (eval.design's model)."""
    tau = math.sqrt(max(0.0, 2 * seed_sd**2 - P / n))
    z = (
        rng.standard_normal((n_sweeps, S))
        if noise == "normal"
        else rng.standard_t(3, (n_sweeps, S)) / math.sqrt(3)
    )
    delta_S = np.clip(delta + tau * z, -P, P)[:, :, None]
    u = rng.random((n_sweeps, S, n), dtype=np.float32)
    d = (u < (P + delta_S) / 2).astype(np.int8) - (u >= 1 - (P - delta_S) / 2).astype(np.int8)
    return d.sum(axis=2) / n


def seed_t_bounds(D: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Seed t's two-sided 1 - level interval per sweep; a zero spread gives no interval (nan: never
    decides)."""
    S = D.shape[1]
    sd = D.std(axis=1, ddof=1)
    half = t_quantile(1 - level / 2, S - 1) * sd / math.sqrt(S)
    half = np.where(sd > 0, half, np.nan)
    m = D.mean(axis=1)
    return m - half, m + half


def sign_flip_ps(D: np.ndarray) -> np.ndarray:
    """The exact two-sided sign-flip p per sweep (1 where the mean is not above 0), as
    eval.stats.sign_flip_p."""
    S = D.shape[1]
    signs = _sign_patterns(S)
    obs = D.mean(axis=1)
    p = (np.abs(D @ signs.T / S) >= np.abs(obs)[:, None] - 1e-12).mean(axis=1)
    return np.where(obs > 0, p, 1.0)


def equivalence(
    n_sweeps: int, seed: int, margin: float = 0.05, alpha: float = 0.05, seeds: tuple[int, ...] = (3, 6, 10)
) -> list[dict[str, Any]]:
    """`equivalent` (seed t's interval inside +-margin) at a true gap of +margin (the error: at most
    alpha / 2) and at 0 (the power)."""
    rng = np.random.default_rng(seed)
    rows = []
    for S in seeds:
        row: dict[str, Any] = {"seeds_per_arm": S, "margin": margin}
        for name, delta in (("at_margin", margin), ("at_zero", 0.0)):
            lo, hi = seed_t_bounds(gaps(n_sweeps, S, delta, rng), alpha)
            row[name] = float(np.mean((lo > -margin) & (hi < margin)))
        rows.append(row)
    return rows


def looks(
    n_sweeps: int,
    seed: int,
    plan: tuple[int, ...] = (3, 6, 10),
    alpha: float = 0.05,
    effects: tuple[float, ...] = (0.0, 0.05, 0.08),
) -> list[dict[str, Any]]:
    """Looks at `plan` seeds per arm (the spending levels) against one look at the last: the share of sweeps
    validated at some look (at effect 0 the false-positive rate, at most alpha / 2), and the expected seeds
    per arm (a sweep stops at its first `validated`). Also the unplanned repeated looks at every seed count
    from the first look on, each at the full alpha, which is what re-deciding as seeds arrive does."""
    rng = np.random.default_rng(seed)
    levels = look_levels(list(plan), alpha)
    rows = []
    for delta in effects:
        D = gaps(n_sweeps, plan[-1], delta, rng)
        stopped = np.zeros(n_sweeps, bool)
        seeds_used = np.full(n_sweeps, plan[-1], float)
        for S, lev in zip(plan, levels):
            lo, _ = seed_t_bounds(D[:, :S], lev)
            hit = ~stopped & (lo > 0)
            seeds_used[hit] = S
            stopped |= hit
        fixed = seed_t_bounds(D, alpha)[0] > 0
        naive = np.zeros(n_sweeps, bool)
        for S in range(plan[0], plan[-1] + 1):
            naive |= seed_t_bounds(D[:, :S], alpha)[0] > 0
        rows.append(
            {
                "effect": delta,
                "looks": list(plan),
                "levels": levels,
                "validated_sequential": float(stopped.mean()),
                "expected_seeds_sequential": float(seeds_used.mean()),
                "validated_fixed": float(fixed.mean()),
                "seeds_fixed": plan[-1],
                "validated_every_seed_unplanned": float(naive.mean()),
            }
        )
    return rows


def sign_flip(
    n_sweeps: int,
    seed: int,
    alpha: float = 0.05,
    seeds: tuple[int, ...] = (3, 6, 8, 10),
    effect: float = 0.08,
) -> list[dict[str, Any]]:
    """The sign-flip test's and seed t's `validated` at no effect (normal and heavier-tailed t3 seed noise; at
    most alpha / 2) and their power at `effect`."""
    rng = np.random.default_rng(seed)
    rows = []
    for S in seeds:
        row: dict[str, Any] = {"seeds_per_arm": S, "p_min": min(1.0, 2 / 2**S)}
        for name, delta, noise in (
            ("null_normal", 0.0, "normal"),
            ("null_t3", 0.0, "t3"),
            ("power", effect, "normal"),
        ):
            D = gaps(n_sweeps, S, delta, rng, noise=noise)
            row[f"sign_flip_{name}"] = float(np.mean(sign_flip_ps(D) < alpha))
            row[f"seed_t_{name}"] = float(np.mean(seed_t_bounds(D, alpha)[0] > 0))
        rows.append(row)
    return rows


def seed_t_words(D: np.ndarray, alpha: float, margin: float = 0.0, equivalence_margin: float | None = None,
                 target: float | None = None) -> np.ndarray:
    """Each sweep's verdict word under seed t, in eval.comparison.decide_all's order: `validated` (lower bound
    above the margin), `worse` (upper bound below 0), `equivalent` (inside +-equivalence_margin),
    `not_supported` (upper bound below the target), `inconclusive` otherwise; a zero spread (no interval)
    is `inconclusive`."""
    lo, hi = seed_t_bounds(D, alpha)
    words = np.full(D.shape[0], "inconclusive", dtype=object)
    undecided = np.ones(D.shape[0], bool)
    for word, hit in (("validated", lo > margin), ("worse", hi < 0),
                      ("equivalent", (lo > -equivalence_margin) & (hi < equivalence_margin)
                       if equivalence_margin else np.zeros_like(undecided)),
                      ("not_supported", hi < target if target else np.zeros_like(undecided))):
        words[undecided & hit] = word
        undecided &= ~hit
    return words


#: the rules the verdicts table reads the null through: the plain rule, then with each word's own option
VERDICT_RULES = {"plain": {}, "target 8 pts": {"target": 0.08},
                 "equivalence 5 pts": {"equivalence_margin": 0.05}}
WORDS = ("validated", "worse", "equivalent", "not_supported", "inconclusive")


def verdicts(n_sweeps: int, seed: int, alpha: float = 0.05, seeds: tuple[int, ...] = (3, 6, 10),
             target: float = 0.08) -> list[dict[str, Any]]:
    """The share of null sweeps (true gap 0) reading each word under seed t, per rule: the plain rule says
    `validated` or `worse` each in at most alpha / 2 of them and `inconclusive` otherwise; `not_supported`
    (with a target) and `equivalent` (with a margin) are right under the null, and their error is at a true
    gap of the target (`not_supported_at_target`, at most alpha / 2) or of the margin (eval.calibrate
    equivalence)."""
    rng = np.random.default_rng(seed)
    rows = []
    for S in seeds:
        D = gaps(n_sweeps, S, 0.0, rng)
        for name, options in VERDICT_RULES.items():
            words = seed_t_words(D, alpha, **options)
            rows.append({"seeds_per_arm": S, "rule": name,
                         **{w: float(np.mean(words == w)) for w in WORDS}})
        at_target = seed_t_words(gaps(n_sweeps, S, target, rng), alpha, target=target)
        rows[-2]["not_supported_at_target"] = float(np.mean(at_target == "not_supported"))
    return rows


TABLES = {"equivalence": equivalence, "looks": looks, "sign_flip": sign_flip, "verdicts": verdicts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=sorted(TABLES))
    p.add_argument("--sweeps", type=int, default=20000, help="simulated sweeps per cell (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    args = p.parse_args(argv)
    if args.sweeps < 10:
        print("eval.calibrate: error: --sweeps must be >= 10", file=sys.stderr)
        return 2
    for row in TABLES[args.table](args.sweeps, args.seed):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
