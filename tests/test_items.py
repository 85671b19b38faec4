"""eval.compare --items and eval.design --from on per-item files written by other frameworks.

The sample files in tests/data/items/ (make_samples.py there writes them): lm_eval/ was written by
lm-evaluation-harness 0.4.13 itself (its dummy model, `--log_samples`), tinker_cookbook/ by tinker-cookbook
0.5.8's own EvalStore; prime_rl/ and verl/ were built field for field from prime-rl v0.6.0's `save_rollouts`
and verl v0.9.0's `_write_generations` (neither installs offline); plain.jsonl / plain.csv are this
project's plain format.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_compare import EVAL
from test_verdict import _sweep, _with_gap

from eval.compare import compare, compare_items, main
from eval.item_formats import ItemsError, read_items
from eval.stats import holm_adjust

DATA = Path(__file__).resolve().parent / "data" / "items"
LM = DATA / "lm_eval"
COOK = DATA / "tinker_cookbook"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _acc(arm: str, seed: int) -> list[float]:
    """Every task's `acc` values of one lm-eval run folder, in task order."""
    return [r["acc"] for p in sorted((LM / f"{arm}_seed{seed}").glob("*.jsonl")) for r in _lines(p)]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- one test per adapter
def test_lm_eval_log_samples_a_task_file_and_a_run_folder():
    run = LM / "a_seed0"
    add = next(run.glob("samples_arith_add_*.jsonl"))
    (f,) = read_items(add)
    raw = _lines(add)
    assert f.format == "lm_eval" and f.metric == "acc,none" and f.eval_name == "arith_add"
    assert f.ids == [str(r["doc_id"]) for r in raw] and f.categories is None
    assert f.scores_N.tolist() == [r["acc"] for r in raw]
    (norm,) = read_items(add, metric="acc_norm")
    assert norm.metric == "acc_norm,none" and norm.scores_N.tolist() == [r["acc_norm"] for r in raw]
    # one run's output folder: every task's file, the task as the items' category and id prefix
    (folder,) = read_items(run)
    mul = _lines(next(run.glob("samples_arith_mul_*.jsonl")))
    assert folder.ids == [f"arith_add/{r['doc_id']}" for r in raw] + [f"arith_mul/{r['doc_id']}" for r in mul]
    assert folder.categories == ["arith_add"] * len(raw) + ["arith_mul"] * len(mul)
    assert folder.scores_N.tolist() == [r["acc"] for r in raw + mul]
    with pytest.raises(ItemsError, match=r"no filter 'strict-match' \(the file has \['none'\]\)"):
        read_items(add, metric="acc,strict-match")


