"""Seed-level inference, A/A calibration, several treatments (Holm), the pre-registered decision rule and
the eval-curve endpoints of eval.compare, on constructed run folders (written as the trainer writes them,
see test_compare.make_run) whose answers are known in closed form."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import yaml
from test_compare import EVAL, _records, _sentinel, make_run

from eval.compare import CompareError, compare, main
from eval.records import write_item_records
from eval.stats import (
    holm_adjust,
    seed_t_interval,
    t_cdf,
    t_quantile,
    two_level_bootstrap_ci,
)

# Student t 0.975 quantiles (any printed table): df 1, 2, 4, 9, 30
T975 = {1: 12.706204736174698, 2: 4.302652729749464, 4: 2.7764451051977934, 9: 2.2621571628540993,
        30: 2.0422724563012373}
FINAL = 24  # schedule.num_steps of the default config


def _with_gap(n: int, base_k: int, gap_k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Treatment and baseline vectors on n items: baseline right on base_k items, the treatment on
    base_k + gap_k (gap_k may be negative), shuffled."""
    b = np.zeros(n, bool)
    b[:base_k] = True
    t = b.copy()
    if gap_k >= 0:
        t[base_k:base_k + gap_k] = True
    else:
        t[base_k + gap_k:base_k] = False
    perm = rng.permutation(n)
    return t[perm], b[perm]


def _sweep(root, arms: dict[tuple[str, int], np.ndarray], overrides=(), curves=None, name="sweep"):
    """A sweep folder holding one run per (loss, seed); `curves[(loss, seed)]` = {step: correct} adds the
    start (step 0) and periodic eval files."""
    sweep = root / name
    sweep.mkdir()
    for job, ((loss, seed), correct) in enumerate(sorted(arms.items())):
        base_loss = loss if loss in ("grpo", "dppo") else "dppo"
        run = make_run(sweep / str(job), base_loss, seed, correct, overrides=tuple(overrides))
        if loss != base_loss:  # a third loss: a dppo config renamed (the loss plugin itself is not needed)
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["loss"]["name"] = loss
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
            info = json.loads((run / "run_info.json").read_text())
            info.update(loss=loss, arm=f"{loss}_seed{seed}")
            (run / "run_info.json").write_text(json.dumps(info))
        for step, c in ((curves or {}).get((loss, seed)) or {}).items():
            stem = f"{EVAL}_start" if step == 0 else f"{EVAL}_step{step}"
            write_item_records(run / "eval" / f"{stem}.jsonl", _records(c))
    return sweep


def _trained_under(run, **decision):
    """Rewrite a run's `decision` block as if it had been trained under it: config.yaml and the hash train.py
    records in run_info.json (a block edited after training is what compare refuses)."""
    from trainer.config.digest import decision_hash

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["decision"].update(decision)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    info = json.loads((run / "run_info.json").read_text())
    info["decision_sha256"] = decision_hash(cfg["decision"])
    (run / "run_info.json").write_text(json.dumps(info))


# ----------------------------------------------------------------------------- stats
def test_t_distribution_matches_tables_and_closed_forms():
    for df, q in T975.items():
        assert t_quantile(0.975, df) == pytest.approx(q, rel=1e-10)
        assert t_cdf(q, df) == pytest.approx(0.975, abs=1e-10)
    # closed forms: df 1 is Cauchy, df 2 has F(t) = 1/2 + t / (2 sqrt(t^2 + 2))
    for t in (-7.0, -1.3, 0.0, 0.4, 3.3):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-14)
        assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(t * t + 2)), abs=1e-14)
    # large df approaches the normal
    assert t_quantile(0.975, 2000) == pytest.approx(1.959963984540054, abs=2e-3)
    with pytest.raises(ValueError, match="df"):
        t_cdf(1.0, 0)


def test_seed_t_interval_closed_form():
    d = np.array([0.24, -0.04, 0.22])
    r = seed_t_interval(d, alpha=0.05)
    se = d.std(ddof=1) / math.sqrt(3)
    assert r["mean"] == pytest.approx(d.mean()) and r["df"] == 2
    assert r["ci_low"] == pytest.approx(d.mean() - T975[2] * se, rel=1e-9)
    assert r["ci_high"] == pytest.approx(d.mean() + T975[2] * se, rel=1e-9)
    # p of the t statistic: 2 (1 - F_2(t)), F_2 in closed form
    t = d.mean() / se
    assert r["p"] == pytest.approx(2 * (0.5 - t / (2 * math.sqrt(t * t + 2))), rel=1e-9)
    with pytest.raises(ValueError, match=">= 2 seeds"):
        seed_t_interval([0.1])


def test_two_level_bootstrap_spread_matches_its_closed_form_variance():
    """Resampling S seeds then n items within each gives a mean with variance
    (1/S) [ mean_s (D_s - D)^2 + mean_s var_s / n ]  (var_s: the population variance of seed s's items)."""
    rng = np.random.default_rng(4)
    S, n = 4, 300
    # three seeds with the same item values (resampling one shared item draw for all of them would not
    # average their item noise: sd 0.035 instead of 0.023) and a seed with another mean
    x = rng.choice([-1.0, 0.0, 1.0], size=n, p=[0.2, 0.5, 0.3])
    d = np.stack([x, x, x, np.where(rng.random(n) < 0.3, 1.0, 0.0)])
    lo, hi, means = two_level_bootstrap_ci(d, alpha=0.05, n_resamples=6000, seed=1)
    D = d.mean(axis=1)
    var = (np.mean((D - D.mean()) ** 2) + np.mean(d.var(axis=1)) / n) / S
    assert means.std() == pytest.approx(math.sqrt(var), rel=0.06)
    assert lo < d.mean() < hi
    assert two_level_bootstrap_ci(d, n_resamples=500, seed=3)[:2] == two_level_bootstrap_ci(d, n_resamples=500,
                                                                                            seed=3)[:2]


def test_holm_matches_the_step_down_definition():
    p = [0.03, 0.001, 0.04, 0.2]
    # sorted 0.001, 0.03, 0.04, 0.2 times 4, 3, 2, 1, running max
    want = {1: 0.004, 0: 0.09, 2: 0.09, 3: 0.2}
    assert holm_adjust(p) == pytest.approx([want[i] for i in range(4)])
    assert holm_adjust([]) == []


