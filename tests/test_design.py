"""eval.design: simulated power against closed forms and independently computed values; the CLI (--json,
PNG, bad input, --from a pilot sweep); the design preflight gate."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist
from types import SimpleNamespace

import numpy as np
import pytest
from test_compare import EVAL, make_run

from eval.design import (
    METHODS,
    DesignError,
    Plan,
    Simulator,
    design,
    mde_closed_form,
    pilot_estimates,
    power_closed_form,
    render,
    seed_t_power,
)
from eval.stats import mcnemar_exact_p

ROOT = Path(__file__).resolve().parents[1]
PHI = NormalDist().cdf


def _exact_mcnemar_power(n: int, P: float, delta: float, alpha: float) -> float:
    """Independent reference: sum over D ~ Bin(n, P) discordant items and b | D ~ Bin(D, (1 + delta/P) / 2)
    of the exact test's decision (b > c and p(b, c) < alpha)."""
    q = (1 + delta / P) / 2
    total = 0.0
    for D in range(n + 1):
        pD = math.comb(n, D) * P ** D * (1 - P) ** (n - D)
        if pD < 1e-14:
            continue
        for b in range(D // 2 + 1, D + 1):
            if mcnemar_exact_p(b, D - b) < alpha:
                total += pD * math.comb(D, b) * q ** b * (1 - q) ** (D - b)
    return total


def test_item_level_simulated_power_matches_closed_forms():
    plan = Plan(n_items=200, n_seeds=1, discordance=0.3)
    sim = Simulator(plan, n_sims=3000, n_bootstrap=300, seed=1)
    for delta in (0.0, 0.06, 0.1, 0.15, 0.2):
        got = {k: float(v.mean()) for k, v in sim.decisions(delta).items()}
        assert got["paired_hoeffding"] == pytest.approx(power_closed_form("paired_hoeffding", plan, delta), abs=0.035)
        assert got["paired_bootstrap"] == pytest.approx(power_closed_form("paired_bootstrap", plan, delta), abs=0.05)
        exact = _exact_mcnemar_power(200, 0.3, delta, 0.05)
        assert got["mcnemar_exact"] == pytest.approx(exact, abs=0.03)
        # Connor's normal approximation is close to the exact power too
        assert power_closed_form("mcnemar_exact", plan, delta) == pytest.approx(exact, abs=0.06)
    # the Hoeffding MDE in closed form: delta = h + z_0.8 sqrt((P - delta^2) / n)
    h = math.sqrt(2 * math.log(40) / 200)
    mde = mde_closed_form("paired_hoeffding", plan)
    assert mde == pytest.approx(h + NormalDist().inv_cdf(0.8) * math.sqrt((0.3 - mde ** 2) / 200), abs=1e-9)


def test_seed_t_power_matches_an_independent_simulation():
    """The quadrature of the noncentral t tail against a plain Monte Carlo of S normal per-seed gaps."""
    rng = np.random.default_rng(0)
    S, sd, alpha = 4, 0.05, 0.05
    t_crit = 3.182446305284263  # t_{0.975, 3}
    for shift in (0.0, 0.05, 0.1):
        D = shift + sd * rng.standard_normal((200000, S))
        mc = float(np.mean(D.mean(axis=1) - t_crit * D.std(axis=1, ddof=1) / math.sqrt(S) > 0))
        assert seed_t_power(shift, sd, S, alpha) == pytest.approx(mc, abs=0.006)
    # and the design's simulated sweeps (seed noise tau plus item noise) against it
    plan = Plan(n_items=300, n_seeds=4, discordance=0.3, seed_sd=0.05)
    sim = Simulator(plan, n_sims=3000, n_bootstrap=20, seed=2)
    for delta in (0.0, 0.08, 0.15):
        got = float(sim.decisions(delta, ("seed_t",))["seed_t"].mean())
        assert got == pytest.approx(power_closed_form("seed_t", plan, delta), abs=0.035)


def test_between_seed_noise_makes_item_level_tests_fire_and_seed_t_does_not():
    """The A/A case: no effect of the loss, large training noise (A/A sd 6 pts). Item-level tests, which are
    about the fixed checkpoints, 'detect' the seeds' differences; the t over seeds holds alpha / 2."""
    plan = Plan(n_items=500, n_seeds=3, discordance=0.3, seed_sd=0.06)
    fp = {k: float(v.mean()) for k, v in Simulator(plan, n_sims=2000, n_bootstrap=200, seed=3).decisions(0.0).items()}
    assert fp["mcnemar_exact"] > 0.25 and fp["paired_bootstrap"] > 0.25
    assert fp["seed_t"] == pytest.approx(0.025, abs=0.012)
    # tau from the A/A sd: 2 sd^2 = tau^2 + P / n
    assert plan.tau == pytest.approx(math.sqrt(2 * 0.06 ** 2 - 0.3 / 500))


def test_design_mde_simulated_agrees_with_closed_form_and_target_answers():
    plan = Plan(n_items=400, n_seeds=1, discordance=0.25, target_effect=0.05)
    res = design(plan, n_sims=800, n_bootstrap=200, grid=31)
    for k in ("paired_hoeffding", "mcnemar_exact", "paired_bootstrap"):
        assert res["mde"][k] == pytest.approx(res["mde_closed_form"][k], abs=0.012), k
    assert res["mde"]["seed_t"] is None and res["notes"]
    assert res["detectable"] is False  # Hoeffding needs ~ +11 pts at 400 items
    n_need = res["items_needed"]["paired_hoeffding"]
    assert mde_closed_form("paired_hoeffding", plan, n=n_need) <= 0.05 < mde_closed_form("paired_hoeffding", plan,
                                                                                       n=n_need - 1)
    assert res["power_at_target"]["paired_hoeffding"] < 0.2
    with pytest.raises(DesignError, match="--discordance must be in"):
        Plan(n_items=10, n_seeds=1, discordance=1.5)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "eval.design", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, check=False, timeout=300)