def test_lm_eval_runs_compared_with_per_task_secondaries(tmp_path, capsys):
    arm = {a: ",".join(str(LM / f"{a}_seed{s}") for s in (0, 1)) for a in ("a", "b")}
    rc, out, err = _run(capsys, "--items", f"a={arm['a']}", f"b={arm['b']}", "--out", str(tmp_path), "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["format"] == "lm_eval" and res["n_items"] == 16 and res["seeds"] == [0, 1]
    assert res["decision"]["method"] == "seed_t" and res["verdict_scope"] == "across_seeds"
    # the per-seed gaps from the files themselves: each seed's accuracy difference over both tasks
    acc = {(a, s): np.mean(_acc(a, s)) for a in "ab" for s in (0, 1)}
    gaps = [acc["b", s] - acc["a", s] for s in (0, 1)]
    assert res["seed_level"]["per_seed_diff"] == pytest.approx(gaps)
    cats = res["categories"]
    assert cats["names"] == ["arith_add", "arith_mul"] and cats["family_size"] == 2
    assert [r["n_items"] for r in cats["rows"]] == [8, 8]
    assert json.loads((tmp_path / "compare.json").read_text())["categories"] == cats
    md = (tmp_path / "compare.md").read_text()
    assert "## Per category (secondary" in md and "arith_mul" in md


def test_tinker_cookbook_eval_store_matches_the_librarys_own_reader():
    from tinker_cookbook.stores.eval_store import EvalStore

    for arm in ("a", "b"):
        (f,) = read_items(COOK / arm / "runs" / f"arm_{arm}")
        trajs = EvalStore(COOK / arm).read_trajectories(f"arm_{arm}", "gsm8k")
        assert f.format == "tinker_cookbook" and f.metric == "reward>0" and f.repeats == 1
        assert f.ids == [t.example_id for t in trajs]
        # the runner's own accuracy: reward > 0 (BenchmarkBuilder.aggregate)
        assert f.scores_N.tolist() == [1.0 if t.reward > 0 else 0.0 for t in trajs]
        (c,) = read_items(COOK / arm / "runs" / f"arm_{arm}" / "gsm8k" / "trajectories.jsonl",
                          metric="correct")
        assert c.scores_N.tolist() == [t.metrics["correct"] for t in trajs]


def test_prime_rl_eval_rollouts_average_each_examples_group():
    path = DATA / "prime_rl" / "a" / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl"
    (f,) = read_items(path)
    groups = defaultdict(list)
    for r in _lines(path):
        groups[str(r["example_id"])].append(r["reward"])
    assert f.format == "prime_rl" and f.repeats == 2 and f.eval_name == "gsm8k"
    assert f.ids == list(groups) and f.scores_N.tolist() == [np.mean(v) for v in groups.values()]
    assert any("2 samples per item" in n for n in f.notes)
    (m,) = read_items(path.parent, metric="correct_answer")  # the step folder, a metric of `metrics`
    assert m.scores_N.tolist() == f.scores_N.tolist()


def test_verl_validation_dump_items_are_matched_by_prompt_hash():
    path = DATA / "verl" / "b" / "40.jsonl"
    (f,) = read_items(path)
    raw = _lines(path)
    assert f.format == "verl" and f.metric == "score"
    assert f.ids == [hashlib.sha256(r["input"].encode()).hexdigest() for r in raw]
    assert f.scores_N.tolist() == [r["score"] for r in raw]
    (acc,) = read_items(path, metric="acc")
    assert acc.scores_N.tolist() == [float(r["acc"]) for r in raw]


def test_plain_jsonl_and_csv_hold_seeds_and_categories():
    j, c = read_items(DATA / "plain.jsonl"), read_items(DATA / "plain.csv")
    assert [f.seed for f in j] == [0, 1] and [f.format for f in c] == ["csv", "csv"]
    raw = _lines(DATA / "plain.jsonl")
    for fj, fc, s in zip(j, c, (0, 1)):
        rows = [r for r in raw if r["seed"] == s]
        assert fj.ids == fc.ids == [r["item_id"] for r in rows]
        assert fj.scores_N.tolist() == fc.scores_N.tolist() == [float(r["correct"]) for r in rows]
        assert fj.categories == fc.categories == [r["category"] for r in rows]


# ----------------------------------------------------------------------------- refused: one line, exit 2
def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    verl_a, verl_b = DATA / "verl" / "a" / "40.jsonl", DATA / "verl" / "b" / "40.jsonl"
    short = tmp / "short.jsonl"
    short.write_text("".join(verl_b.read_text().splitlines(keepends=True)[:-1]))
    dup = tmp / "dup.jsonl"
    dup.write_text('{"item_id": "q1", "correct": true}\n{"item_id": "q2", "correct": false}\n'
                   '{"item_id": "q1", "correct": false}\n')
    other = tmp / "other.jsonl"
    other.write_text('{"item_id": "q1", "correct": true}\n{"item_id": "q2", "correct": true}\n')
    empty = tmp / "empty.jsonl"
    empty.write_text("\n")
    add = next((LM / "a_seed0").glob("samples_arith_add_*.jsonl"))
    add_b = next((LM / "b_seed0").glob("samples_arith_add_*.jsonl"))
    return {
        "mismatched items": ([f"A={verl_a}", f"B={short}"],
                             r"item sets differ: .* has 6 items, B .* has 5; 1 only in the first"),
        "duplicated id": ([f"A={other}", f"B={dup}"],
                          r"dup\.jsonl:3: duplicate item id 'q1' \(first on line 1\); 1 line\(s\) repeat an id"),
        "missing metric": ([f"A={add}", f"B={add_b}", "--metric", "f1"], (r"no metric 'f1' \(this sample has "
                                                                          r"\['acc', 'acc_norm'\]\)")),
        "empty file": ([f"A={other}", f"B={empty}"], r"empty\.jsonl: no items \(an empty file\)"),
        "empty file, format named": ([f"A={verl_a}", f"B={empty}", "--format", "verl"],
                                     r"empty\.jsonl: no items \(an empty file"),
    }


@pytest.mark.parametrize("case", ["mismatched items", "duplicated id", "missing metric", "empty file",
                                  "empty file, format named"])
def test_bad_item_files_give_one_line_and_exit_2(tmp_path, capsys, case):
    argv, pattern = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    rc, _, err = _run(capsys, "--items", *argv, "--out", str(out))
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("eval.compare: error: ")
    assert re.search(pattern, err), err
    assert not out.exists()  # refused before anything is written


# ----------------------------------------------------------------------------- the same verdict as a sweep
def _export_plain(sweep: Path, dest: Path) -> dict[str, Path]:
    """Each arm's eval records as one plain JSONL file (item_id, seed, correct)."""
    files: dict[str, list[str]] = defaultdict(list)
    for run in sorted(p for p in sweep.iterdir() if p.is_dir()):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        for rec in _lines(run / "eval" / f"{EVAL}.jsonl"):
            files[cfg["loss"]["name"]].append(json.dumps({"item_id": rec["index"], "seed": cfg["seed"],
                                                          "correct": rec["correct"]}))
    dest.mkdir()
    out = {}
    for arm, lines in files.items():
        out[arm] = dest / f"{arm}.jsonl"
        out[arm].write_text("\n".join(lines) + "\n")
    return out


def test_a_sweep_converted_to_plain_jsonl_gets_the_sweeps_verdict(tmp_path):
    rng = np.random.default_rng(5)
    arms = {}
    for s, (g1, g2) in enumerate(((40, 25), (28, -5), (35, 20))):
        arms["dppo", s], arms["grpo", s] = _with_gap(300, 120, g1, rng)
        arms["cispo", s] = arms["grpo", s].copy()
        arms["cispo", s][np.flatnonzero(~arms["grpo", s])[:max(g2, 0)]] = True
    sweep = _sweep(tmp_path, arms)
    want = compare([sweep], n_bootstrap=500, make_plots=False, out=tmp_path / "sweep_out")
    files = _export_plain(sweep, tmp_path / "plain")
    plan = tmp_path / "plan.yaml"
    decision = yaml.safe_load((sweep / "0" / "config.yaml").read_text())["decision"]
    plan.write_text(yaml.safe_dump({"decision": decision}))
    got = compare_items([f"{a}={p}" for a, p in sorted(files.items())], plan=str(plan), n_bootstrap=500,
                        out=tmp_path / "items_out")
    assert want["mode"] == got["mode"] == "ab" and want["baseline"] == got["baseline"] == "grpo"
    assert got["treatments"] == want["treatments"] == ["cispo", "dppo"]
    assert got["decision"]["method"] == want["decision"]["method"] == "seed_t"
    assert got["verdicts"] == want["verdicts"]
    for g, w in zip(got["comparisons"], want["comparisons"]):
        assert g["methods"] == w["methods"] and g["per_seed"] == w["per_seed"]
        assert g["seed_level"] == w["seed_level"] and g["p_holm"] == w["p_holm"]
    assert {v["verdict"] for v in got["verdicts"]} == {"validated", "inconclusive"}  # Holm decided both ways


# ----------------------------------------------------------------------------- categories, plan, design
def _category_files(tmp: Path) -> list[str]:
    """Two arms, one seed, 3 categories of 200 items: the treatment gains 20 pts on `algebra` only."""
    rng = np.random.default_rng(2)
    specs = []
    rows = {"base": [], "treat": []}
    for c, gain in (("algebra", 40), ("geometry", 0), ("logic", 0)):
        t, b = _with_gap(200, 80, gain, rng)
        for i in range(200):
            rows["base"].append({"item_id": f"{c}-{i}", "correct": bool(b[i]), "category": c})
            rows["treat"].append({"item_id": f"{c}-{i}", "correct": bool(t[i]), "category": c})
    for arm, lines in rows.items():
        p = tmp / f"{arm}.jsonl"
        p.write_text("".join(json.dumps(x) + "\n" for x in lines))
        specs.append(f"{arm}={p}")
    return specs


def test_categories_are_secondary_results_under_holm(tmp_path):
    res = compare_items(_category_files(tmp_path), method="paired_hoeffding", out=tmp_path)
    assert res["baseline"] == "base" and res["decision"]["method"] == "paired_hoeffding"
    cats = res["categories"]
    assert cats["names"] == ["algebra", "geometry", "logic"] and cats["family_size"] == 3
    rows = {r["category"]: r for r in cats["rows"]}
    assert rows["algebra"]["diff"] == pytest.approx(0.2) and rows["geometry"]["diff"] == 0.0
    # the rule's p on 200 items (Hoeffding: 2 exp(-n d^2 / 2)), then Holm over the family
    p = [rows[c]["p_rule"] for c in cats["names"]]
    assert rows["algebra"]["p_rule"] == pytest.approx(2 * math.exp(-200 * 0.2 ** 2 / 2))
    assert [rows[c]["p_holm"] for c in cats["names"]] == pytest.approx(holm_adjust(p))
    assert rows["algebra"]["holm_level"] == pytest.approx(0.05 / 3)
    # below alpha on its own (p = 2 e^-4 = 0.037), not at Holm's alpha / 3 for the best of three categories
    assert rows["algebra"]["p_rule"] < 0.05 and rows["algebra"]["verdict"] == "inconclusive"
    assert rows["logic"]["verdict"] == "inconclusive"
    # the verdict itself is over all 600 items
    assert res["n_items"] == 600 and res["diff"] == pytest.approx(40 / 600)


def test_decision_plan_yaml_is_the_pre_registered_rule(tmp_path, capsys):
    specs = _category_files(tmp_path)
    plan = tmp_path / "plan.yaml"
    plan.write_text("method: mcnemar_exact\nalpha: 0.01\nbaseline: base\ntarget_effect: 0.05\n")
    res = compare_items(specs, plan=str(plan), out=tmp_path / "a")
    assert res["decision"]["method"] == "mcnemar_exact" and res["decision"]["alpha"] == 0.01
    assert res["decision"]["source"] == f"pre-registered in {plan}" and res["decision"]["overridden"] == []
    # another rule on the command line is an override, refused unless said so
    rc, _, err = _run(capsys, "--items", *specs, "--decision", str(plan), "--alpha", "0.05", "--out",
                      str(tmp_path / "b"))
    assert rc == 2 and "alpha: 0.01 -> 0.05" in err and "--override-decision" in err and err.count("\n") == 1
    rc, out, err = _run(capsys, "--items", *specs, "--decision", str(plan), "--alpha", "0.05",
                        "--override-decision", "--out", str(tmp_path / "b"))
    assert rc == 0 and "OVERRIDDEN (not the pre-registered comparison): alpha: 0.01 -> 0.05" in out
    # without a plan the command line is the rule, said to be not pre-registered
    rc, out, _ = _run(capsys, "--items", *specs, "--method", "paired_bootstrap", "--out", str(tmp_path / "c"))
    assert rc == 0 and "rule source: the command line (no --decision plan: not pre-registered)" in out
    for text, msg in (("method: auto\nfoo: 1\n", r"unknown key\(s\) \['foo'\]"),
                      ("endpoint: auc\n", "endpoint 'auc' needs eval curves"),
                      ("alpha: 2\n", r"decision\.alpha"), ("- 1\n", "expected a mapping")):
        plan.write_text(text)
        rc, _, err = _run(capsys, "--items", *specs, "--decision", str(plan), "--out", str(tmp_path / "d"))
        assert rc == 2 and err.count("\n") == 1, err
        assert re.search(msg, err), err
    assert not (tmp_path / "d").exists()


def test_design_from_item_files_says_items_and_seeds_needed(tmp_path, capsys):
    from eval.design import main as design_main

    specs = [",".join(str(LM / f"{a}_seed{s}") for s in (0, 1)) for a in ("a", "b")]
    rc = design_main(["--from", f"a={specs[0]}", "--from", f"b={specs[1]}", "--target-effect", "0.1",
                      "--seed-sd", "0.02", "--sims", "400", "--bootstrap", "20", "--plot", "", "--json"])
    out, err = capsys.readouterr()
    # exit 1 would be a PROBLEM: seed t's false-positive rate above alpha (at 40 simulations its estimate
    # is too noisy to stay under 0.05; at 400 it reads 0.040)
    assert rc == 0, err
    res = json.loads(out)
    assert res["n_items"] == 16 and res["n_seeds"] == 2 and res["decision_method"] == "seed_t"
    # the discordance measured on the files: share of (seed, item) results the arms disagree on
    acc = {(a, s): np.array(_acc(a, s)) for a in "ab" for s in (0, 1)}
    disc = np.mean([np.mean(acc["a", s] != acc["b", s]) for s in (0, 1)])
    assert res["discordance"] == pytest.approx(disc)
    assert res["seed_sd"] == 0.02 and res["assumptions"]["seed_sd"] == "--seed-sd"
    assert set(res["items_needed"]) == set(res["seeds_needed"]) >= {"seed_t", "paired_hoeffding"}
    assert res["seeds_needed"]["seed_t"] is not None and res["seeds_needed"]["seed_t"] >= 2
    rc = design_main(["--from", f"a={specs[0]}", "--from", f"b={specs[1]}", "--sims", "20", "--bootstrap",
                      "10", "--plot", ""])
    out, _ = capsys.readouterr()
    assert rc == 0 and "design: 16 items x 2 seed(s) per arm" in out and "no target effect" in out
    rc = design_main(["--from", f"a={specs[0]}", "--from", str(tmp_path)])
    assert rc == 2 and "no pilot folder and no Hydra overrides" in capsys.readouterr().err


def test_sweep_and_items_options_do_not_mix(tmp_path, capsys):
    rc, _, err = _run(capsys, str(tmp_path), "--decision", str(tmp_path / "plan.yaml"))
    assert rc == 2 and err == "eval.compare: error: --decision: for --items only, not for sweep folders\n"
    rc, _, err = _run(capsys, "--items", f"A={DATA / 'plain.jsonl'}", "--treatment", "B", "--out", str(tmp_path))
    assert rc == 2 and err == "eval.compare: error: --treatment: for sweep folders only, not for --items\n"
    assert not (tmp_path / "compare.json").exists()


# ----------------------------------------------------------------------------- the registry's methods on files
def _seeded_files(tmp: Path, gains: list[int], n: int = 200) -> list[str]:
    """Two arms in plain JSONL with a `seed` column, one gain (in items) per seed."""
    rng = np.random.default_rng(9)
    rows: dict[str, list[str]] = {"base": [], "treat": []}
    for s, g in enumerate(gains):
        t, b = _with_gap(n, 80, g, rng)
        for arm, v in (("base", b), ("treat", t)):
            rows[arm] += [json.dumps({"item_id": i, "correct": bool(v[i]), "seed": s}) for i in range(n)]
    specs = []
    for arm, lines in rows.items():
        p = tmp / f"{arm}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        specs.append(f"{arm}={p}")
    return specs


def test_sign_flip_and_equivalence_decide_per_item_files(tmp_path, capsys):
    # six seeds, the treatment ahead at every one: the exact sign-flip test's smallest p, 2 / 2^6
    specs = _seeded_files(tmp_path, [6, 9, 4, 7, 5, 8])
    plan = tmp_path / "plan.yaml"
    plan.write_text("decision:\n  method: sign_flip\n  baseline: base\n  equivalence_margin: 0.05\n")
    res = compare_items(specs, plan=str(plan), n_bootstrap=200, out=tmp_path / "a")
    assert res["decision"]["method"] == "sign_flip" and res["decision"]["equivalence_margin"] == 0.05
    assert res["n_seeds"] == 6 and res["verdict"] == "validated" and res["verdict_scope"] == "across_seeds"
    assert res["p_rule"] == pytest.approx(2 / 64)
    assert res["effect_sizes"]["prob_improvement"] == 1.0
    # no gap at any seed: seed t's interval lies inside +-0.05 -> equivalent (the CLI's option, no plan)
    specs = _seeded_files(tmp_path, [1, -1, 0, 1, -1, 0])
    rc, out, err = _run(capsys, "--items", *specs, "--equivalence-margin", "0.05", "--bootstrap", "200",
                        "--out", str(tmp_path / "b"))
    assert rc == 0 and "equivalent" in out, err
    res = json.loads((tmp_path / "b" / "compare.json").read_text())
    assert res["decision"]["method"] == "seed_t" and res["verdict"] == "equivalent", res["rule_ci"]
    assert -0.05 < res["rule_ci"][0] < res["rule_ci"][1] < 0.05
    # planned looks need the ledger beside the training runs: refused in one line, nothing written
    plan.write_text("method: seed_t\nbaseline: base\nlooks: [3, 6]\n")
    rc, _, err = _run(capsys, "--items", *specs, "--decision", str(plan), "--out", str(tmp_path / "c"))
    assert rc == 2 and err.count("\n") == 1, err
    assert "looks [3, 6] are not supported for per-item files" in err
    assert not (tmp_path / "c").exists()
