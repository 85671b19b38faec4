"""Issue 42's verdicts at the seed counts people can afford: equivalence, the exact sign-flip test, sequential
looks counted wherever the runs are, provenance (the decision block the runs trained under, sweep membership),
`inert` that says which condition fired, stdout that explains itself, effect sizes, and the method registry.
The sweeps are constructed run folders (test_compare.make_run, test_verdict._sweep) whose per-seed gaps are
set exactly, so every expected number is known in closed form."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_verdict import _rewrite_metrics, _sweep, _trained_under, _with_gap

from eval.calibrate import TABLES as CALIBRATE_TABLES
from eval.compare import CompareError, compare, main
from eval.stats import sign_flip_p

N_ITEMS = 200
ROOT = Path(__file__).resolve().parents[1]


def _gap_sweep(root, gaps_items: list[int], overrides=(), name="sweep", base_k=80, loss="dppo", seed0=0):
    """One seed pair per entry: the treatment right on gaps_items[s] more items than the baseline (of 200)."""
    rng = np.random.default_rng(42)
    arms = {}
    for s, g in enumerate(gaps_items):
        arms[loss, seed0 + s], arms["grpo", seed0 + s] = _with_gap(N_ITEMS, base_k, g, rng)
    return _sweep(root, arms, overrides=overrides, name=name)


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([*map(str, args), "--no-plots", "--no-wandb", "--bootstrap", "0"])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ----------------------------------------------------------------------------- equivalence
def test_gaps_within_half_a_point_read_equivalent_and_real_gaps_do_not(tmp_path, capsys):
    """6 seeds per arm, per-seed gaps of -0.5..+0.5 pts, decision.equivalence_margin = 0.05: seed t's 95%
    interval (mean 0, sd 0.45 pts, t_5 = 2.571: +-0.47 pts) lies inside +-5 pts."""
    sweep = _gap_sweep(tmp_path, [1, -1, 0, 1, -1, 0], overrides=("decision.equivalence_margin=0.05",))
    rc, out, _ = _cli(capsys, sweep)
    res = json.loads((sweep / "compare.json").read_text())
    assert rc == 0 and res["verdict"] == "equivalent" and res["verdict_scope"] == "across_seeds"
    assert out.startswith("equivalent (this training procedure): dppo vs grpo")
    d = np.array([1, -1, 0, 1, -1, 0]) / N_ITEMS
    half = 2.5705818366147395 * d.std(ddof=1) / math.sqrt(6)
    assert (res["ci_low"], res["ci_high"]) == pytest.approx((-half, half))
    assert res["decision"]["equivalence_margin"] == 0.05
    # gaps of +3..+8 pts with a margin of 2 pts: the interval [3.6, 7.4] pts is not inside +-2 pts
    big = _gap_sweep(
        tmp_path, [6, 8, 10, 12, 14, 16], overrides=("decision.equivalence_margin=0.02",), name="big"
    )
    res = compare([big], n_bootstrap=0, make_plots=False)
    assert res["verdict"] == "validated" and res["ci_low"] > 0.02
    # an interval that is not inside the margin on both sides is not equivalent: [-0.97, +4.97] pts vs +-3 pts
    wide = _gap_sweep(
        tmp_path, [0, 8, -4, 12, 4, 4], overrides=("decision.equivalence_margin=0.03",), name="wide"
    )
    res = compare([wide], n_bootstrap=0, make_plots=False)
    assert res["verdict"] == "inconclusive" and res["ci_low"] > -0.03 and res["ci_high"] > 0.03
    # the same sweep without the margin never reads equivalent
    off = _gap_sweep(tmp_path, [1, -1, 0, 1, -1, 0], name="off")
    assert compare([off], n_bootstrap=0, make_plots=False)["verdict"] == "inconclusive"


def test_equivalence_margin_on_the_command_line_is_an_override(tmp_path):
    sweep = _gap_sweep(tmp_path, [1, -1, 0, 1, -1, 0])
    with pytest.raises(CompareError, match=r"equivalence_margin: None -> 0.05.*--override-decision"):
        compare([sweep], n_bootstrap=0, make_plots=False, equivalence_margin=0.05)
    res = compare([sweep], n_bootstrap=0, make_plots=False, equivalence_margin=0.05, override_decision=True)
    assert res["verdict"] == "equivalent" and res["decision"]["overridden"] == [
        "equivalence_margin: None -> 0.05"
    ]


# ----------------------------------------------------------------------------- the words
def _said(capsys, sweep):
    """(compare.json, stdout's first line, compare.md): the three places a verdict is read."""
    rc, out, _ = _cli(capsys, sweep)
    assert rc == 0
    md = (sweep / "compare.md").read_text()
    return json.loads((sweep / "compare.json").read_text()), out.splitlines()[0], md


def test_a_significant_loss_reads_worse_and_a_null_interval_inconclusive(tmp_path, capsys):
    """The audit's C16 / C18: gaps -10/-12/-11/-9 pts (interval [-12.6, -8.4]) and gaps +20/-20 (+-254 pts)
    both read `not_supported`. Now: `worse`, and `inconclusive`, alike on stdout, compare.json and
    compare.md."""
    loss = _gap_sweep(tmp_path, [-20, -24, -22, -18], name="loss")
    res, head, md = _said(capsys, loss)
    assert res["verdict"] == "worse" and res["ci_high"] < 0
    assert head.startswith("worse (this training procedure): dppo vs grpo: the treatment trains worse")
    assert "## Verdict: **worse**" in md and res["headline"] in md
    null = _gap_sweep(tmp_path, [40, -40], name="null", overrides=("decision.target_effect=0.15",))
    res, head, md = _said(capsys, null)
    assert res["verdict"] == "inconclusive" and res["ci_high"] > 0.15
    assert head.startswith("inconclusive (this training procedure)") and "## Verdict: **inconclusive**" in md


def test_not_supported_only_where_the_interval_rules_out_the_target(tmp_path, capsys):
    """Gaps +-15 pts around -8.5 (upper bound below +15 pts): `not_supported` with decision.target_effect
    = 0.15, `inconclusive` without a target (nothing to rule out)."""
    gaps = [-17, -47, -8, 13, -2, -20, -60, 5]  # items of 200: mean -17 items = -8.5 pts
    with_target = _gap_sweep(tmp_path, gaps, name="target", overrides=("decision.target_effect=0.15",))
    res, head, md = _said(capsys, with_target)
    assert res["verdict"] == "not_supported" and 0 < res["ci_high"] < 0.15 and res["ci_low"] < 0
    assert "rules out the plan's target gain" in head and "## Verdict: **not_supported**" in md
    without = _gap_sweep(tmp_path, gaps, name="none")
    assert compare([without], n_bootstrap=0, make_plots=False)["verdict"] == "inconclusive"


def test_a_gain_below_the_margin_says_the_treatment_scored_higher(tmp_path, capsys):
    """The audit's C13: margin 5 pts, gaps averaging +1.67 (interval above 0, below the margin) read
    `not_supported` under the headline "did not score higher". Now the headline says it did, by less than the
    margin; with a target of 5 pts the interval rules it out (`not_supported`), without one `inconclusive`."""
    gaps = [3, 4, 3, 3, 4, 3]
    for name, extra, verdict in (("m", (), "inconclusive"),
                                 ("mt", ("decision.target_effect=0.05",), "not_supported")):
        sweep = _gap_sweep(tmp_path, gaps, name=name, overrides=("decision.margin=0.05", *extra))
        res, head, md = _said(capsys, sweep)
        assert res["verdict"] == verdict and 0 < res["ci_low"] and res["ci_high"] < 0.05
        said = (f"the treatment did score higher (lower bound {100 * res['ci_low']:+.2f} pts > 0), by less "
                "than")
        assert said in head and said in res["headline"] and said in md
        assert "did not score higher" not in head


def test_equivalent_needs_an_interval_of_some_width(tmp_path, capsys):
    """The audit's E4: identical gaps +2.5/+2.5 read `equivalent` [+2.50, +2.50] beside "the verdict is at
    best inconclusive". A zero spread says nothing: `inconclusive`."""
    sweep = _gap_sweep(tmp_path, [5, 5], overrides=("decision.equivalence_margin=0.05",))
    res, head, _ = _said(capsys, sweep)
    assert res["verdict"] == "inconclusive" and res["ci_low"] == res["ci_high"]
    assert head.startswith("inconclusive") and "sd 0" in head


def test_the_null_reads_inconclusive_but_for_each_word_s_own_rate():
    """Under no effect the plain rule says `validated` and `worse` each in at most alpha / 2 of sweeps (3
    Monte Carlo se) and nothing else; a target adds `not_supported` (right under the null), whose error at a
    true gain of the target is at most alpha / 2."""
    from eval.calibrate import verdicts

    n = 3000
    rows = verdicts(n, seed=4, seeds=(3, 6))
    for row in rows:
        assert row["validated"] <= 0.025 + 3 * _se(n) and row["worse"] <= 0.025 + 3 * _se(n), row
        if row["rule"] == "plain":
            assert row["equivalent"] == row["not_supported"] == 0.0
            assert row["inconclusive"] >= 0.95 - 6 * _se(n)
        if "not_supported_at_target" in row:
            assert row["not_supported_at_target"] <= 0.025 + 3 * _se(n) and row["not_supported"] > 0.1


# ----------------------------------------------------------------------------- auto with one run per arm
def _generative(n=40, both=3, only_t=13, only_b=1):
    """The audit's generative task: 0.40 vs 0.10 over 40 items, 13 items only the treatment gets, 1 only the
    baseline: exact McNemar p = 2 (1 + 14) / 2^14 = 0.0018, while Hoeffding's half-width at 40 items is 43
    pts."""
    t, b = np.zeros(n, bool), np.zeros(n, bool)
    t[:both] = b[:both] = True
    t[both:both + only_t] = True
    b[both + only_t:both + only_t + only_b] = True
    return t, b


def test_auto_with_one_run_per_arm_on_right_or_wrong_scores_is_exact_mcnemar(tmp_path, capsys):
    from eval.comparison import binary_scores

    t, b = _generative()
    sweep = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b})
    res, head, md = _said(capsys, sweep)
    assert res["decision"]["method"] == "mcnemar_exact" and res["decision"]["requested"] == "auto"
    assert "auto -> mcnemar_exact (1 run per arm, binary scores" in res["decision"]["resolution"]
    assert res["verdict"] == "validated" and res["p"] == pytest.approx(2 * 15 / 2**14)
    assert res["methods"]["paired_hoeffding"]["verdict"] == "inconclusive"
    said = "(decision.method auto, one run per arm on right / wrong scores: exact McNemar)"
    assert said in head and said in res["headline"] and said in md
    # K samples per item (fractional scores), or the area under the curve, keep paired Hoeffding
    assert binary_scores({"eval": {"samples_per_item": 1}}, "final")
    assert not binary_scores({"eval": {"samples_per_item": 4}}, "final")
    assert not binary_scores({"eval": {"samples_per_item": 1}}, "auc")
    # a margin the exact test cannot shift keeps paired Hoeffding too
    margin = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b}, overrides=("decision.margin=0.02",), name="m")
    assert compare([margin], n_bootstrap=0, make_plots=False)["decision"]["method"] == "paired_hoeffding"