# ----------------------------------------------------------------------------- seed level in compare
def test_large_between_seed_variance_item_level_significant_seed_level_not(tmp_path):
    """The acceptance case: per-seed gaps +24, -4, +22 pts on 1000 items. Pooled over items the gap is
    +14 pts, far beyond the Hoeffding half-width (8.6 pts): the item-level rule validates. Over seeds the
    t interval is +14 +- 4.303 x sd / sqrt(3) = [-24.7, +52.7] pts: the seed-level rule does not."""
    rng = np.random.default_rng(0)
    n, gaps = 1000, {0: 240, 1: -40, 2: 220}
    arms = {}
    for s, g in gaps.items():
        arms["dppo", s], arms["grpo", s] = _with_gap(n, 400, g, rng)
    sweep = _sweep(tmp_path, arms, overrides=("decision.method=paired_hoeffding",))
    item = compare([sweep], n_bootstrap=400, make_plots=False, out=tmp_path / "item")
    assert item["verdict"] == "validated" and item["verdict_scope"] == "fixed_checkpoints"
    assert item["headline"].startswith("validated (these checkpoints): dppo vs grpo")
    assert item["verdicts"][0]["verdict_about"] == "these checkpoints"
    assert item["diff"] == pytest.approx(0.14) and item["hoeffding_half_width"] == pytest.approx(
        math.sqrt(2 * math.log(40) / n))
    assert (item["ci_low"], item["ci_high"]) == pytest.approx((0.14 - item["hoeffding_half_width"],
                                                              0.14 + item["hoeffding_half_width"]))
    assert item["mcnemar_p"] < 1e-20
    d = np.array([0.24, -0.04, 0.22])
    sl = item["seed_level"]
    assert sl["per_seed_diff"] == pytest.approx(d.tolist())
    half = T975[2] * d.std(ddof=1) / math.sqrt(3)
    assert (sl["t_ci_low"], sl["t_ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert item["methods"]["seed_t"]["verdict"] == "inconclusive"
    assert item["methods"]["seed_t"]["estimand"] == "this training procedure"
    assert item["methods"]["paired_hoeffding"]["estimand"] == "these fixed checkpoints"
    md = (tmp_path / "item" / "compare.md").read_text()
    assert "Scope: these fixed checkpoints" in md and "this training procedure" in md

    # the same runs with the default rule (auto: seed_t at >= 2 seeds per arm) and with seed_t pre-registered
    for method in ("auto", "seed_t"):
        for run in sweep.iterdir():
            if run.is_dir():
                _trained_under(run, method=method)
        seedv = compare([sweep], n_bootstrap=400, make_plots=False, out=tmp_path / method)
        assert seedv["verdict"] == "inconclusive" and seedv["verdict_scope"] == "across_seeds"
        assert seedv["decision"]["method"] == "seed_t" and seedv["decision"]["overridden"] == []
        assert seedv["decision"]["requested"] == method
        # the top-level interval and p are the rule's: the t interval over seeds, computed here independently
        assert (seedv["ci_low"], seedv["ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-9)
        t = d.mean() / (d.std(ddof=1) / math.sqrt(3))
        assert seedv["p"] == pytest.approx(2 * (0.5 - t / (2 * math.sqrt(t * t + 2))), rel=1e-9)
        assert seedv["estimate"] == pytest.approx(d.mean()) and seedv["hoeffding_ci_low"] == item["ci_low"]
        assert seedv["verdicts"][0]["headline"].startswith("inconclusive (this training procedure): dppo vs grpo")
        # a one-seed verdict has no seed-level counterpart: the per-seed rows carry no verdict under seed_t
        assert all(r["verdict"] is None and r["method"] is None for r in seedv["per_seed"])
        md = (tmp_path / method / "compare.md").read_text()
        assert "Scope: this training procedure" in md and "**inconclusive** (this training procedure)" in md


def test_one_seed_says_the_verdict_is_about_two_checkpoints(tmp_path):
    rng = np.random.default_rng(1)
    t, b = _with_gap(200, 80, 50, rng)
    sweep = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b})
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    assert out["verdict_scope"] == "fixed_checkpoints" and out["seed_level"] is None
    assert "seed_t" not in out["methods"]
    # auto with one seed per arm: paired Hoeffding, a verdict about these two checkpoints, said in the headline
    # one run per arm on right / wrong scores: `auto` is exact McNemar, and the headline says so
    assert out["decision"]["requested"] == "auto" and out["decision"]["method"] == "mcnemar_exact"
    assert out["headline"].endswith("(decision.method auto, one run per arm on right / wrong scores: exact "
                                    "McNemar)")
    assert out["verdict"] == "validated" and out["diff"] == pytest.approx(0.25)
    assert out["headline"].startswith("validated (these checkpoints): dppo vs grpo: the treatment's checkpoints")
    assert "not a finding about the training procedure" in out["headline"]
    assert out["verdicts"] == [{k: out[k] for k in out["verdicts"][0]}]
    md = (sweep / "compare.md").read_text()
    assert "## Verdict: **validated** (these checkpoints)" in md and out["headline"] in md
    assert "the verdict concerns the two trained checkpoints and cannot separate the loss from training noise" in md
    # a seed-level rule cannot decide with one seed: refused, nothing written
    (sweep / "compare.json").unlink()
    with pytest.raises(CompareError, match="seed_t .* 1 seed per arm"):
        compare([sweep], method="seed_t", override_decision=True, make_plots=False)
    assert not (sweep / "compare.json").exists()


# ----------------------------------------------------------------------------- A/A
def test_aa_sweep_reports_between_seed_spread_and_calibrates_an_ab_gap(tmp_path):
    rng = np.random.default_rng(2)
    n = 400
    acc = {0: 0.30, 1: 0.42, 2: 0.36}  # three seeds of grpo: 12 pts of between-seed range
    aa_runs = {}
    for s, a in acc.items():
        c = np.zeros(n, bool)
        c[rng.choice(n, int(a * n), replace=False)] = True
        aa_runs["grpo", s] = c
    aa = _sweep(tmp_path, aa_runs, name="aa")
    out = compare([aa], n_bootstrap=0)
    assert out["mode"] == "aa" and out["verdict"] is None and out["verdict_scope"] == "across_seeds"
    sd = float(np.std(list(acc.values()), ddof=1))
    assert out["aa"]["between_seed_sd"] == pytest.approx(sd)
    assert out["aa"]["max_abs_pair_diff"] == pytest.approx(0.12)
    assert len(out["aa"]["pairs"]) == 3
    # 0 vs 1 differ by 12 pts on 400 items: an item-level test calls two seeds of one loss different
    p01 = next(p for p in out["aa"]["pairs"] if (p["seed_a"], p["seed_b"]) == (0, 1))
    assert p01["item_level_significant"] and p01["mcnemar_p"] < 0.05
    assert (aa / "compare.md").read_text().startswith("# A/A comparison: grpo")

    # an A/B sweep of the same experiment: gaps of +5, +8, +2 pts
    ab_runs = {}
    for s, g in {0: 20, 1: 32, 2: 8}.items():
        ab_runs["dppo", s], ab_runs["grpo", s] = _with_gap(n, 140, g, rng)
    ab = _sweep(tmp_path, ab_runs, name="ab")
    res = compare([ab], aa=aa, n_bootstrap=0, make_plots=False)
    cal = res["aa_calibration"]
    gap = np.mean([0.05, 0.08, 0.02])
    se = math.sqrt(2) * sd / math.sqrt(3)
    assert cal["observed_gap"] == pytest.approx(gap)
    assert cal["noise_se_of_mean_gap"] == pytest.approx(se)
    assert (cal["low"], cal["high"]) == pytest.approx((gap - T975[2] * se, gap + T975[2] * se))
    assert abs(gap) < T975[2] * se and cal["exceeds_aa_noise"] is False
    assert "does NOT exceed" in (ab / "compare.md").read_text()
    # gaps of +25, +26, +24 pts clear the same noise floor (+-21 pts)
    big = {}
    for s, g in {0: 100, 1: 104, 2: 96}.items():
        big["dppo", s], big["grpo", s] = _with_gap(n, 140, g, rng)
    res = compare([_sweep(tmp_path, big, name="ab2")], aa=aa, n_bootstrap=0, make_plots=False)
    assert res["aa_calibration"]["observed_gap"] == pytest.approx(0.25)
    assert res["aa_calibration"]["exceeds_aa_noise"] is True and 0.25 > T975[2] * se
    # the A/A runs before the gates that use its seed sd: an A/B trained with preflight.skip=false still uses
    # it, while a setting that changes training does not pass
    gated = compare([_sweep(tmp_path, big, name="ab_gated", overrides=("preflight.skip=false",))], aa=aa,
                    n_bootstrap=0, make_plots=False)
    assert gated["aa_calibration"]["observed_gap"] == pytest.approx(0.25)
    with pytest.raises(CompareError, match="optimizer.lr"):
        compare([_sweep(tmp_path, big, name="ab_lr", overrides=("optimizer.lr=0.001",))], aa=aa, make_plots=False)

    # bad input: an A/A sweep passed as A/B, an A/B sweep passed as --aa, an A/A with an A/A
    old = _sentinel(ab)
    with pytest.raises(CompareError, match="A/A sweep passed as A/B"):
        compare([aa], treatment="dppo", make_plots=False, out=ab)
    with pytest.raises(CompareError, match="not an A/A sweep"):
        compare([ab], aa=ab, make_plots=False)
    with pytest.raises(CompareError, match="themselves an A/A"):
        compare([aa], aa=aa, make_plots=False, out=ab)
    assert (ab / "compare.json").read_bytes() == old


# ----------------------------------------------------------------------------- several treatments
def test_several_treatments_are_holm_adjusted(tmp_path):
    """Two treatments at +9.2 and +8.9 pts on 1000 items: Hoeffding p = 2 exp(-n d^2 / 2) = 0.029 and 0.038,
    each below alpha on its own, but Holm decides the smaller at alpha / 2 = 0.025 and stops there."""
    rng = np.random.default_rng(3)
    n = 1000
    t1, b = _with_gap(n, 300, 92, rng)
    t2 = b.copy()  # the third arm: right where the baseline is, and on 89 more items
    t2[np.flatnonzero(~b)[:89]] = True
    sweep = _sweep(tmp_path, {("grpo", 0): b, ("dppo", 0): t1, ("cispo", 0): t2},
                   overrides=("decision.method=paired_hoeffding",))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    assert out["treatments"] == ["cispo", "dppo"] and out["baseline"] == "grpo"
    rows = {r["treatment"]: r for r in out["comparisons"]}
    p = {k: 2 * math.exp(-n * d ** 2 / 2) for k, d in (("dppo", 0.092), ("cispo", 0.089))}
    for k, pk in p.items():
        assert rows[k]["p_rule"] == pytest.approx(pk, rel=1e-9)
        assert rows[k]["methods"]["paired_hoeffding"]["verdict"] == "validated"  # unadjusted
    assert rows["dppo"]["p_holm"] == pytest.approx(2 * p["dppo"])
    assert rows["cispo"]["p_holm"] == pytest.approx(max(2 * p["dppo"], p["cispo"]))
    assert rows["dppo"]["holm_level"] == pytest.approx(0.025) and rows["cispo"]["holm_level"] == pytest.approx(0.05)
    assert {v["treatment"]: v["verdict"] for v in out["verdicts"]} == {"dppo": "inconclusive", "cispo": "inconclusive"}
    assert all(v["verdict_about"] == "these checkpoints" and v["p"] <= 1 for v in out["verdicts"])
    assert {v["treatment"]: v["p"] for v in out["verdicts"]} == {k: rows[k]["p_holm"] for k in rows}
    assert "verdict" not in out  # no single verdict with several treatments
    md = (sweep / "compare.md").read_text()
    assert "Holm-adjusted" in md and md.count("| **inconclusive** (these checkpoints) |") == 2
    # one treatment alone is decided at the full alpha
    # keeping one of the two treatments shrinks Holm's family: refused, or recorded as an override
    with pytest.raises(CompareError, match=r"treatments: the runs hold \['cispo', 'dppo'\], --treatment keeps "
                                           r"\['dppo'\].*--override-decision"):
        compare([sweep], treatment="dppo", n_bootstrap=0, make_plots=False, out=tmp_path / "one")
    assert not (tmp_path / "one").exists()
    alone = compare([sweep], treatment="dppo", n_bootstrap=0, make_plots=False, out=tmp_path / "one",
                    override_decision=True)
    assert alone["verdict"] == "validated" and any("left out" in x and "cispo_seed0" in x for x in alone["notes"])
    assert any(x.startswith("treatments:") for x in alone["decision"]["overridden"])
    assert "OVERRIDDEN" in (tmp_path / "one" / "compare.md").read_text()
    # naming every treatment is the pre-registered comparison
    both = compare([sweep], treatment="cispo,dppo", n_bootstrap=0, make_plots=False, out=tmp_path / "both")
    assert both["decision"]["overridden"] == []


# ----------------------------------------------------------------------------- decision rule
def test_decision_rule_is_read_from_config_and_overriding_it_is_explicit(tmp_path, capsys):
    rng = np.random.default_rng(5)
    t, b = _with_gap(300, 100, 25, rng)
    sweep = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b}, overrides=("decision.margin=0.01",))
    old = _sentinel(sweep)
    assert main([str(sweep), "--method", "mcnemar_exact", "--margin", "0", "--no-plots", "--bootstrap", "0"]) == 2
    err = capsys.readouterr().err
    assert "another decision rule than the pre-registered one" in err and "--override-decision" in err
    assert "method: 'auto' -> 'mcnemar_exact'" in err
    assert (sweep / "compare.json").read_bytes() == old
    # the same value as the config is not an override
    assert main([str(sweep), "--margin", "0.01", "--no-plots", "--bootstrap", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decision"]["margin"] == 0.01 and out["decision"]["overridden"] == []
    assert out["verdict"] == out["methods"]["paired_hoeffding"]["verdict"]
    assert main([str(sweep), "--method", "mcnemar_exact", "--margin", "0", "--override-decision", "--no-plots",
                 "--bootstrap", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decision"]["method"] == "mcnemar_exact" and len(out["decision"]["overridden"]) == 2
    b_items, c_items = out["b_items"], out["c_items"]
    assert out["verdict"] == ("validated" if out["mcnemar_p"] < 0.05 and b_items > c_items else "inconclusive")
    assert "OVERRIDDEN" in (sweep / "compare.md").read_text()
    # a margin: validated needs the bound above it
    r = compare([sweep], n_bootstrap=0, make_plots=False)
    m = r["methods"]["paired_hoeffding"]
    assert m["ci_low"] == pytest.approx(r["diff"] - r["hoeffding_half_width"]) == r["ci_low"]
    assert r["verdict"] == ("validated" if m["ci_low"] > 0.01 else "inconclusive")


def test_unknown_decision_method_in_the_runs_config_is_refused(tmp_path):
    rng = np.random.default_rng(6)
    t, b = _with_gap(100, 30, 10, rng)
    sweep = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b})
    for run in ("0", "1"):
        cfg = yaml.safe_load((sweep / run / "config.yaml").read_text())
        cfg["decision"]["method"] = "wilcoxon"
        (sweep / run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CompareError, match="decision.method must be one of"):
        compare([sweep], make_plots=False)
    assert not (sweep / "compare.json").exists()


# ----------------------------------------------------------------------------- eval-curve endpoints
def _curve_runs(rng, n=60):
    """Per (loss, seed): correctness at steps 0, 12 and the final 24; dppo learns items earlier."""
    start = rng.random(n) < 0.2
    curves, finals = {}, {}
    for s in (0, 1):
        final = start | (rng.random(n) < 0.5)
        for loss in ("grpo", "dppo"):
            mid = start | (final & (rng.random(n) < (0.8 if loss == "dppo" else 0.3)))
            curves[loss, s] = {0: start, 12: mid}
            finals[loss, s] = final
    return curves, finals


def test_eval_curve_auc_step_endpoint_and_steps_to_threshold(tmp_path):
    rng = np.random.default_rng(7)
    curves, finals = _curve_runs(rng)
    sweep = _sweep(tmp_path, finals, curves=curves)
    out = compare([sweep], n_bootstrap=0)
    cv = out["curve"]
    assert cv["steps"] == [0, 12, FINAL]
    # per-item AUC by hand: trapezoid over 0 -> 12 -> 24, normalised by 24 = (c0 + 2 c12 + c24) / 4
    def auc(loss, s):
        c = curves[loss, s]
        return (c[0].astype(float) + 2 * c[12] + finals[loss, s]) / 4
    want = np.mean([auc("dppo", s) - auc("grpo", s) for s in (0, 1)])
    assert cv["treatments"]["dppo"]["auc"]["diff"] == pytest.approx(want)
    for loss in ("grpo", "dppo"):
        acc12 = np.mean([curves[loss, s][12].mean() for s in (0, 1)])
        assert cv["arms"][loss]["accuracy"][1] == pytest.approx(acc12)
    # threshold default: the baseline's final accuracy (mean over seeds); grpo reaches it at the end
    assert cv["threshold"] == pytest.approx(np.mean([finals["grpo", s].mean() for s in (0, 1)]))
    assert "eval_curve" in out["plots"] and (sweep / out["plots"]["eval_curve"]).read_bytes()[:4] == b"\x89PNG"
    # the per-item AUC as the pre-registered endpoint, and accuracy at step 12
    a = compare([sweep], endpoint="auc", override_decision=True, n_bootstrap=0, make_plots=False,
                out=tmp_path / "auc")
    assert a["diff"] == pytest.approx(want) and a["decision"]["endpoint"] == "auc"
    st = compare([sweep], endpoint="step", step=12, override_decision=True, n_bootstrap=0, make_plots=False,
                 out=tmp_path / "s12")
    assert st["diff"] == pytest.approx(np.mean([curves["dppo", s][12].mean() - curves["grpo", s][12].mean()
                                                for s in (0, 1)]))
    with pytest.raises(CompareError, match="needs an eval at step 7"):
        compare([sweep], endpoint="step", step=7, override_decision=True, make_plots=False, out=tmp_path / "x")


def test_periodic_eval_on_other_items_is_refused(tmp_path):
    rng = np.random.default_rng(8)
    curves, finals = _curve_runs(rng)
    sweep = _sweep(tmp_path, finals, curves=curves)
    run = sweep / "1"
    write_item_records(run / "eval" / f"{EVAL}_step12.jsonl", _records(curves["dppo", 1][12][:-3]))
    old = _sentinel(sweep)
    with pytest.raises(CompareError, match="periodic evals on different item sets.*step-12"):
        compare([sweep], make_plots=False)
    assert (sweep / "compare.json").read_bytes() == old


def test_seed_in_one_arm_only_is_refused(tmp_path):
    rng = np.random.default_rng(9)
    arms = {}
    for loss, s in itertools.product(("grpo", "dppo"), (0, 1)):
        arms[loss, s] = rng.random(50) < 0.5
    del arms["dppo", 1]
    sweep = _sweep(tmp_path, arms)
    with pytest.raises(CompareError, match="seed 1 has no 'dppo' run .*one arm only"):
        compare([sweep], make_plots=False)
    assert not (sweep / "compare.json").exists()


# ----------------------------------------------------------------------------- McNemar's direction
def test_mcnemar_direction_comes_from_the_item_counts_with_several_seeds(tmp_path):
    """3 seeds, 200 items: 30 items right in every treatment seed and wrong in every baseline seed (d_i = +1),
    60 items right in baseline seed 0 only (d_i = -1/3). The mean gap is (90 - 60) / 600 = +5 pts, but the
    sign test counts b = 30 items for the treatment and c = 60 against it (two-sided p = 0.0021): more
    items favour the baseline, so the exact McNemar rule cannot validate the treatment."""
    S, n = 3, 200
    arms = {}
    for s in range(S):
        t, b = np.zeros(n, bool), np.zeros(n, bool)
        t[:30] = True
        if s == 0:
            b[30:90] = True
        arms["dppo", s], arms["grpo", s] = t, b
    sweep = _sweep(tmp_path, arms, overrides=("decision.method=mcnemar_exact",))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    m = out["methods"]["mcnemar_exact"]
    assert out["diff"] == pytest.approx(0.05)
    assert (m["b_items"], m["c_items"]) == (30, 60)
    assert m["p_two_sided"] == pytest.approx(0.00211, abs=5e-5) and m["p"] == 1.0
    assert out["decision"]["method"] == "mcnemar_exact"
    # 60 items favour the baseline, 30 the treatment
    assert out["verdict"] == "worse" and m["verdict"] == "worse"
    assert "significantly more items favour the baseline" in out["headline"]


def test_mcnemar_direction_with_the_auc_endpoint(tmp_path):
    """One seed, per-item AUC over steps 0, 12, 24 (weights 1/4, 1/2, 1/4): 20 items right at every eval for
    the treatment and never for the baseline (+1 each), 50 items the baseline has at every eval and the
    treatment from step 12 on (-1/4 each). Mean +(20 - 12.5) / 200 = +3.75 pts, 20 items up, 50 down."""
    n = 200
    t0, t12, tf = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    b0, b12, bf = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
    t0[:20] = t12[:20] = tf[:20] = True
    b0[20:70] = b12[20:70] = bf[20:70] = True
    t12[20:70] = tf[20:70] = True
    curves = {("dppo", 0): {0: t0, 12: t12}, ("grpo", 0): {0: b0, 12: b12}}
    sweep = _sweep(tmp_path, {("dppo", 0): tf, ("grpo", 0): bf}, curves=curves,
                   overrides=("decision.method=mcnemar_exact", "decision.endpoint=auc"))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    m = out["methods"]["mcnemar_exact"]
    assert out["decision"]["endpoint"] == "auc"
    assert out["diff"] == pytest.approx((20 - 50 * 0.25) / n)
    assert (m["b_items"], m["c_items"]) == (20, 50) and m["p_two_sided"] < 0.001
    assert out["verdict"] == "worse"


# ----------------------------------------------------------------------------- degenerate and secondary statistics
def test_seed_t_with_identical_per_seed_gaps_is_not_validated(tmp_path):
    """Two seeds, each with a gap of exactly +10 pts on 40 items: the sd over seeds is 0, the t interval
    has no width and p is undefined. The verdict is inconclusive, never validated."""
    r = seed_t_interval([0.1, 0.1, 0.1])
    assert r["se"] == 0 and r["p"] == 1.0 and r["degenerate"]
    arms = {}
    for s in (0, 1):
        b = np.zeros(40, bool)
        b[:10] = True
        t = b.copy()
        t[10:14] = True
        arms["dppo", s], arms["grpo", s] = t, b
    out = compare([_sweep(tmp_path, arms)], n_bootstrap=0, make_plots=False)
    assert out["decision"]["method"] == "seed_t" and out["estimate"] == pytest.approx(0.1)
    assert out["seed_level"]["sd"] == 0
    assert out["verdict"] == "inconclusive" and out["methods"]["seed_t"]["verdict"] == "inconclusive"
    assert out["p"] == 1.0 and "sd 0" in out["methods"]["seed_t"]["note"]


def test_holm_adjusted_p_values_never_exceed_one():
    rng = np.random.default_rng(11)
    for _ in range(200):
        p = rng.uniform(0.3, 1.0, size=rng.integers(2, 8))
        adj = holm_adjust(p)
        assert max(adj) <= 1.0 and all(a >= x for a, x in zip(adj, p))
    assert holm_adjust([0.6, 0.9]) == [1.0, 1.0]


def test_two_level_bootstrap_is_descriptive_and_per_step_tests_are_labelled(tmp_path):
    rng = np.random.default_rng(12)
    curves, finals = _curve_runs(rng)
    sweep = _sweep(tmp_path, finals, curves=curves)
    out = compare([sweep], n_bootstrap=200, make_plots=False)
    tl = out["methods"]["two_level_bootstrap"]
    assert tl["verdict"] is None and tl["p"] is None and tl["ci_low"] <= tl["ci_high"]
    assert out["curve"]["per_step_tests"].startswith("unadjusted, exploratory")
    md = (sweep / "compare.md").read_text()
    assert "| two-level bootstrap (seeds, then items) | this training procedure |" in md
    assert "| - | descriptive |" in md and "per step (paired on the same items; unadjusted, exploratory)" in md


def test_auc_on_unevenly_spaced_eval_steps_equals_a_hand_computation(tmp_path):
    """Evals at steps 0, 4 and the final 24 (gaps 4 and 20): the trapezoid gives an item right at 0, 4
    and 24 an area of 1; right at 4 and 24 only, (4 x 1/2 + 20 x 1) / 24 = 22 / 24; right at 24 only,
    20 x 1/2 / 24 = 10 / 24; right at 0 only, 4 x 1/2 / 24 = 2 / 24; right at 0 and 4 only,
    (4 + 20 x 1/2) / 24 = 14 / 24."""
    pattern = {  # (at 0, at 4, at 24) -> hand-computed area
        (1, 1, 1): 24 / 24, (0, 1, 1): 22 / 24, (0, 0, 1): 10 / 24, (1, 0, 0): 2 / 24, (1, 1, 0): 14 / 24,
        (0, 0, 0): 0.0, (0, 1, 0): 12 / 24, (1, 0, 1): 12 / 24}
    keys = list(pattern)
    t_pat = [keys[i % len(keys)] for i in range(48)]
    b_pat = [keys[(3 * i + 1) % len(keys)] for i in range(48)]
    def arm(pat):
        return {0: np.array([p[0] for p in pat], bool), 4: np.array([p[1] for p in pat], bool)}, \
            np.array([p[2] for p in pat], bool)
    (tc, tf), (bc, bf) = arm(t_pat), arm(b_pat)
    sweep = _sweep(tmp_path, {("dppo", 0): tf, ("grpo", 0): bf}, curves={("dppo", 0): tc, ("grpo", 0): bc},
                   overrides=("decision.endpoint=auc",))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    want_t = np.array([pattern[p] for p in t_pat])
    want_b = np.array([pattern[p] for p in b_pat])
    assert out["curve"]["steps"] == [0, 4, FINAL]
    assert out["diff"] == pytest.approx(float((want_t - want_b).mean()), abs=1e-12)
    assert out["acc_treatment"] == pytest.approx(float(want_t.mean()), abs=1e-12)
    auc = out["curve"]["treatments"]["dppo"]["auc"]
    assert auc["items_higher"] == int((want_t > want_b).sum()) and auc["items_lower"] == int((want_t < want_b).sum())


# ----------------------------------------------------------------------------- inert arms
def _rewrite_metrics(run, frac: float, shift: float = 0.0, updates: int = 2, steps: int = 4, objective=0.0):
    """Rows as the trainer logs them: both arms' rule fractions (`frac`), a counterfactual GSPO clip that
    fires in any GRPO vs DPPO run (it is no rule of either arm), the loss's own objective value."""
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(steps):
            for u in range(updates):
                f.write(json.dumps({"step": step, "update": u, "env/reward_mean": 0.1 * step + shift,
                                    "loss/dppo_masked_frac": frac, "loss/grpo_clip_frac": frac,
                                    "loss/gspo_clip_frac": 0.5 + 0.01 * u, "loss/value": objective * (u + 1),
                                    "loss/dppo_masked_frac_adv_pos": frac, "time/step_s": 1.0 + u + shift * 7,
                                    "drift/abs_p_q90": 0.01 * u}) + "\n")


def test_arms_whose_rule_never_acted_read_inert_with_the_evidence(tmp_path):
    """The rehearsal's case: no token masked or clipped in any update of either arm, the arms' training rows
    identical (only the wall-clock differs). A gap in the eval (here +25 pts) is then not about the loss."""
    rng = np.random.default_rng(13)
    arms = {}
    for s in (0, 1, 2):
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, 50, rng)
    sweep = _sweep(tmp_path, arms)
    for run in sweep.iterdir():
        if run.is_dir():
            # each loss's objective differs from the other's even when the gradients are equal
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            _rewrite_metrics(run, 0.0, objective=25.5 if cfg["loss"]["name"] == "grpo" else -49.6)
            # wall-clock differs between any two runs: it is not part of "trained identically"
            if cfg["loss"]["name"] == "dppo":
                rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
                (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "time/step_s": 9.0}) + "\n" for r in rows))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    assert out["verdict"] == "inert" and out["verdicts"][0]["verdict"] == "inert"
    assert out["headline"].startswith("inert (this training procedure): dppo vs grpo: the switch never acted")
    ev = out["activity"]
    assert ev["inert"] and [x["seed"] for x in ev["per_seed"]] == [0, 1, 2]
    assert all(x["identical_training_rows"] and x["rule_fractions_all_zero"] and x["updates"] == 8
               for x in ev["per_seed"])
    assert set(ev["per_seed"][0]["max_rule_fraction"]) == {"loss/dppo_masked_frac", "loss/grpo_clip_frac"}
    assert out["methods"]["seed_t"]["estimate"] == pytest.approx(0.25)  # the numbers stay, the verdict does not use them
    md = (sweep / "compare.md").read_text()
    assert "## Verdict: **inert**" in md and "## The switch never acted: dppo vs grpo" in md

    # the rule acted in one update of one seed (rows differ, a fraction > 0): not inert
    dppo0 = next(r for r in sweep.iterdir() if r.is_dir() and json.loads((r / "run_info.json").read_text())["arm"]
                 == "dppo_seed0")
    rows = [json.loads(x) for x in (dppo0 / "metrics.jsonl").read_text().splitlines()]
    rows[5]["loss/dppo_masked_frac"] = 0.01
    rows[5]["env/reward_mean"] += 0.02
    (dppo0 / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "acted")
    assert out["verdict"] != "inert" and not out["activity"]["inert"]
    seed0 = out["activity"]["per_seed"][0]
    assert seed0["identical_training_rows"] is False and seed0["max_rule_fraction"]["loss/dppo_masked_frac"] == 0.01