def test_cli_json_png_and_bad_input(tmp_path, monkeypatch, capsys):
    proc = _cli("eval.n_examples=150", "seed=0,1", "--discordance", "0.2", "--seed-sd", "0.02", "--sims", "300",
                "--bootstrap", "50", "--json", "--plot", str(tmp_path / "p.png"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["n_items"], out["n_seeds"], out["alpha"], out["power"]) == (150, 2, 0.05, 0.8)
    assert set(out["mde"]) == set(METHODS) and 0 < out["mde"]["mcnemar_exact"] < 0.2
    # the Hoeffding half-width at 150 items (22.2 pts) exceeds the discordance (20 pts), the largest gap two
    # arms that disagree on 20% of the items can show: no effect is detectable
    assert math.sqrt(2 * math.log(40) / 150) > 0.2 and out["mde"]["paired_hoeffding"] is None
    assert out["assumptions"]["discordance"] == "--discordance"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    # the refusals through the same `main` in this process (the real process above ran the CLI end to end;
    # each further one spent seconds importing before it refused)
    monkeypatch.chdir(tmp_path)
    for bad in ("0", "1.5", "-0.1"):
        proc = _in_process(capsys, "--discordance", bad, "--json", "--plot", str(tmp_path / "q.png"))
        assert proc.returncode == 2 and "--discordance must be in (0, 1]" in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "q.png").exists()
    proc = _in_process(capsys, "decision.method=bogus", "--json")
    assert proc.returncode == 2 and "decision.method must be one of" in proc.stderr