def test_auto_on_per_item_files_of_one_run_per_arm_is_exact_mcnemar(tmp_path):
    from eval.items import compare_items

    t, b = _generative()
    files = []
    for arm, x in (("new", t), ("old", b)):
        f = tmp_path / f"{arm}.jsonl"
        f.write_text("".join(json.dumps({"item_id": i, "seed": 0, "correct": bool(c)}) + "\n"
                             for i, c in enumerate(x)))
        files.append(f"{arm}={f}")
    res = compare_items(files, baseline="old", n_bootstrap=0, out=tmp_path / "out")
    assert res["decision"]["method"] == "mcnemar_exact" and res["verdict"] == "validated"


def test_the_flagship_plan_keeps_paired_hoeffding_pre_registered():
    from trainer.config.compose import run_config

    for exp in ("dppo_vs_grpo", "dppo_vs_grpo_8updates"):
        assert run_config([f"+experiment={exp}"]).decision.method == "paired_hoeffding"


# ----------------------------------------------------------------------------- the exact sign-flip test
def test_sign_flip_p_is_exact_over_the_sign_patterns():
    # 3 seeds, all gaps positive: only the all-plus and all-minus patterns reach |mean| 6 -> 2/8
    assert sign_flip_p([0.04, 0.06, 0.08]) == 0.25
    # 4 seeds with one negative gap: patterns with |mean| >= (5 + 3 + 2 - 1) / 4, counted by hand: 4 of 16
    assert sign_flip_p([0.05, 0.03, 0.02, -0.01]) == pytest.approx(4 / 16)
    assert sign_flip_p([-0.02, 0.01]) == 1.0  # mean below the margin
    assert sign_flip_p([0.03] * 6) == pytest.approx(2 / 64)
    # above the exact limit: the Monte Carlo p is valid ((1 + hits) / (1 + draws)) and near the exact value
    assert sign_flip_p([0.03] * 18, n_draws=20_000) == pytest.approx(
        1 / 20_001 * (1 + 20_000 * 2 / 2**18), abs=3e-4
    )


def test_three_seeds_validated_by_seed_t_alone_say_so(tmp_path, capsys):
    """Gaps +4/+6/+8 pts: seed t's interval [+1.03, +10.97] pts validates, the exact sign-flip p is 0.25 (its
    floor at 3 seeds), and the headline's notes say that only the normal model makes it significant."""
    sweep = _gap_sweep(tmp_path, [8, 12, 16])
    rc, out, _ = _cli(capsys, sweep)
    res = json.loads((sweep / "compare.json").read_text())
    assert rc == 0 and res["verdict"] == "validated"
    sf = res["methods"]["sign_flip"]
    assert sf["p"] >= 0.25 and sf["p"] == 0.25 and sf["p_min"] == 0.25 and sf["verdict"] == "inconclusive"
    assert "only seed t's normal model makes this significant" in out and "needs 6 seeds per arm" in out


def test_sign_flip_as_the_pre_registered_rule(tmp_path):
    few = _gap_sweep(tmp_path, [8, 12, 16], overrides=("decision.method=sign_flip",))
    res = compare([few], n_bootstrap=0, make_plots=False)
    assert res["method"] == "sign_flip" and res["verdict"] == "inconclusive" and res["ci_low"] is None
    assert any("sign_flip cannot reach p < 0.05 with 3 seeds per arm" in n for n in res["notes"])
    six = _gap_sweep(tmp_path, [8, 12, 16, 6, 10, 14], overrides=("decision.method=sign_flip",), name="six")
    res = compare([six], n_bootstrap=0, make_plots=False)
    assert res["verdict"] == "validated" and res["p"] == pytest.approx(2 / 64)