# ----------------------------------------------------------------------------- quiet paths to `validated`
def _three_seed_sweep(tmp_path, overrides=(), name="sweep"):
    rng = np.random.default_rng(14)
    arms = {}
    for s, g in {0: 50, 1: 2, 2: -6}.items():  # one lucky seed pair
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, g, rng)
    return _sweep(tmp_path, arms, overrides=overrides, name=name)


def test_two_run_folders_of_a_larger_sweep_are_an_override(tmp_path):
    sweep = _three_seed_sweep(tmp_path)
    whole = compare([sweep], n_bootstrap=0, make_plots=False)
    assert whole["verdict"] == "inconclusive" and whole["decision"]["overridden"] == []
    runs = {json.loads((p / "run_info.json").read_text())["arm"]: p for p in sweep.iterdir() if p.is_dir()}
    two = [runs["dppo_seed0"], runs["grpo_seed0"]]
    with pytest.raises(CompareError, match=r"inputs: two run folders of the sweep .*6 runs.*--override-decision"):
        compare(two, n_bootstrap=0, make_plots=False, out=tmp_path / "pick")
    assert not (tmp_path / "pick").exists()
    picked = compare(two, n_bootstrap=0, make_plots=False, out=tmp_path / "pick", override_decision=True)
    assert picked["verdict"] == "validated" and picked["verdict_scope"] == "fixed_checkpoints"
    assert any(x.startswith("inputs: two run folders") for x in picked["decision"]["overridden"])