def _in_process(capsys, *args: str) -> SimpleNamespace:
    """`python -m eval.design *args` run by its `main` in this process: (returncode, stdout, stderr)."""
    from eval.design import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_from_an_aa_sweep_estimates_discordance_and_seed_sd(tmp_path):
    rng = np.random.default_rng(4)
    sweep = tmp_path / "aa"
    sweep.mkdir()
    c = {s: rng.random(200) < p for s, p in ((0, 0.3), (1, 0.4), (2, 0.35))}
    for s, correct in c.items():
        make_run(sweep / str(s), "grpo", s, correct)
    est = pilot_estimates(sweep)
    assert est["seed_sd"] == pytest.approx(np.std([c[s].mean() for s in c], ddof=1))
    pairs = [(0, 1), (0, 2), (1, 2)]
    assert est["discordance"] == pytest.approx(np.mean([np.mean(c[a] != c[b]) for a, b in pairs]))
    one = pilot_estimates(sweep / "0")
    p = c[0].mean()
    assert one["discordance"] == pytest.approx(2 * p * (1 - p)) and one["seed_sd"] is None
    assert (sweep / "0" / "eval" / f"{EVAL}.jsonl").is_file()
    # the power curve lands beside the sweep it was estimated from, not in the working directory
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = _cli("eval.n_examples=200", "seed=0,1,2", "--from", str(sweep), "--sims", "20", "--bootstrap", "20",
                cwd=cwd)
    assert proc.returncode == (1 if "PROBLEM:" in proc.stdout else 0), proc.stderr  # 20 sims: noisy rates
    assert (sweep / "design_power.png").read_bytes()[:4] == b"\x89PNG" and not list(cwd.iterdir())


def test_design_gate_fails_only_when_the_decision_method_misses_the_target(tmp_path):
    from trainer.config.compose import run_config
    from trainer.preflight.gates import GATES
    from trainer.preflight.gates import design as design_gate

    assert GATES[:2] == ("correctness", "design")  # before the pilot: a plan that cannot answer stops early
    base = ["eval.n_examples=300", "decision.discordance=0.3"]
    rep = design_gate(run_config(base), tmp_path, n_seeds=1, n_sims=100)
    assert rep.passed and rep.meta["design"]["mde"]["paired_hoeffding"] > 0.1
    miss = design_gate(run_config(base + ["decision.target_effect=0.05"]), tmp_path, n_sims=100)
    assert not miss.passed and miss.checks[-1].status == "fail"
    easy = design_gate(run_config(base + ["decision.target_effect=0.2"]), tmp_path, n_sims=100)
    assert easy.passed and easy.checks[-1].status == "pass"
    assert (tmp_path / "preflight" / "design_power.png").is_file()


def test_the_decision_rule_is_part_of_the_plan_hash_not_of_the_resume_hash():
    from trainer.checkpoint import config_hash
    from trainer.config.compose import run_config
    from trainer.preflight.gates import plan_hash
    from trainer.run_info import resolved_config_dict

    a, b = run_config([]), run_config(["decision.method=seed_t"])
    assert plan_hash(a) != plan_hash(b)  # gates passed under one rule do not serve a sweep under another
    assert plan_hash(a) == plan_hash(run_config(["seed=3"]))
    ra, rb = (config_hash(resolved_config_dict(c)) for c in (a, b))
    assert ra == rb  # a run resumes whatever rule its verdict will be read with