# ----------------------------------------------------------------------------- sequential looks
def test_a_first_look_decides_at_its_share_of_alpha_and_names_the_next(tmp_path, capsys):
    """decision.looks = [3, 6]: look 1 decides at alpha(0.5) = 2 - 2 Phi(1.96 / sqrt(0.5)) = 0.0056, where
    the +4/+6/+8 sweep (validated at 0.05) is not: `inconclusive`, continue to 6 seeds per arm."""
    sweep = _gap_sweep(tmp_path, [8, 12, 16], overrides=("decision.looks=[3,6]",))
    rc, out, _ = _cli(capsys, sweep)
    res = json.loads((sweep / "compare.json").read_text())
    assert rc == 0 and res["verdict"] == "inconclusive"
    assert res["look"]["index"] == 1 and res["look"]["level"] == pytest.approx(0.005574, abs=1e-5)
    assert "continue to 6 seeds per arm" in out
    # the second look (6 seeds, a new sweep folder and output folder) decides at the rest of alpha and knows
    # the first: the count lives beside the runs, not in the output folder
    more = _gap_sweep(tmp_path, [8, 12, 16, 9, 11, 13], overrides=("decision.looks=[3,6]",), name="more")
    res = compare([more], n_bootstrap=0, make_plots=False, out=tmp_path / "elsewhere")
    assert res["look"]["index"] == 2 and res["look"]["final"] and res["verdict"] == "validated"
    assert res["look"]["level"] == pytest.approx(0.05 - 0.005574, abs=1e-5)
    assert [x["n_seeds"] for x in res["looks"]] == [3]
    # a seed count no look plans is a departure from the plan
    odd = _gap_sweep(tmp_path, [8, 12, 16, 9], overrides=("decision.looks=[3,6]",), name="odd")
    with pytest.raises(CompareError, match=r"looks: decision.looks plans decisions at \[3, 6\].*has 4"):
        compare([odd], n_bootstrap=0, make_plots=False)


def test_an_early_look_that_stops_for_nothing_says_so_whatever_the_sign(tmp_path, capsys):
    """A first look where the treatment scored lower (a fixed design would read not_supported) reads
    `inconclusive` with a headline that says the next look decides, not that the treatment scored higher."""
    sweep = _gap_sweep(tmp_path, [-8, -12, -16], overrides=("decision.looks=[3,6]",), name="lower")
    rc, out, _ = _cli(capsys, sweep)
    res = json.loads((sweep / "compare.json").read_text())
    assert rc == 0 and res["verdict"] == "inconclusive" and res["estimate"] < 0
    head = out.splitlines()[0]
    assert "no decision yet (a look before the plan's last; the next look decides)" in head
    assert "scored higher" not in head


def test_a_later_look_reads_its_new_sweep_beside_the_first(tmp_path, capsys):
    """The seeds of look 2 run as a second sweep (seeds 3-5); compare takes both folders: 6 seeds per arm,
    the ledger's look 1 found, the decision at look 2's level, the output in the newest sweep."""
    first = _gap_sweep(tmp_path, [8, 12, 16], overrides=("decision.looks=[3,6]",), name="look1")
    assert compare([first], n_bootstrap=0, make_plots=False)["verdict"] == "inconclusive"
    second = _gap_sweep(tmp_path, [9, 11, 13], overrides=("decision.looks=[3,6]",), name="look2", seed0=3)
    rc, _, _ = _cli(capsys, first, second)
    res = json.loads((second / "compare.json").read_text())
    assert rc == 0 and res["verdict"] == "validated" and res["look"]["index"] == 2
    assert sorted(a["seed"] for a in res["arms"] if a["loss"] == "dppo") == [0, 1, 2, 3, 4, 5]
    assert [x["n_seeds"] for x in res["looks"]] == [3]
    # the same seeds in both folders are one arm trained twice, not more seeds
    again = _gap_sweep(tmp_path, [9, 11, 13], overrides=("decision.looks=[3,6]",), name="again")
    rc, _, err = _cli(capsys, first, again)
    assert rc == 2 and "dppo_seed0" in err
    rc, _, err = _cli(capsys, first, first)
    assert rc == 2 and "given twice" in err



def test_another_setting_of_one_experiment_is_another_comparison_not_a_look(tmp_path):
    """The mismatch ladder decides one experiment's arms at several levels of a knob, each at its own look
    1: a level is another question, so its look 1 on other seeds is neither refused nor counted as a
    re-run of the other level's. Editing the rule (decision.*) keeps the comparison, so the re-roll is still
    refused."""
    looks = "decision.looks=[3,6]"
    low = _gap_sweep(tmp_path, [8, 12, 16], overrides=(looks, "backend.sampler_logit_noise=0.1"), name="low")
    assert compare([low], n_bootstrap=0, make_plots=False)["looks"] == []
    high = _gap_sweep(tmp_path, [9, 11, 13], overrides=(looks, "backend.sampler_logit_noise=0.5"), name="high",
                      seed0=3)
    res = compare([high], n_bootstrap=0, make_plots=False)
    assert res["looks"] == [] and res["look"]["index"] == 1
    assert len(list((tmp_path / ".pairedrl" / "looks").iterdir())) == 2
    edited = _gap_sweep(tmp_path, [9, 11, 13], overrides=(looks, "backend.sampler_logit_noise=0.1",
                                                          "decision.alpha=0.1"), name="edited", seed0=6)
    with pytest.raises(CompareError, match="already decided on seeds"):
        compare([edited], n_bootstrap=0, make_plots=False)

def test_unplanned_looks_are_counted_across_sweep_and_output_folders(tmp_path):
    two = _gap_sweep(tmp_path, [8, 12], name="two")
    first = compare([two], n_bootstrap=0, make_plots=False, out=tmp_path / "a")
    assert first["looks"] == []
    three = _gap_sweep(tmp_path, [8, 12, 16], name="three")
    second = compare([three], n_bootstrap=0, make_plots=False, out=tmp_path / "b")
    assert [x["n_seeds"] for x in second["looks"]] == [2]
    assert any(n.startswith("decision 2 of this comparison") and "decision.looks" in n for n in second["notes"])
    assert second["decisions"]["count"] == 2
    ledger = tmp_path / ".pairedrl" / "looks"
    assert len(list(ledger.iterdir())) == 1 and second["looks_ledger"].startswith(str(ledger))


#: every method the registry scopes to fixed checkpoints: none of them can add seeds at a look
ITEM_LEVEL = ("paired_hoeffding", "mcnemar_exact", "paired_bootstrap")


def test_the_item_level_methods_are_the_registry_s_checkpoint_methods():
    from eval.methods import DECIDING, METHOD_SCOPE

    assert {m for m in DECIDING if METHOD_SCOPE[m] == "fixed_checkpoints"} == set(ITEM_LEVEL)