def test_bootstrap_settings_are_part_of_the_rule_when_the_bootstrap_decides(tmp_path):
    sweep = _three_seed_sweep(tmp_path, overrides=("decision.method=paired_bootstrap",))
    base = compare([sweep], n_bootstrap=2000, seed=0, make_plots=False, out=tmp_path / "a", override_decision=True)
    assert base["decision"]["overridden"] == [("bootstrap: 10000 resamples, seed 0 -> 2000 resamples, seed 0 (the "
                                               "bootstrap decides)")]
    with pytest.raises(CompareError, match="bootstrap: 10000 resamples, seed 0 -> 10000 resamples, seed 7"):
        compare([sweep], seed=7, make_plots=False, out=tmp_path / "b")
    assert not (tmp_path / "b").exists()
    # when the bootstrap only reports, its settings change nothing that decides
    other = _three_seed_sweep(tmp_path, name="other")
    assert compare([other], n_bootstrap=300, seed=7, make_plots=False)["decision"]["overridden"] == []


def test_a_decision_block_edited_after_the_preflight_record_is_an_override(tmp_path):
    from trainer.config.compose import run_config
    from trainer.preflight.gates import design as design_gate

    pre = tmp_path / "pre"
    overrides = (f"preflight.dir={pre}", "decision.seed_sd=0.05")
    design_gate(run_config(list(overrides)), pre, n_seeds=3, n_sims=30).write(pre)
    sweep = _three_seed_sweep(tmp_path, overrides=overrides)
    assert compare([sweep], n_bootstrap=0, make_plots=False)["decision"]["overridden"] == []
    for run in sweep.iterdir():  # the rule edited in the runs' config after the plan was recorded
        if run.is_dir():
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["decision"]["method"] = "mcnemar_exact"
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CompareError, match=r"decision: the runs' config differs from the preflight record .*"
                                           r"design.json \(method: 'auto' -> 'mcnemar_exact'\)"):
        compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "edited")
    # one run's block differs from the others'
    cfg = yaml.safe_load((sweep / "0" / "config.yaml").read_text())
    cfg["decision"]["alpha"] = 0.1
    (sweep / "0" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CompareError, match=r"decision.alpha: 0.05 .* vs 0.1"):
        compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "edited")
    with pytest.raises(CompareError, match=r"decision: the runs' `decision` blocks differ"):
        compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "edited", allow_config_diff=True)
    assert not (tmp_path / "edited").exists()


