"""`python -m eval.calibrate {coverage,equivalence,looks,seed_noise,sign_flip,variance_split,verdicts}
[--sweeps N] [--seed K] [--markdown]`: the calibration record of docs/calibration.md, from seeded simulations
of whole sweeps (JSON rows; `--markdown` prints the table exactly as docs/calibration.md holds it beside the
command).

The sweep model is eval.design's (its module docstring): the arms of seed s differ on the item population by
delta_s = delta + tau z_s (training noise tau, z_s ~ N(0, 1), or a heavier-tailed law with --noise t3), and on
item i by d_si in {-1, 0, 1} with P(d != 0) = P (the discordance); defaults n = 200 items, P = 0.3 and an
A/A between-seed sd of 5 pts (tau = sqrt(2 0.05^2 - P / n) = 0.064). Each table is what the decision rules of
eval.methods and eval.sequential do to those sweeps, computed vectorised over sweeps (the same formulas:
seed t's interval, the exact sign-flip p, the spending function's levels), so a table of 20,000 sweeps takes
seconds. The quick suite (tests/test_decisive.py) runs the same functions at fewer sweeps against the bounds,
and checks that each table in docs/calibration.md is this module's output for the command written beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import numpy as np

from eval.methods import (
    McNemarExact,
    PairedBootstrap,
    PairedHoeffding,
    SeedT,
    SignFlip,
    TwoLevelBootstrap,
    sign_patterns,
)
from eval.sequential import look_levels
from eval.stats import t_quantile, two_level_bootstrap_ci


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
    return item_gaps(delta, tau, z, rng, n, P).sum(axis=2) / n


def item_gaps(delta: float, tau: float, z: np.ndarray, rng: np.random.Generator, n: int = 200,
              P: float = 0.3) -> np.ndarray:
    """Per-item paired gaps d [sweeps, S, n] in {-1, 0, 1} at seed gaps clip(delta + tau z, -P, P)."""
    n_sweeps, S = z.shape
    delta_S = np.clip(delta + tau * z, -P, P)[:, :, None]
    u = rng.random((n_sweeps, S, n), dtype=np.float32)
    return (u < (P + delta_S) / 2).astype(np.int8) - (u >= 1 - (P - delta_S) / 2).astype(np.int8)


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
    signs = sign_patterns(S)
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


def sign_flip_two_sided(D: np.ndarray) -> np.ndarray:
    """The exact two-sided sign-flip p of "the mean gap is 0" per sweep (no one-sided cut)."""
    S = D.shape[1]
    signs = sign_patterns(S)
    obs = np.abs(D.mean(axis=1))
    return (np.abs(D @ signs.T / S) >= obs[:, None] - 1e-12).mean(axis=1)


def coverage(n_sweeps: int, seed: int, alpha: float = 0.05, seeds: tuple[int, ...] = (3, 6, 10),
             effect: float = 0.05, n_bootstrap: int = 200) -> list[dict[str, Any]]:
    """How often each paired interval compare reports over seeds holds the true gap (`effect`; the clip at
    +-P is over 4 training sd away, so the seeds' expected gap is `effect` up to a negligible tail), under
    normal and t3 training noise: seed t's 1 - alpha interval; the sign-flip test's confidence set (the gaps
    g whose two-sided exact p of D - g is >= alpha: it holds the truth exactly when the test at the truth
    does not reject); the two-level bootstrap's percentile interval (`n_bootstrap` resamples; descriptive in
    compare, known to be too narrow with few seeds). Nominal: 1 - alpha."""
    rng = np.random.default_rng(seed)
    tau = math.sqrt(2 * 0.05**2 - 0.3 / 200)
    rows = []
    for S in seeds:
        for noise in ("normal", "t3"):
            z = (rng.standard_normal((n_sweeps, S)) if noise == "normal"
                 else rng.standard_t(3, (n_sweeps, S)) / math.sqrt(3))
            d = item_gaps(effect, tau, z, rng)
            D = d.sum(axis=2) / d.shape[2]
            lo, hi = seed_t_bounds(D, alpha)
            boot = np.empty(n_sweeps, bool)
            for i in range(n_sweeps):
                b_lo, b_hi, _ = two_level_bootstrap_ci(d[i], alpha, n_bootstrap, seed=i)
                boot[i] = b_lo <= effect <= b_hi
            rows.append({"seeds_per_arm": S, "noise": noise, "effect": effect, "nominal": 1 - alpha,
                         SeedT.name: float(np.mean((lo <= effect) & (effect <= hi))),
                         SignFlip.name: float(np.mean(sign_flip_two_sided(D - effect) >= alpha)),
                         TwoLevelBootstrap.name: float(boot.mean())})
    return rows


def variance_split_bias(n_sweeps: int, seed: int, seeds: tuple[int, ...] = (3, 8),
                        train_sds: tuple[float, ...] = (0.02, 0.0592)) -> list[dict[str, Any]]:
    """compare's split of a seed pair's gap variance (eval.comparison.variance_split) against the truth: the
    mean over sweeps of the unbiased training part, of the reported one (floored at 0) and how often the
    floor fires, at a true training sd of 2 pts (4 pts^2, small against the ~15 pts^2 of item sampling at 200
    items) and of 5.92 pts (this model's default tau)."""
    from eval.comparison import variance_split

    rng = np.random.default_rng(seed)
    rows = []
    for S in seeds:
        for tau in train_sds:
            d = item_gaps(0.0, tau, rng.standard_normal((n_sweeps, S)), rng).astype(np.float64)
            split = np.array([variance_split(d[i]) for i in range(n_sweeps)])
            unbiased = split[:, 2]
            rows.append({"seeds_per_arm": S, "true_training_var": tau**2, "item_var": float(split[:, 1].mean()),
                         "training_var_unbiased": float(unbiased.mean()),
                         "training_var_floored": float(np.maximum(unbiased, 0).mean()),
                         "floored_share": float(np.mean(unbiased < 0))})
    return rows


def checkpoint_sweeps(n_sweeps: int, S: int, n: int = 200, seed: int = 0):
    """Sweeps of (treatment, baseline) per-item correctness [S, n] with no effect of the loss and real
    training noise: 200 items of logit difficulty theta_i ~ N(0.2, 2.5) shared by every checkpoint; each
    checkpoint (arm, seed) has its own skill u ~ N(0, 0.74), the same law in both arms, and answers item i
    right with probability sigmoid(theta_i + u), drawn once (greedy decoding of a fixed checkpoint).
    Accuracy about 0.53, a between-seed sd of about 10 pts and a discordance of about 0.28 between two
    checkpoints."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.2, 2.5, n)
    for _ in range(n_sweeps):
        u = rng.normal(0.0, 0.74, (2, S, 1))
        p = 1.0 / (1.0 + np.exp(-(theta[None, None, :] + u)))
        yield rng.random((S, n)) < p[0], rng.random((S, n)) < p[1]


def seed_noise(n_sweeps: int, seed: int, seeds: tuple[int, ...] = (1, 3, 5), alpha: float = 0.05,
               n_bootstrap: int = 200) -> list[dict[str, Any]]:
    """Each decision method's `validated` share of null sweeps with real training noise (checkpoint_sweeps),
    through eval.methods.method_table, the functions compare decides with (sweep i's bootstraps seeded i);
    the two-level bootstrap's lower bound above 0 beside them (descriptive). From 5 seeds per arm on, half
    the sweeps (their bootstraps cost most)."""
    from eval.methods import method_table

    rows = []
    for S in seeds:
        N = n_sweeps if S < 5 else n_sweeps // 2
        hits: dict[str, int] = {}
        two_level = 0
        for i, (t, b) in enumerate(checkpoint_sweeps(N, S, seed=seed)):
            _, m, _ = method_table(t, b, alpha, 0.0, n_bootstrap, i)
            for k, v in m.items():
                if v["verdict"] is not None:
                    hits[k] = hits.get(k, 0) + (v["verdict"] == "validated")
            two_level += TwoLevelBootstrap.name in m and m[TwoLevelBootstrap.name]["ci_low"] > 0
        rows.append({"seeds_per_arm": S, "sweeps": N, **{k: v / N for k, v in hits.items()},
                     "two_level_bootstrap_low_above_0": two_level / N if S > 1 else None})
    return rows


TABLES = {"coverage": coverage, "equivalence": equivalence, "looks": looks, "sign_flip": sign_flip,
          "seed_noise": seed_noise, "variance_split": variance_split_bias, "verdicts": verdicts}


def pct(x: float) -> str:
    """A share as the calibration record prints it: 3 significant figures rounded half up on the decimal
    value (a share k / N of 20,000 sweeps is often a 5 in the fourth figure, which binary rounding would
    send either way), 0 as 0%, 100% without decimals."""
    v = Decimal(repr(round(100 * x, 9)))
    if v == 0:
        return "0%"
    if v >= Decimal("99.95"):
        return "100%"
    r = v.quantize(Decimal(1).scaleb(v.adjusted() - 2), rounding=ROUND_HALF_UP)
    if r.adjusted() > v.adjusted():  # 9.995 -> 10.0, not 10.00
        r = r.quantize(Decimal(1).scaleb(r.adjusted() - 2), rounding=ROUND_HALF_UP)
    return f"{r}%"


def _pts2(x: float) -> str:
    return f"{1e4 * x:.1f} pts^2"


def _pts_effect(x: float) -> str:
    return "0" if x == 0 else f"{100 * x:+g} pts"


def markdown(table: str, rows: list[dict[str, Any]]) -> str:
    """The table as docs/calibration.md holds it."""
    if table == "coverage":
        out = ["| seeds per arm | training noise | seed t | sign-flip | two-level bootstrap |",
               "|---:|---|---:|---:|---:|"]
        out += [f"| {r['seeds_per_arm']} | {r['noise']} | {pct(r[SeedT.name])} | {pct(r[SignFlip.name])} | "
                f"{pct(r[TwoLevelBootstrap.name])} |" for r in rows]
    elif table == "seed_noise":
        out = [("| seeds per arm (sweeps) | paired Hoeffding | exact McNemar | paired bootstrap | seed t (`auto` at "
                ">= 2 seeds) | two-level bootstrap lower bound > 0 (descriptive) |"), "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            one = r["seeds_per_arm"] == 1
            out.append(f"| {r['seeds_per_arm']} ({r['sweeps']}) | {pct(r[PairedHoeffding.name])} | "
                       f"{pct(r[McNemarExact.name])}{' (`auto` at 1 seed, binary scores)' if one else ''} | "
                       f"{pct(r[PairedBootstrap.name])} | "
                       f"{'-' if one else '**' + pct(r[SeedT.name]) + '**'} | "
                       f"{'-' if one else pct(r['two_level_bootstrap_low_above_0'])} |")
    elif table == "variance_split":
        out = [("| seeds per arm | true training variance | item part | training, unbiased (mean) | "
                "training, floored at 0 (mean; compare's `training_var`) | floor fires |"),
               "|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['seeds_per_arm']} | {_pts2(r['true_training_var'])} | {_pts2(r['item_var'])} | "
                f"{_pts2(r['training_var_unbiased'])} | {_pts2(r['training_var_floored'])} | "
                f"{pct(r['floored_share'])} |" for r in rows]
    elif table == "equivalence":
        out = ["| seeds per arm | at the margin (+5 pts) | at 0 |", "|---:|---:|---:|"]
        out += [f"| {r['seeds_per_arm']} | {pct(r['at_margin'])} | {pct(r['at_zero'])} |" for r in rows]
    elif table == "verdicts":
        out = [("| seeds per arm | rule | validated | worse | equivalent | not_supported | inconclusive | "
               "not_supported at gain = target |"), "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            at = r.get("not_supported_at_target")
            out.append(f"| {r['seeds_per_arm']} | {r['rule']} | "
                       + " | ".join(pct(r[w]) for w in WORDS) + (" | |" if at is None else f" | {pct(at)} |"))
    elif table == "looks":
        out = [("| true effect | validated, looks [3, 6, 10] | expected seeds per arm | validated, one look at 10 "
               "| validated, every seed 3..10 unplanned |"), "|---:|---:|---:|---:|---:|"]
        for r in rows:
            seq, naive = pct(r["validated_sequential"]), pct(r["validated_every_seed_unplanned"])
            out.append(f"| {_pts_effect(r['effect'])} | {f'**{seq}**' if r['effect'] == 0 else seq} | "
                       f"{r['expected_seeds_sequential']:.2f} | {pct(r['validated_fixed'])} | "
                       f"{naive if r['effect'] == 0 else naive + ' (not a valid rate)'} |")
    else:
        out = [("| seeds per arm | smallest p | sign-flip null (normal / t3) | seed t null (normal / t3) | "
               "sign-flip power | seed t power |"), "|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['seeds_per_arm']} | {r['p_min']:#.2g} | {pct(r['sign_flip_null_normal'])} / "
                f"{pct(r['sign_flip_null_t3'])} | {pct(r['seed_t_null_normal'])} / {pct(r['seed_t_null_t3'])} | "
                f"{pct(r['sign_flip_power'])} | {pct(r['seed_t_power'])} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("table", choices=sorted(TABLES))
    p.add_argument("--sweeps", type=int, default=20000, help="simulated sweeps per cell (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    p.add_argument("--markdown", action="store_true", help="print the table as docs/calibration.md holds it")
    args = p.parse_args(argv)
    if not 10 <= args.sweeps <= 1_000_000:
        print("eval.calibrate: error: --sweeps must be in [10, 1000000]", file=sys.stderr)
        return 2
    rows = TABLES[args.table](args.sweeps, args.seed)
    if args.markdown:
        print(markdown(args.table, rows))
        return 0
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