def test_the_ledger_is_per_item_set(tmp_path):
    """Another item set is another comparison: its looks are not this one's (and this one's look at a seed
    count the other recorded is still recorded)."""
    from eval.sequential import ledger_key

    assert ledger_key("x", "grpo", ["dppo"], "a" * 64, "final") != ledger_key("x", "grpo", ["dppo"], "b" * 64,
                                                                          "final")
    three = _gap_sweep(tmp_path, [8, 12, 16], name="three")
    assert compare([three], n_bootstrap=0, make_plots=False)["looks"] == []
    rng = np.random.default_rng(7)
    arms = {}
    for s, g in enumerate([8, 12, 16, 9, 11, 13]):
        arms["dppo", s], arms["grpo", s] = _with_gap(100, 40, g, rng)  # 100 items: another eval set
    six = _sweep(tmp_path, arms, name="six")
    res = compare([six], n_bootstrap=0, make_plots=False)
    assert res["looks"] == [] and not any("earlier looks" in n or "look 2" in n for n in res["notes"])


def test_a_compare_re_run_on_the_same_seeds_is_not_an_earlier_look(tmp_path):
    sweep = _gap_sweep(tmp_path, [8, 12, 16])
    for _ in range(2):
        res = compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "out")
        assert res["looks"] == [] and not any("look 2" in n for n in res["notes"])


def test_equivalence_is_read_at_the_rule_s_level_not_twice_it(tmp_path):
    """TOST here reads the rule's 1 - alpha interval (each bound a one-sided test at alpha / 2), not the
    textbook 1 - 2 alpha one. Gaps +-1 pt at 6 seeds: the 95% interval (+-0.94 pts) straddles a 0.8-pt
    margin, the 90% one (+-0.74 pts) lies inside it: not `equivalent`."""
    sweep = _gap_sweep(tmp_path, [2, -2, 0, 2, -2, 0], overrides=("decision.equivalence_margin=0.008",))
    res = compare([sweep], n_bootstrap=0, make_plots=False)
    D = np.array([2, -2, 0, 2, -2, 0]) / N_ITEMS
    se = D.std(ddof=1) / math.sqrt(6)
    assert 2.015048372669157 * se < 0.008 < 2.5705818366147395 * se
    assert res["ci_high"] == pytest.approx(2.5705818366147395 * se)
    assert res["verdict"] != "equivalent"


LOOKS = ("decision.looks=[3,6]",)


def _tree(tmp_path, name="train"):
    """A training folder as Hydra leaves it: <name>/multirun/<sweeps>."""
    (tmp_path / name / "multirun").mkdir(parents=True)
    return tmp_path / name / "multirun"


def test_a_planned_look_is_decided_once_whatever_the_seeds(tmp_path, capsys):
    """looks [3, 6]: look 2 decided on seeds 0-5 cannot be decided again on seeds 0-2 + 6-8 (the audit's
    re-roll), nor look 1 on seeds 6-8 after seeds 0-2; the refusal says what was decided before, and writes
    nothing. The record is in each run folder that took part."""
    runs = _tree(tmp_path)
    a = _gap_sweep(runs, [8, 12, 16], overrides=LOOKS, name="a")
    b = _gap_sweep(runs, [-9, -11, -13], overrides=LOOKS, name="b", seed0=3)
    c = _gap_sweep(runs, [9, 11, 13], overrides=LOOKS, name="c", seed0=6)
    assert compare([a], n_bootstrap=0, make_plots=False)["verdict"] == "inconclusive"
    first = compare([a, b], n_bootstrap=0, make_plots=False)
    assert first["look"]["index"] == 2 and first["seeds"] == [0, 1, 2, 3, 4, 5]
    rec = json.loads((a / "0" / "looks.json").read_text())["decisions"]
    assert [(x["n_seeds"], x["seeds"]) for x in rec] == [(3, [0, 1, 2]), (6, [0, 1, 2, 3, 4, 5])]
    rc, _, err = _cli(capsys, a, c)
    assert rc == 2 and "the look at 6 seeds per arm was already decided on seeds [0, 1, 2, 3, 4, 5]" in err
    assert f"dppo: {first['verdict']}" in err and "seeds [0, 1, 2, 6, 7, 8]" in err
    assert not (c / "compare.json").exists()
    rc, _, err = _cli(capsys, c)
    assert rc == 2 and "the look at 3 seeds per arm was already decided on seeds [0, 1, 2]" in err
    # the same seeds again are the same look, re-read
    assert compare([a, b], n_bootstrap=0, make_plots=False)["looks"] == [
        {"n_seeds": 3, "seeds": [0, 1, 2], "verdicts": {"dppo": "inconclusive"}}
    ]
    rc, out, _ = _cli(capsys, a, c, "--override-decision")
    assert rc == 0 and "OVERRIDDEN" in out and "already decided on seeds [0, 1, 2, 3, 4, 5]" in out


def test_decisions_without_planned_looks_are_counted_with_their_family_wise_alpha(tmp_path, capsys):
    """Three disjoint 3-seed sweeps, each decided at 0.05 (the audit: 7.26% false positives, no note): the
    third says it is decision 3, and the family-wise alpha 1 - 0.95^3, on stdout, compare.json and compare.md."""
    runs = _tree(tmp_path)
    for k in range(3):
        sweep = _gap_sweep(runs, [8, 12, 16], name=f"s{k}", seed0=3 * k)
        rc, out, _ = _cli(capsys, sweep)
        res = json.loads((sweep / "compare.json").read_text())
        assert rc == 0 and res["decisions"]["count"] == k + 1
    fw = 1 - 0.95**3
    assert res["decisions"]["family_wise_alpha"] == pytest.approx(fw)
    assert [x["seeds"] for x in res["looks"]] == [[0, 1, 2], [3, 4, 5]]
    line = "decision 3 of this comparison"
    assert f"note: {line}" in out and f"1 - (1 - 0.05)^3 = {fw:.3g}" in out
    assert line in (sweep / "compare.md").read_text()


def test_moving_the_training_tree_keeps_the_looks(tmp_path):
    runs = _tree(tmp_path)
    a = _gap_sweep(runs, [8, 12, 16], overrides=LOOKS, name="a")
    compare([a], n_bootstrap=0, make_plots=False)
    shutil.move(tmp_path / "train", tmp_path / "moved")
    moved = tmp_path / "moved" / "multirun"
    b = _gap_sweep(moved, [9, 11, 13], overrides=LOOKS, name="b", seed0=3)
    res = compare([moved / "a", b], n_bootstrap=0, make_plots=False, out=tmp_path / "o")
    assert res["look"]["index"] == 2 and [x["seeds"] for x in res["looks"]] == [[0, 1, 2]]
    c = _gap_sweep(moved, [9, 11, 13], overrides=LOOKS, name="c", seed0=6)
    with pytest.raises(CompareError, match=r"look at 3 seeds per arm was already decided on seeds \[0, 1, 2\]"):
        compare([c], n_bootstrap=0, make_plots=False)


def test_a_copy_whose_original_is_gone_keeps_the_looks(tmp_path):
    runs = _tree(tmp_path)
    a = _gap_sweep(runs, [8, 12, 16], overrides=LOOKS, name="a")
    compare([a], n_bootstrap=0, make_plots=False)
    copy = tmp_path / "elsewhere" / "a"
    shutil.copytree(a, copy)
    shutil.rmtree(tmp_path / "train")
    b = _gap_sweep(tmp_path / "elsewhere", [9, 11, 13], overrides=LOOKS, name="b", seed0=3)
    res = compare([copy, b], n_bootstrap=0, make_plots=False, out=tmp_path / "o")
    assert res["look"]["index"] == 2 and [x["seeds"] for x in res["looks"]] == [[0, 1, 2]]