def test_fewer_seeds_than_planned_and_repeated_looks_are_recorded(tmp_path):
    from trainer.config.compose import run_config
    from trainer.preflight.gates import design as design_gate

    pre = tmp_path / "pre"
    overrides = (f"preflight.dir={pre}", "decision.seed_sd=0.05")
    design_gate(run_config(list(overrides)), pre, n_seeds=3, n_sims=30).write(pre)
    rng = np.random.default_rng(15)
    arms = {}
    for s in (0, 1, 2):
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, 20, rng)
    two = {k: v for k, v in arms.items() if k[1] < 2}
    sweep2 = _sweep(tmp_path, two, overrides=overrides, name="s2")
    with pytest.raises(CompareError, match=r"seeds: the plan .* has 3 seeds per arm, this comparison 2"):
        compare([sweep2], n_bootstrap=0, make_plots=False, out=tmp_path / "looks")
    first = compare([sweep2], n_bootstrap=0, make_plots=False, out=tmp_path / "looks", override_decision=True)
    assert first["looks"] == []
    # the third seed arrives; compare again into the same folder: a second look, listed and noted
    sweep3 = _sweep(tmp_path, arms, overrides=overrides, name="s3")
    second = compare([sweep3], n_bootstrap=0, make_plots=False, out=tmp_path / "looks")
    assert second["decision"]["overridden"] == []
    assert second["looks"] == [{"n_seeds": 2, "seeds": [0, 1], "verdicts": {"dppo": first["verdict"]}}]
    assert any(x.startswith("decision 2 of this comparison") for x in second["notes"])
    assert "decision 2 of this comparison" in (tmp_path / "looks" / "compare.md").read_text()
    # the same data again is not another look
    again = compare([sweep3], n_bootstrap=0, make_plots=False, out=tmp_path / "looks")
    assert again["looks"] == second["looks"]