def test_design_gate_fails_a_plan_whose_rule_validates_seed_noise(tmp_path):
    """3 seeds per arm, the item bootstrap deciding, seed sd 5 pts, target +6 pts: the bootstrap's MDE is below
    the target, so "MDE <= target" alone passed it, but at zero effect it validates about 31% of sweeps (the
    item-level interval counts no training noise). The gate fails it; with decision.design_problems=warn it
    passes with the problem stated; auto (seed_t over the 3 seeds) holds alpha and passes the same check."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import design as design_gate

    base = ["eval.n_examples=1319", "decision.discordance=0.3", "decision.seed_sd=0.05", "decision.target_effect=0.06"]
    rep = design_gate(run_config(base + ["decision.method=paired_bootstrap"]), tmp_path, n_seeds=3, n_sims=200)
    fp = rep.meta["design"]["false_positive_rate"]["paired_bootstrap"]
    assert 0.2 < fp < 0.45 and rep.meta["design"]["mde"]["paired_bootstrap"] < 0.06
    assert not rep.passed
    bad = [c for c in rep.checks if c.status == "fail"]
    assert any(c.name == "decision rule calibrated for the plan" and "validates" in c.detail and "above alpha" in c.detail
               for c in bad)
    warn = design_gate(run_config(base + ["decision.method=paired_bootstrap", "decision.design_problems=warn"]),
                       tmp_path, n_seeds=3, n_sims=200)
    assert any(c.detail.startswith("WARNING (not enforced)") for c in warn.checks)
    assert all(c.name != "decision rule calibrated for the plan" or c.status == "pass" for c in warn.checks)
    auto = design_gate(run_config(base), tmp_path, n_seeds=3, n_sims=200)
    assert auto.meta["design"]["decision_method"] == "seed_t"
    assert auto.meta["design"]["false_positive_rate"]["seed_t"] <= 0.05
    assert auto.meta["design"]["problems"] == []
    assert "auto -> seed_t (3 seeds per arm)" in auto.meta["design"]["assumptions"]["method"]


def test_design_problems_scope_unstated_seed_sd_and_clipping():
    from eval.design import clipped_share, plan_problems

    # an item-level method for a target stated as a gain of the training procedure
    p = Plan(n_items=500, n_seeds=1, method="paired_hoeffding", target_effect=0.1, target_scope="procedure")
    assert any("target_scope = procedure" in x for x in plan_problems(p, 0.0)[0])
    assert plan_problems(Plan(n_items=500, n_seeds=3, method="seed_t", target_scope="procedure", seed_sd=0.05,
                              sources={"seed_sd": "decision.seed_sd"}), 0.02) == ([], [])
    # the seed sd left at the default 0 on a 3-seed plan
    p = Plan(n_items=500, n_seeds=3, method="seed_t", sources={"seed_sd": "assumed 0 (no training noise ...)"})
    assert any(x.startswith("seed sd not stated for a 3-seed plan") for x in plan_problems(p, 0.0)[0])
    # discordance 0.15 and seed sd 0.10 (tau 0.141): 2 (1 - Phi(0.15 / 0.141)) = 29% of seed gaps clipped
    p = Plan(n_items=1319, n_seeds=3, discordance=0.15, seed_sd=0.10, method="seed_t")
    tau = math.sqrt(2 * 0.01 - 0.15 / 1319)
    assert clipped_share(p) == pytest.approx(2 * (1 - NormalDist().cdf(0.15 / tau)), rel=1e-12)
    assert 0.27 < clipped_share(p) < 0.31
    problems, warnings = plan_problems(p, 0.03)
    assert problems == [] and len(warnings) == 1 and "force clipping: 28" in warnings[0]
    assert plan_problems(Plan(n_items=1319, n_seeds=3, discordance=0.3, seed_sd=0.05, method="seed_t"), 0.03) == ([], [])


def test_a_plan_resolves_auto_by_its_seeds():
    assert Plan(n_items=100, n_seeds=3, method="auto").method == "seed_t"
    # one run per arm: the simulated scores are right / wrong, so `auto` is exact McNemar (as compare reads
    # it), and paired Hoeffding with a margin the exact test cannot shift
    one = Plan(n_items=100, n_seeds=1, method="auto")
    assert one.method == "mcnemar_exact" and "auto -> mcnemar_exact" in one.sources["method"]
    shifted = Plan(n_items=100, n_seeds=1, method="auto", margin=0.02)
    assert shifted.method == "paired_hoeffding" and "auto -> paired_hoeffding" in shifted.sources["method"]
    with pytest.raises(DesignError, match="decision method must be one of"):
        Plan(n_items=100, n_seeds=1, method="wilcoxon")


def _first_answer_plan(**kw) -> Plan:
    """The first real answer's plan: 200 items, 8 seeds per arm, A/A seed sd 8.22 pts, discordance 0.276,
    seed t, target +15 pts."""
    kw = {"n_items": 200, "n_seeds": 8, "method": "seed_t", "seed_sd": 0.0822, "discordance": 0.276,
          "power": 0.8, "target_effect": 0.15, **kw}
    return Plan(**kw)


def test_design_simulates_the_plan_s_looks():
    """decision.looks [4, 8]: the sweep decides at 0.0056 on 4 seeds, then at 0.0444 on 8, so its power is
    below the fixed 8-seed design's (the audit: 0.90 reported, 0.86 with the looks); one look at 8 seeds is
    the fixed design, sweep for sweep."""
    fixed = design(_first_answer_plan(), n_sims=400, grid=5)
    seq = design(_first_answer_plan(looks=[4, 8]), n_sims=400, grid=5)
    assert "looks" not in fixed and seq["looks"]["looks"] == [4, 8]
    assert seq["looks"]["power_at_target"] < fixed["power_at_target"]["seed_t"]
    assert 4 < seq["looks"]["expected_seeds_at_target"] < 8
    one = design(_first_answer_plan(looks=[8]), n_sims=400, grid=5)
    assert one["looks"]["power_at_target"] == fixed["power_at_target"]["seed_t"]
    assert "with decision.looks [4, 8]" in render(seq)
    # a plan whose power with the looks misses decision.power is not `detectable`, though its fixed MDE is
    # (these 400 seeded sweeps: fixed power 0.8925 and MDE 14.8 pts at power 0.884, 0.8825 with the looks)
    strict = design(_first_answer_plan(looks=[4, 8], power=0.884), n_sims=400, grid=31)
    assert strict["mde"]["seed_t"] <= 0.15 and strict["looks"]["power_at_target"] < 0.884
    assert not strict["detectable"]


def test_design_reports_power_at_the_pilot_s_spread_and_warns_when_the_aa_understates_it():
    """The first answer's A/A said 8.22 pts; its 8 seed pairs' gaps had an sd of 14 pts (a seed sd of 9.9
    pts): power at +15 pts with the looks falls (the audit: 0.86 -> 0.72), and the design says so."""
    plan = _first_answer_plan(looks=[4, 8], spreads={"stated (decision.seed_sd)": 0.0822,
                                                     "pilot's observed (A/B sweep x)": 0.14 / math.sqrt(2)})
    res = design(plan, n_sims=400, grid=5)
    stated, pilot = res["power_by_spread"]
    assert stated["seed_sd"] == 0.0822 and pilot["seed_sd"] == pytest.approx(0.099, abs=1e-3)
    assert pilot["power_with_looks"] < stated["power_with_looks"]
    assert pilot["power_one_look"] < stated["power_one_look"]
    (warning,) = [w for w in res["warnings"] if "understates" in w]
    assert "stated seed sd 0.0822 (stated (decision.seed_sd)) understates the pilot's observed" in warning
    assert f"from {stated['power_with_looks']:.2f} to {pilot['power_with_looks']:.2f}" in warning
    assert "at seed sd 0.0990 (pilot's observed (A/B sweep x))" in render(res)
    # a pilot whose spread is smaller says nothing
    calm = _first_answer_plan(spreads={"stated (decision.seed_sd)": 0.0822, "pilot's observed (p)": 0.05})
    assert not [w for w in design(calm, n_sims=200, grid=5)["warnings"] if "understates" in w]


def test_plan_from_config_reads_the_looks_and_the_pilot_s_spread(tmp_path):
    from eval.design import plan_from_config
    from trainer.config.compose import run_config

    rng = np.random.default_rng(8)
    sweep = tmp_path / "ab"
    sweep.mkdir()
    for job, (loss, s) in enumerate((("dppo", 0), ("dppo", 1), ("grpo", 0), ("grpo", 1))):
        make_run(sweep / str(job), loss, s, rng.random(200) < (0.3 + 0.2 * s if loss == "dppo" else 0.4))
    cfg = run_config(["eval.n_examples=200", "decision.looks=[2,4]", "decision.seed_sd=0.01",
                      "decision.target_effect=0.1"])
    plan = plan_from_config(cfg, 4, pilot=sweep)
    assert plan.looks == [2, 4] and plan.spreads["stated (decision.seed_sd)"] == 0.01
    (pilot,) = [v for k, v in plan.spreads.items() if k.startswith("pilot's observed (A/B sweep")]
    assert pilot == pytest.approx(pilot_estimates(sweep)["seed_sd"])