def test_a_deleted_ledger_and_another_output_folder_keep_the_looks(tmp_path):
    runs = _tree(tmp_path)
    a = _gap_sweep(runs, [8, 12, 16], name="a")
    compare([a], n_bootstrap=0, make_plots=False, out=tmp_path / "o1")
    shutil.rmtree(tmp_path / "train" / ".pairedrl")
    b = _gap_sweep(runs, [9, 11, 13], name="b", seed0=3)
    res = compare([a, b], n_bootstrap=0, make_plots=False, out=tmp_path / "o2")
    assert res["decisions"]["count"] == 2 and [x["seeds"] for x in res["looks"]] == [[0, 1, 2]]


def test_looks_need_a_seed_level_rule():
    from trainer.config.compose import compose_config
    from trainer.config.schema import ConfigError, validate

    with pytest.raises(ConfigError, match="decision.looks"):
        validate(compose_config(["decision.looks=[3,2]"]))
    for method in ITEM_LEVEL:
        with pytest.raises(ConfigError, match="decision.looks.*seed-level"):
            validate(compose_config(["decision.looks=[3,6]", f"decision.method={method}"]))
    with pytest.raises(ConfigError, match="decision.equivalence_margin"):
        validate(compose_config(["decision.equivalence_margin=1.5"]))


# ----------------------------------------------------------------------------- provenance
def test_runs_of_a_sweep_linked_or_copied_into_a_new_folder_are_named_as_a_subset(tmp_path, capsys):
    sweep = _gap_sweep(tmp_path, [50, 2, -6])
    assert compare([sweep], n_bootstrap=0, make_plots=False)["verdict"] == "inconclusive"
    arm = {json.loads((p / "run_info.json").read_text())["arm"]: p for p in sweep.iterdir() if p.is_dir()}
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(arm["grpo_seed0"], linked / "0")
    os.symlink(arm["dppo_seed0"], linked / "1")
    rc, _, err = _cli(capsys, linked)
    assert rc == 2 and f"inputs: 2 of the 6 runs of the sweep {sweep}" in err and "--override-decision" in err
    assert not (linked / "compare.json").exists()
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copytree(arm["grpo_seed0"], copied / "0")
    shutil.copytree(arm["dppo_seed0"], copied / "1")
    with pytest.raises(CompareError, match=r"inputs: 2 of the 6 runs of the sweep .*left out"):
        compare([copied], n_bootstrap=0, make_plots=False)
    res = compare([copied], n_bootstrap=0, make_plots=False, override_decision=True)
    assert res["verdict"] == "validated" and any(
        x.startswith("inputs: 2 of the 6") for x in res["decision"]["overridden"]
    )


def test_a_decision_block_edited_after_training_is_refused_without_a_preflight_record(tmp_path, capsys):
    sweep = _gap_sweep(tmp_path, [50, 2, -6])
    info = json.loads((sweep / "0" / "run_info.json").read_text())
    assert info["decision_sha256"] and info["run_dir"] == str((sweep / "0").resolve())
    for run in sweep.iterdir():
        if run.is_dir():
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["decision"]["method"] = "mcnemar_exact"
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rc, _, err = _cli(capsys, sweep)
    assert rc == 2 and "is not the one the run trained under (run_info.json decision_sha256)" in err
    rc, out, _ = _cli(capsys, sweep, "--override-decision")
    assert rc == 0 and "OVERRIDDEN" in out and "the rule was changed after training" in out
    # runs trained under that block (the hash recorded with it) are not an override
    for run in sweep.iterdir():
        if run.is_dir():
            _trained_under(run, method="mcnemar_exact")
    assert compare([sweep], n_bootstrap=0, make_plots=False)["decision"]["overridden"] == []


def _edit_runs(sweep, method="mcnemar_exact", drop=("decision_sha256",)):
    for run in sweep.iterdir():
        if run.is_dir():
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            cfg["decision"]["method"] = method
            (run / "config.yaml").write_text(yaml.safe_dump(cfg))
            info = json.loads((run / "run_info.json").read_text())
            for k in drop:
                info.pop(k, None)
            (run / "run_info.json").write_text(json.dumps(info))


def test_a_removed_decision_digest_does_not_switch_the_check_off(tmp_path, capsys):
    """The audit's PV3: decision.method edited to mcnemar_exact after training and decision_sha256 deleted
    read `validated` with no note. A build that writes the digest also writes run_info_version (and run_dir):
    a run of it without the digest is refused. Runs of a build before the digest get a note instead."""
    sweep = _gap_sweep(tmp_path, [50, 2, -6])
    info = json.loads((sweep / "0" / "run_info.json").read_text())
    assert info["run_info_version"] == 2 and "sweep" in info
    _edit_runs(sweep)
    rc, _, err = _cli(capsys, sweep)
    assert rc == 2 and "has no decision_sha256, though the build that wrote it records one" in err
    _edit_runs(sweep, drop=("decision_sha256", "run_info_version"))  # run_dir still says which build
    rc, _, err = _cli(capsys, sweep)
    assert rc == 2 and "has no decision_sha256" in err
    old = _gap_sweep(tmp_path, [50, 2, -6], name="old")
    _edit_runs(old, drop=("decision_sha256", "run_info_version", "run_dir", "sweep"))
    res = compare([old], n_bootstrap=0, make_plots=False)
    assert any("was not checked against the one it trained under" in n for n in res["notes"])


def _launched(sweep, params, overrides):
    """Give each run of a constructed sweep the membership record train.py copies from its launch."""
    from trainer.hydra_callbacks import sweep_membership

    m = sweep_membership(params, overrides)
    for run in sweep.iterdir():
        if run.is_dir():
            info = json.loads((run / "run_info.json").read_text())
            cfg = yaml.safe_load((run / "config.yaml").read_text())
            job = m["jobs"].index([f"loss={cfg['loss']['name']}", f"seed={cfg['seed']}"])
            assert job == int(run.name)  # the constructed sweep numbers its jobs as Hydra does
            info["sweep"] = {**m, "job": job}
            (run / "run_info.json").write_text(json.dumps(info))
    return m


def test_a_subset_is_named_from_the_runs_own_membership_without_the_sweep_folder(tmp_path, capsys):
    """The audit's PV6: a 2-of-6 copy was accepted once the original folder was renamed. Each run now carries
    its launch's membership (jobs, hash), so the subset is named from the copy alone."""
    sweep = _gap_sweep(tmp_path, [50, 2, -6])
    _launched(sweep, {"loss": "dppo,grpo"}, ["seed=0,1,2"])
    copied = tmp_path / "copied"
    copied.mkdir()
    shutil.copytree(sweep / "0", copied / "0")  # dppo seed 0
    shutil.copytree(sweep / "3", copied / "1")  # grpo seed 0
    sweep.rename(tmp_path / "renamed")
    rc, _, err = _cli(capsys, copied)
    assert rc == 2 and "inputs: 2 of the 6 runs of the sweep" in err
    assert "job 1: loss=dppo seed=1" in err and "--override-decision" in err
    # the whole launch is no subset, wherever it is
    assert compare([tmp_path / "renamed"], n_bootstrap=0, make_plots=False)["decision"]["overridden"] == []