def test_a_planned_look_below_the_design_s_seeds_is_a_stop_not_a_cut(tmp_path):
    """decision.looks = [2, 3] with a design for 3 seeds: the 2-seed comparison is look 1 (decided at its
    share of alpha), not a sweep cut short; 2 seeds without looks is still refused."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import design as design_gate

    rng = np.random.default_rng(15)
    arms = {}
    for s in (0, 1):
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, 20, rng)
    for looks, name in (("[2,3]", "looks"), ("null", "fixed")):
        pre = tmp_path / f"pre_{name}"
        overrides = (f"preflight.dir={pre}", "decision.seed_sd=0.05", f"decision.looks={looks}")
        design_gate(run_config(list(overrides)), pre, n_seeds=3, n_sims=30).write(pre)
        sweep = _sweep(tmp_path, arms, overrides=overrides, name=f"s_{name}")
        if name == "looks":
            res = compare([sweep], n_bootstrap=0, make_plots=False)
            assert res["look"]["index"] == 1 and res["verdict"] == "inconclusive"
        else:
            with pytest.raises(CompareError, match=r"seeds: the plan .* has 3 seeds per arm, this comparison 2"):
                compare([sweep], n_bootstrap=0, make_plots=False)


# ----------------------------------------------------------------------------- calibration under seed noise
def test_false_positive_rates_under_seed_noise_and_the_default_rule_holds_alpha():
    """A validated verdict with no effect is a false positive; a calibrated rule gives alpha / 2 = 2.5%
    (one side of a two-sided alpha = 0.05). With 3 seeds per arm the default rule (auto -> seed_t) must
    stay at that rate (within 3 Monte Carlo se), while the item-level methods, which hold the checkpoints
    fixed, validate seed noise far more often than alpha."""
    from eval.calibrate import checkpoint_sweeps
    from eval.compare import method_table
    from eval.methods import resolve_method

    n_sweeps, S, alpha = 1500, 3, 0.05
    default, _ = resolve_method("auto", S)
    hits = {k: 0 for k in ("paired_hoeffding", "mcnemar_exact", "paired_bootstrap", "seed_t")}
    excl_two_level = 0
    for i, (t, b) in enumerate(checkpoint_sweeps(n_sweeps, S)):
        _, methods, _ = method_table(t, b, alpha, 0.0, 200, i)
        for k in hits:
            hits[k] += methods[k]["verdict"] == "validated"
        excl_two_level += methods["two_level_bootstrap"]["ci_low"] > 0
    rate = {k: v / n_sweeps for k, v in hits.items()}
    se = math.sqrt(0.025 * 0.975 / n_sweeps)
    assert rate[default] <= 0.025 + 3 * se, rate
    assert rate["mcnemar_exact"] > 0.15 and rate["paired_bootstrap"] > 0.15, rate  # item-level: seed luck
    assert excl_two_level / n_sweeps > 0.025 + 3 * se  # why the two-level bootstrap has no verdict


# ----------------------------------------------------------------------------- arms differing in one other switch
def _switch_sweep(root, key: str, values: dict[str, np.ndarray], baseline: str | None, name="sweep",
                  extra=()):
    """One run per (value of `key`, seed), the loss grpo everywhere: `python train.py --multirun key=a,b
    seed=...` with decision.baseline='key=a' (quoted: the value holds an '=')."""
    sweep = root / name
    sweep.mkdir()
    base = (f"decision.baseline='{baseline}'",) if baseline else ()
    for job, ((value, seed), correct) in enumerate(sorted(values.items())):
        run = make_run(sweep / str(job), "grpo", seed, correct, overrides=(f"{key}={value}", *base, *extra))
        _rewrite_metrics(run, 0.0, shift=float(value))  # the arms trained differently (no rule fired)
    return sweep


def test_arms_may_differ_in_one_other_config_switch(tmp_path, capsys):
    """`--multirun schedule.updates_per_batch=2,8 seed=0,1,2`: the arms are the two values, the baseline is
    named `schedule.updates_per_batch=2`, and the verdict reads like a loss comparison's."""
    rng = np.random.default_rng(16)
    arms = {}
    for s in (0, 1, 2):
        arms["8", s], arms["2", s] = _with_gap(200, 60, 30 + 2 * s, rng)
    key = "schedule.updates_per_batch"
    sweep = _switch_sweep(tmp_path, key, arms, f"{key}=2")
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    assert out["switch"] == key and out["baseline"] == f"{key}=2" and out["treatments"] == [f"{key}=8"]
    assert out["decision"]["method"] == "seed_t" and out["verdict"] == "validated"
    assert out["estimate"] == pytest.approx(np.mean([0.15, 0.16, 0.17]))
    assert out["headline"].startswith(f"validated (this training procedure): {key}=8 vs {key}=2")
    assert {a["arm"] for a in out["arms"]} == {f"{key}={v}_seed{s}" for v in ("2", "8") for s in (0, 1, 2)}
    # a switch other than the loss acts without any rule firing: fractions at 0 do not make it inert,
    # identical training rows do
    assert not out["activity"]["inert"] and all(x["rule_fractions_all_zero"] for x in out["activity"]["per_seed"])
    same = _switch_sweep(tmp_path, key, arms, f"{key}=2", name="same")
    for run in same.iterdir():
        if run.is_dir():
            _rewrite_metrics(run, 0.0)
    assert compare([same], n_bootstrap=0, make_plots=False)["verdict"] == "inert"
    # the baseline may be named by its value, matched as a number (2e-4 names 0.0002)
    lr = {("0.0002", 0): arms["2", 0], ("0.0002", 1): arms["2", 1], ("0.001", 0): arms["8", 0],
          ("0.001", 1): arms["8", 1]}
    lr_sweep = _switch_sweep(tmp_path, "optimizer.lr", lr, "optimizer.lr=2e-4", name="lr")
    res = compare([lr_sweep], n_bootstrap=0, make_plots=False)
    assert res["switch"] == "optimizer.lr" and res["baseline"] == "optimizer.lr=0.0002"

    # bad input, one line each, exit 2, nothing written: a baseline naming no arm, two switches at once,
    # an A/A sweep of another value of the switch
    nobase = _switch_sweep(tmp_path, key, arms, None, name="nobase")
    assert main([str(nobase), "--no-plots", "--no-wandb"]) == 2
    err = capsys.readouterr().err
    assert "the baseline 'grpo' (decision.baseline / --baseline) names no arm" in err and str(nobase / "0") in err
    assert f"decision.baseline='{key}=<value>'" in err and err.count("\n") == 1
    two = _switch_sweep(tmp_path, key, {("2", 0): arms["2", 0], ("8", 0): arms["8", 0]}, f"{key}=2", name="two")
    cfg = yaml.safe_load((two / "1" / "config.yaml").read_text())
    cfg["optimizer"]["lr"] = 0.5
    (two / "1" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main([str(two), "--no-plots", "--no-wandb"]) == 2
    err = capsys.readouterr().err
    assert "the runs differ in 2 config keys, not one switch" in err and "optimizer.lr" in err and key in err
    aa = _switch_sweep(tmp_path, key, {("4", s): arms["2", s] for s in (0, 1, 2)}, f"{key}=2", name="aa")
    assert compare([aa], n_bootstrap=0, make_plots=False)["mode"] == "aa"
    with pytest.raises(CompareError, match=rf"--aa .*aa: its runs \(0, 1, 2\) are the arm '{key}=4', none of"):
        compare([sweep], aa=aa, n_bootstrap=0, make_plots=False, out=tmp_path / "with_aa")
    assert not (nobase / "compare.json").exists() and not (two / "compare.json").exists()
    assert not (tmp_path / "with_aa").exists()


def test_a_design_record_of_another_plan_is_not_held_against_the_runs(tmp_path):
    """The preflight folder may hold a record of another plan of the same experiment (another eval size):
    compare says so and checks nothing against it."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import design as design_gate

    pre = tmp_path / "pre"
    design_gate(run_config([f"preflight.dir={pre}", "decision.seed_sd=0.05", "eval.n_examples=500",
                                "decision.method=seed_t"]), pre, n_seeds=5, n_sims=30).write(pre)
    sweep = _three_seed_sweep(tmp_path, overrides=(f"preflight.dir={pre}", "decision.seed_sd=0.05"))
    out = compare([sweep], n_bootstrap=0, make_plots=False)
    assert out["decision"]["overridden"] == []
    assert any("is for another plan" in n for n in out["notes"])
    # one note, not also "no preflight design record" beside it
    assert not any(n.startswith("no preflight design record") for n in out["notes"])


def test_a_validated_verdict_within_the_aa_noise_floor_is_noted(tmp_path):
    """One seed per arm, +25 pts on 200 items: paired Hoeffding validates these checkpoints; an A/A sweep whose
    seeds differ by up to 30 pts says two seeds of one loss differ by as much. The notes say so beside the
    verdict (the printed summary carries them)."""
    rng = np.random.default_rng(17)
    n = 200
    aa_runs = {}
    for s, a in {0: 0.30, 1: 0.60, 2: 0.45}.items():
        c = np.zeros(n, bool)
        c[rng.choice(n, int(a * n), replace=False)] = True
        aa_runs["grpo", s] = c
    aa = _sweep(tmp_path, aa_runs, name="aa")
    t, b = _with_gap(n, 80, 50, rng)
    ab = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b}, name="ab")
    out = compare([ab], aa=aa, n_bootstrap=0, make_plots=False)
    assert out["verdict"] == "validated" and not out["aa_calibration"]["exceeds_aa_noise"]
    assert any("validated (these checkpoints), but the gap +25.00 pts does NOT exceed the A/A noise floor" in x
               for x in out["notes"])