def test_the_membership_record_lists_the_jobs_in_hydra_s_own_order(tmp_path):
    """SweepRecord runs in a real --multirun (the sweeper's params and the command line's overrides): job
    number k of sweep.json is the overrides Hydra gave job k."""
    import subprocess
    import sys

    app = tmp_path / "app.py"
    app.write_text(
        "import json, hydra\n"
        "from hydra.core.hydra_config import HydraConfig\n"
        "@hydra.main(version_base=None, config_path='.', config_name='cfg')\n"
        "def main(cfg):\n"
        "    hc = HydraConfig.get()\n"
        "    open(f'job{hc.job.num}.json', 'w').write(json.dumps(list(hc.overrides.task)))\n"
        "main()\n"
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({
        "a": 0, "seed": 0, "hydra": {
            "callbacks": {"rec": {"_target_": "trainer.hydra_callbacks.SweepRecord"}},
            "sweeper": {"params": {"a": "x,y"}},
            "sweep": {"dir": str(tmp_path / "multi"), "subdir": "${hydra.job.num}"},
            "job": {"chdir": True}}}))
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    subprocess.run([sys.executable, str(app), "--multirun", "seed=range(0,3)"], cwd=tmp_path, check=True,
                   env={**os.environ, "PYTHONPATH": src}, capture_output=True, timeout=120)
    rec = json.loads((tmp_path / "multi" / "sweep.json").read_text())
    assert len(rec["jobs"]) == 6 and rec["seeds"] == ["0", "1", "2"] and rec["arms"] == ["a=x", "a=y"]
    for k, job in enumerate(rec["jobs"]):
        assert json.loads((tmp_path / "multi" / str(k) / f"job{k}.json").read_text()) == job


# ----------------------------------------------------------------------------- inert
def _metrics(run, frac_by_key: dict[str, float], shift: float):
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(3):
            for u in range(2):
                f.write(
                    json.dumps(
                        {"step": step, "update": u, "env/reward_mean": 0.1 * step + shift, **frac_by_key}
                    )
                    + "\n"
                )


def test_inert_states_the_condition_and_never_hides_a_gap(tmp_path):
    rng = np.random.default_rng(3)
    arms = {}
    for s in (0, 1, 2):
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, 56 + 2 * s, rng)
    sweep = _sweep(tmp_path, arms)
    zero = {"loss/dppo_masked_frac": 0.0, "loss/grpo_clip_frac": 0.0, "loss/gspo_clip_frac": 0.0}
    for run in sweep.iterdir():
        if run.is_dir():  # no rule fired, the rows differ (the reviewer's real A/A split)
            _metrics(run, zero, 0.01 * int(run.name))
    res = compare([sweep], n_bootstrap=0, make_plots=False)
    assert res["verdict"] == "inert"
    assert (
        "no rule of either loss fired" in res["headline"]
        and "the arms trained identically" not in res["headline"]
    )
    assert "excludes 0" in res["headline"]  # seed t's interval [+22.6, +35.4] pts is said beside it
    # identical rows: that is the condition named
    for run in sweep.iterdir():
        if run.is_dir():
            _rewrite_metrics(run, 0.0)
    res = compare([sweep], n_bootstrap=0, make_plots=False, out=tmp_path / "same")
    assert (
        res["verdict"] == "inert" and "identical training rows at every seed pair (3 of 3)" in res["headline"]
    )


def test_gspo_with_no_rule_firing_is_not_inert(tmp_path):
    """GSPO's gradient carries the sequence ratio: no rule firing does not make it GRPO's."""
    rng = np.random.default_rng(4)
    arms = {}
    for s in (0, 1, 2):
        arms["gspo", s], arms["grpo", s] = _with_gap(200, 60, 56 + 2 * s, rng)
    sweep = _sweep(tmp_path, arms)
    zero = {"loss/dppo_masked_frac": 0.0, "loss/grpo_clip_frac": 0.0, "loss/gspo_clip_frac": 0.0}
    for run in sweep.iterdir():
        if run.is_dir():
            _metrics(run, zero, 0.01 * int(run.name))
    res = compare([sweep], treatment="gspo", n_bootstrap=0, make_plots=False)
    assert res["verdict"] == "validated" and not res["activity"]["inert"]
    assert res["activity"]["rule_fractions_count"] is False


# ----------------------------------------------------------------------------- stdout that explains itself
def test_a_two_seed_sweep_with_tied_gaps_explains_itself_on_stdout(tmp_path, capsys):
    sweep = _gap_sweep(tmp_path, [25, 25])
    rc, out, _ = _cli(capsys, sweep)
    first = out.splitlines()[0]
    assert rc == 0 and first.startswith("inconclusive (this training procedure)")
    assert "[+12.50 pts, +12.50 pts]" in first and "Every seed pair gave the same gap (sd 0)" in first


def test_a_sweep_that_cannot_reach_power_half_is_warned(tmp_path, capsys):
    sweep = _gap_sweep(tmp_path, [10, 30])  # gap 10 pts, sd 7.1 pts, 1 df: power about 0.08
    rc, out, _ = _cli(capsys, sweep)
    assert rc == 0 and "below 0.5" in out and "python -m eval.design" in out
    assert "detects a gap as large as this one (10.00 pts" in out
    # the plan's target, when stated, is the effect the note asks about
    planned = _gap_sweep(tmp_path, [10, 30], overrides=("decision.target_effect=0.02",), name="planned")
    rc, out, _ = _cli(capsys, planned)
    assert rc == 0 and "detects decision.target_effect (2.00 pts" in out and "below 0.5" in out


def test_holm_label_bootstrap_floor_and_mcnemar_wording(tmp_path, capsys):
    rng = np.random.default_rng(9)
    arms = {}
    for s in (0,):
        arms["dppo", s], arms["grpo", s] = _with_gap(200, 60, 40, rng)
        arms["cispo", s] = arms["dppo", s].copy()
    sweep = _sweep(tmp_path, arms, overrides=("decision.method=mcnemar_exact",))
    rc, out, _ = _cli(capsys, sweep)
    assert rc == 0 and out.count("Holm-adjusted p = ") == 2
    # the bootstrap's p of 0 is below 1/R
    boot = _gap_sweep(tmp_path, [40], overrides=("decision.method=paired_bootstrap",), name="boot")
    rc = main([str(boot), "--no-plots", "--no-wandb"])
    out = capsys.readouterr().out
    assert rc == 0 and "0.00e+00" not in (boot / "compare.md").read_text()
    assert "< 0.0001 (1/R)" in (boot / "compare.md").read_text()
    # McNemar's `worse` counts items: 30 items only the treatment gets, 70 only the baseline (p < 0.001);
    # 40 against 60 (two-sided p 0.057) is no decision either way
    for only_t, only_b, verdict in ((30, 70, "worse"), (40, 60, "inconclusive")):
        t = np.zeros(200, bool)
        b = np.zeros(200, bool)
        t[:only_t] = True
        b[only_t:only_t + only_b] = True
        mc = _sweep(tmp_path, {("dppo", 0): t, ("grpo", 0): b}, overrides=("decision.method=mcnemar_exact",),
                    name=f"mc{only_t}")
        res = compare([mc], n_bootstrap=0, make_plots=False)
        assert res["verdict"] == verdict
        worse_text = "significantly more items favour the baseline than the treatment (c > b)"
        assert (worse_text in res["headline"]) == (verdict == "worse")


def test_design_exits_non_zero_when_it_prints_a_problem():
    from eval.design import main as design_main

    # a 3-seed plan with the seed sd unstated is a PROBLEM
    assert (
        design_main(["eval.n_examples=50", "seed=0,1,2", "--sims", "20", "--bootstrap", "20", "--plot", ""])
        == 1
    )
    assert design_main(["eval.n_examples=50", "--sims", "20", "--bootstrap", "20", "--plot", ""]) == 0


# ----------------------------------------------------------------------------- effect sizes and registry
def test_effect_sizes_in_compare_json_and_md(tmp_path):
    sweep = _gap_sweep(tmp_path, [8, 12, 0, -4])
    res = compare([sweep], n_bootstrap=0, make_plots=False)
    es = res["effect_sizes"]
    # two wins, one tie (half), one loss; the Wilson interval spans 2 to 3 wins of 4
    assert (
        es["prob_improvement"] == 0.625
        and es["prob_improvement_low"] < 0.5
        and es["prob_improvement_high"] > 0.75
    )
    D = np.array([8, 12, 0, -4]) / N_ITEMS
    assert es["gap_sd"] == pytest.approx(D.std(ddof=1))
    assert es["item_sampling_var"] + es["training_var"] >= es["item_sampling_var"] > 0
    # by hand: seed s has |g_s| items at +-1 and the rest at 0, so var_i(d_si) (ddof 1) is
    # (|g_s| - n m_s^2) / (n - 1) with m_s = g_s / n; the item part is its mean over seeds / n
    g = np.array([8, 12, 0, -4])
    var_S = (np.abs(g) - N_ITEMS * (g / N_ITEMS) ** 2) / (N_ITEMS - 1)
    assert es["item_sampling_var"] == pytest.approx(var_S.mean() / N_ITEMS, rel=1e-12)
    assert es["training_var"] == pytest.approx(max(0.0, D.var(ddof=1) - var_S.mean() / N_ITEMS), rel=1e-12)
    assert res["scope_settings"]["optimizer.lr"] is not None and "schedule.num_steps" in res["scope_settings"]
    # every baseline seed scored 80 of 200, so the unpaired P(X > Y) over the 4 x 4 run pairs equals the
    # paired share here; the training part is reported unfloored beside the floored one
    assert es["prob_improvement_unpaired"] == 0.625
    assert es["training_var_unbiased"] == pytest.approx(D.var(ddof=1) - var_S.mean() / N_ITEMS, rel=1e-12)
    md = (sweep / "compare.md").read_text()
    assert "Paired probability of improvement (paired_prob_improvement" in md and "optimizer.lr" in md
    assert "unpaired, rliable's P(X > Y) over all seed x seed pairs: 0.62" in md
    assert "the unbiased (unfloored) training variance is" in md


def test_paired_and_unpaired_probability_of_improvement_by_hand():
    """Two seed pairs of two items. Treatment runs score 0.5 and 1.0, baseline runs 0.0 and 1.0 (seed 1 tied).
    Paired: seed 0 wins, seed 1 ties: (1 + 0.5) / 2 = 0.75. Unpaired (rliable's P(X > Y) over all 2 x 2 run
    pairs): 0.5 > 0.0, 0.5 < 1.0, 1.0 > 0.0, 1.0 = 1.0 (half): 2.5 / 4 = 0.625."""
    from eval.comparison import effect_sizes, prob_improvement_unpaired

    t_SN = np.array([[1, 0], [1, 1]])
    b_SN = np.array([[0, 0], [1, 1]])
    es = effect_sizes(t_SN, b_SN, 0.05)
    assert es["prob_improvement"] == 0.75 and es["prob_improvement_unpaired"] == 0.625
    # the baseline's seeds swapped change the pairs, not the runs: the 0.5 run now meets 1.0 (a loss) and the
    # 1.0 run meets 0.0 (a win), paired 0.5; the unpaired share stays 0.625
    es2 = effect_sizes(t_SN, b_SN[::-1], 0.05)
    assert es2["prob_improvement"] == 0.5 and es2["prob_improvement_unpaired"] == 0.625
    # unequal run counts (N = 3, M = 2): 6 pairs, 0.2 beats none, 0.5 beats 0.4, 0.9 beats both: 3 / 6
    assert prob_improvement_unpaired(np.array([0.2, 0.5, 0.9]), np.array([0.4, 0.6])) == 0.5


def test_variance_split_unbiased_and_floored_bias():
    """At a true training variance of 4 pts^2 (sd 2 pts) against ~15 pts^2 of item sampling, 3 seeds per arm:
    the unbiased training part's mean over 2,000 sweeps is the truth within 4 Monte Carlo se, while the
    reported `training_var` (floored at 0) is biased up by far more than that (docs/calibration.md)."""
    from eval.calibrate import item_gaps
    from eval.comparison import variance_split

    rng = np.random.default_rng(5)
    tau, n_sweeps = 0.02, 2000
    d = item_gaps(0.0, tau, rng.standard_normal((n_sweeps, 3)), rng).astype(np.float64)
    unbiased = np.array([variance_split(d[i])[2] for i in range(n_sweeps)])
    se = unbiased.std(ddof=1) / math.sqrt(n_sweeps)
    assert abs(unbiased.mean() - tau**2) < 4 * se
    floored = np.maximum(unbiased, 0.0)
    assert floored.mean() - tau**2 > 8 * se and np.mean(unbiased < 0) > 0.3


def test_seed_level_intervals_cover_at_their_level():
    """300 seeded sweeps per row at a true gap of +5 pts (eval.calibrate coverage): seed t's 95% interval
    and the sign-flip set cover within 3 Monte Carlo se of 95% or above; the sign-flip set is the whole line
    at 3 seeds (covers always); the two-level bootstrap is too narrow at 3 seeds, about right by 10."""
    from eval.calibrate import coverage

    n = 300
    tol = 3 * math.sqrt(0.05 * 0.95 / n)
    rows = {(r["seeds_per_arm"], r["noise"]): r for r in coverage(n, 0, seeds=(3, 10), n_bootstrap=100)}
    for (S, _), r in rows.items():
        assert abs(r["seed_t"] - 0.95) < tol, r
        assert r["sign_flip"] > 0.95 - tol, r
        assert S != 3 or r["sign_flip"] == 1.0
    assert rows[10, "normal"]["two_level_bootstrap"] > 0.95 - tol


def _calibration_tables() -> list[tuple[str, int, int, str]]:
    """(table, sweeps, seed, the doc's table) for each `python -m eval.calibrate ... --markdown` command in
    docs/calibration.md, the table being the lines starting with | right after the command's blank line."""
    import re

    lines = (ROOT / "docs" / "calibration.md").read_text().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = re.fullmatch(r"`python -m eval\.calibrate (\w+) --sweeps (\d+) --seed (\d+) --markdown`:", line)
        if m:
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            found.append((m.group(1), int(m.group(2)), int(m.group(3)), "\n".join(lines[i + 2:j])))
    return found


def test_every_calibrate_table_is_in_the_calibration_record():
    from eval.calibrate import TABLES

    found = _calibration_tables()
    assert sorted(t for t, *_ in found) == sorted(TABLES)
    assert all(doc.startswith("| ") for *_, doc in found)


#: the tables that take more than about a second to regenerate (seed_noise: about 13 s idle)
SLOW_TABLES = {"coverage", "seed_noise", "sign_flip", "variance_split"}


@pytest.mark.parametrize("table", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_TABLES else t
                                   for t in sorted(CALIBRATE_TABLES)])
def test_calibration_record_tables_are_current(table):
    """docs/calibration.md's table is what its command prints today: rerun `python -m eval.calibrate <table>
    --sweeps N --seed K --markdown` and paste its output when a rule changes."""
    from eval.calibrate import TABLES, markdown

    (name, sweeps, seed, doc), = [x for x in _calibration_tables() if x[0] == table]
    assert markdown(name, TABLES[name](sweeps, seed)) == doc


def test_the_registry_is_what_the_config_may_name():
    from eval.methods import DECIDING, METHODS
    from trainer.config.enums import DECISION_METHODS

    assert DECIDING == DECISION_METHODS
    assert {m.scope for m in METHODS.values()} == {"fixed_checkpoints", "across_seeds"}


# ----------------------------------------------------------------------------- calibration bounds (quick)
def _se(n: int) -> float:
    return math.sqrt(0.025 * 0.975 / n)


def test_equivalence_holds_alpha_half_at_the_margin():
    """At a true gap equal to the margin, `equivalent` in at most alpha / 2 of sweeps (3 Monte Carlo se)."""
    from eval.calibrate import equivalence

    n = 3000
    for row in equivalence(n, seed=1, seeds=(3, 6)):
        assert row["at_margin"] <= 0.025 + 3 * _se(n), row
    assert row["at_zero"] > row["at_margin"]  # and it says something where the gap is 0


def test_planned_looks_hold_alpha_half_and_unplanned_looks_do_not():
    from eval.calibrate import looks

    n = 4000
    (null,) = looks(n, seed=2, effects=(0.0,))
    assert null["validated_sequential"] <= 0.025 + 3 * _se(n), null
    assert null["validated_every_seed_unplanned"] > 0.05, null  # why looks are planned and counted
    assert sum(null["levels"]) == pytest.approx(0.05)


def test_sign_flip_holds_alpha_half_under_heavy_tailed_seed_noise():
    from eval.calibrate import sign_flip

    n = 3000
    for row in sign_flip(n, seed=3, seeds=(3, 6, 8)):
        assert row["sign_flip_null_normal"] <= 0.025 + 3 * _se(n) and row[
            "sign_flip_null_t3"
        ] <= 0.025 + 3 * _se(n)
        if row["seeds_per_arm"] == 3:
            assert row["sign_flip_power"] == 0.0  # p >= 0.25 whatever the data


# ----------------------------------------------------------------------------- K samples per item
def test_compare_uses_per_item_scores_of_k_samples(tmp_path):
    """eval.samples_per_item K > 1: each record's `score` (fraction correct of K samples) is the item's value
    in every paired method; the greedy `correct` (score >= 0.5) is not what is compared."""
    from test_compare import _records, make_run

    rng = np.random.default_rng(11)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    scores = {}
    for job, (loss, s) in enumerate([("grpo", 0), ("grpo", 1), ("dppo", 0), ("dppo", 1)]):
        k = rng.integers(0, 5, N_ITEMS) if loss == "grpo" else np.minimum(4, rng.integers(0, 5, N_ITEMS) + 1)
        recs = _records(k >= 2)
        for r, x in zip(recs, k):
            r.update(score=float(x) / 4, samples=4, correct=bool(x >= 2))
        scores[loss, s] = k / 4
        make_run(sweep / str(job), loss, s, k >= 2, records=recs)
    res = compare([sweep], n_bootstrap=0, make_plots=False)
    D = [float(np.mean(scores["dppo", s] - scores["grpo", s])) for s in (0, 1)]
    assert res["estimate"] == pytest.approx(np.mean(D)) and res["seed_level"][
        "per_seed_diff"
    ] == pytest.approx(D)
    assert res["arms"][0]["accuracy"] == pytest.approx(float(np.mean(scores["grpo", 0])))
    # Hoeffding on [-1, 1] per-item differences stays valid: its half-width is the same formula
    assert res["hoeffding_half_width"] == pytest.approx(math.sqrt(2 * math.log(40) / N_ITEMS))


def test_k_sample_scores_are_validated_in_records(tmp_path):
    from test_compare import _records

    from eval.records import RecordError, read_item_records, write_item_records

    recs = _records(np.array([True, False]))
    recs[0].update(score=float("nan"), samples=4)
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(RecordError, match="'score' must be a number in \\[0, 1\\]"):
        read_item_records(path)
    recs[0]["score"] = 0.75
    assert read_item_records(write_item_records(path, recs))[0]["score"] == 0.75


@pytest.mark.slow
def test_training_with_k_samples_per_item_writes_scores(tmp_path):
    from runs import TINY, run_train

    run = tmp_path / "run"
    p = run_train(
        [*TINY, "eval.samples_per_item=4", "eval.temperature=1.0", f"hydra.run.dir={run}"], tmp_path
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "eval" / "gsm8k_test.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["samples"] == 4 and r["score"] in (0, 0.25, 0.5, 0.75, 1.0) for r in rows)
    assert all(r["correct"] == (r["score"] >= 0.5) for r in rows)


def test_compare_runs_decides_on_runs_held_in_memory(tmp_path):
    """eval.comparison.compare_runs on Run objects with their records set and no run folders behind them
    (per-item files of another harness, read elsewhere): the same verdict as the folders give."""

    from eval.compare import CompareRequest, Run, compare_runs

    sweep = _gap_sweep(tmp_path, [8, 12, 16])
    on_disk = compare([sweep], n_bootstrap=0, make_plots=False)
    runs = []
    for p in sorted(q for q in sweep.iterdir() if q.is_dir()):
        cfg = yaml.safe_load((p / "config.yaml").read_text())
        recs = [json.loads(x) for x in (p / "eval" / "arithmetic.jsonl").read_text().splitlines()]
        runs.append(Run(path=tmp_path / "nowhere" / p.name, config=cfg, info={}, loss=cfg["loss"]["name"],
                        seed=cfg["seed"], eval_name="arithmetic", records=recs))
    out = tmp_path / "out"
    res = compare_runs(runs, out, CompareRequest(n_bootstrap=0, make_plots=False)).to_json()
    assert res["verdict"] == on_disk["verdict"] and res["estimate"] == pytest.approx(on_disk["estimate"])
    assert (out / "compare.json").is_file() and res["looks"] == [] and not (tmp_path / "nowhere").exists()


def test_decisions_recorded_at_once_are_all_kept(tmp_path):
    """Compares deciding at once (a script's parallel jobs, the ladder's levels) each add their decision to
    the same run folder's looks.json and the same ledger: none may overwrite another's."""
    import threading

    from eval.sequential import RUN_RECORD, read_ledger, record_in_run, record_look

    run, ledger = tmp_path / "run", tmp_path / ".pairedrl" / "looks" / "k.json"
    run.mkdir()
    entries = [{"key": f"k{i % 3}", "n_seeds": 3, "seeds": [i, i + 100, i + 200]} for i in range(24)]
    start = threading.Barrier(len(entries))

    def decide(e):
        start.wait()
        record_in_run(run, e)
        record_look(ledger, {**e, "key": "k"}, {"experiment": "x"})

    threads = [threading.Thread(target=decide, args=(e,)) for e in entries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    kept = json.loads((run / RUN_RECORD).read_text())["decisions"]
    assert sorted(x["seeds"][0] for x in kept) == list(range(24))
    assert sorted(x["seeds"][0] for x in read_ledger(ledger)) == list(range(24))
