"""eval.compare --items and eval.design --from on per-item files written by other frameworks.

The sample files in tests/data/items/ (make_samples.py there writes them): lm_eval/ was written by
lm-evaluation-harness 0.4.13 itself (its dummy model, `--log_samples`), tinker_cookbook/ by tinker-cookbook
0.5.8's own EvalStore; prime_rl/ and verl/ were built field for field from prime-rl v0.6.0's `save_rollouts`
and verl v0.7.0's `_dump_generations` (neither installs offline); plain.jsonl / plain.csv are this
project's plain format. The tests below build the other cases field for field from the writers' code in
tmp_path (the docstring of each helper names its version): an lm-eval generative task with two filters,
lm-eval files older than 0.4.7, prime-rl v0.7 eval traces, a timed-out cookbook trajectory, errored prime-rl
rollouts.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
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
        assert f.ids == [f"gsm8k/{t.example_id}" for t in trajs]  # a run's folder: <benchmark>/<id>
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


# ----------------------------------------------------------------------------- items paired by what they are
def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _gen_doc(i: int, revision: int = 0) -> dict:
    a, b = 3 + i + revision, 4 + 2 * i
    return {"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}"}


def _gen_samples(right: dict[str, set[int]], n: int = 8, revision: int = 0) -> list[dict]:
    """A generative task's samples as lm-eval 0.4.13 writes them (evaluator.py `example`, one line per doc and
    filter, filters in the task's order): gsm8k-style `exact_match` under `strict-match` and
    `flexible-extract`; `right[filter]` = the doc_ids that filter scores 1."""
    lines = []
    for flt, good in right.items():
        for i in range(n):
            doc = _gen_doc(i, revision)
            target = doc["answer"].rpartition("#### ")[2]
            prompt = f"Question: {doc['question']}\nAnswer:"
            ok = i in good
            lines.append({
                "doc_id": i, "doc": doc, "target": doc["answer"],
                "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": {"until": ["Question:", "</s>"],
                                                                        "do_sample": False}}},
                "resps": [[f" The answer is {target if ok else 0}."]],
                "filtered_resps": [target if ok else "[invalid]"], "filter": flt, "metrics": ["exact_match"],
                "doc_hash": _sha(json.dumps(doc, indent=2, ensure_ascii=False)), "prompt_hash": _sha(prompt),
                "target_hash": _sha(doc["answer"]), "exact_match": float(ok)})
    return lines


def _write_lines(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


GEN = "samples_arith_gen_2026-12-07T09-10-00.000000.jsonl"


def _reordered(src: Path, dest: Path, how: str) -> Path:
    lines = src.read_text().splitlines(keepends=True)
    lines = lines[::-1] if how == "reversed" else [lines[k] for k in np.random.default_rng(1).permutation(len(lines))]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(lines))
    return dest


def _pairs(tmp: Path) -> dict[str, tuple[Path, Path]]:
    """Baseline and treatment file of each format, in the order their writers wrote them."""
    plain = {}
    rng = np.random.default_rng(8)
    for arm, p in (("a", 0.3), ("b", 0.7)):
        plain[arm] = _write_lines(tmp / "plain" / f"{arm}.jsonl", [
            {"item_id": f"q{i}", "correct": bool(rng.random() < p)} for i in range(30)])
    prime = DATA / "prime_rl"
    return {"lm_eval": (next((LM / "a_seed0").glob("samples_arith_add_*")),
                        next((LM / "b_seed0").glob("samples_arith_add_*"))),
            "prime_rl": (prime / "a" / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl",
                         prime / "b" / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl"),
            "plain": (plain["a"], plain["b"])}


@pytest.mark.parametrize("how", ["reversed", "shuffled"])
@pytest.mark.parametrize("fmt", ["lm_eval", "prime_rl", "plain"])
def test_items_are_paired_by_id_whatever_order_a_file_lists_them(tmp_path, fmt, how):
    base, treat = _pairs(tmp_path)[fmt]
    want = compare_items([f"a={base}", f"b={treat}"], n_bootstrap=200, out=tmp_path / "in_order")
    moved = _reordered(treat, tmp_path / how / treat.name, how)
    got = compare_items([f"a={base}", f"b={moved}"], n_bootstrap=200, out=tmp_path / "moved")
    assert got["n_items"] == want["n_items"] and got["item_set_sha256"] == want["item_set_sha256"]
    g, w = got["comparisons"][0], want["comparisons"][0]
    assert (g["b_items"], g["c_items"]) == (w["b_items"], w["c_items"]) and w["b_items"] + w["c_items"] > 0
    assert g["methods"] == w["methods"] and g["per_seed"] == w["per_seed"] and got["verdict"] == want["verdict"]


def test_lm_eval_metric_names_the_filter_it_scores(tmp_path):
    path = _write_lines(tmp_path / GEN, _gen_samples({"strict-match": {1, 4}, "flexible-extract": {1, 2, 4, 6}}))
    (strict,) = read_items(path)
    assert strict.metric == "exact_match,strict-match" and strict.scores_N.tolist() == [0, 1, 0, 0, 1, 0, 0, 0]
    assert any("'strict-match' of ['strict-match', 'flexible-extract']" in n for n in strict.notes)
    (flex,) = read_items(path, metric="exact_match,flexible-extract")
    assert flex.metric == "exact_match,flexible-extract" and flex.scores_N.tolist() == [0, 1, 1, 0, 1, 0, 1, 0]
    (first,) = read_items(path, metric="exact_match")  # no filter named: the first, as by default
    assert first.scores_N.tolist() == strict.scores_N.tolist()


@pytest.mark.parametrize("case", ["plain score 2", "plain score -0.5", "prime-rl reward 1.2"])
def test_scores_outside_0_1_are_refused(tmp_path, case):
    if case.startswith("plain"):
        value = 2.0 if "2" in case.split()[-1] else -0.5
        path = _write_lines(tmp_path / "p.jsonl", [{"item_id": "q0", "score": 0.5},
                                                   {"item_id": "q1", "score": value}])
        with pytest.raises(ItemsError, match=rf"p\.jsonl:2: score = {value} is not a score in \[0, 1\]"):
            read_items(path)
        return
    src = DATA / "prime_rl" / "a" / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl"
    rows = _lines(src)
    rows[3]["reward"], rows[3]["metrics"]["correct_answer"] = 1.2, 1.0  # right, plus a 0.2 format bonus
    path = _write_lines(tmp_path / "eval_rollouts_gsm8k.jsonl", rows)
    with pytest.raises(ItemsError, match=r":4: reward = 1\.2 is not a score in \[0, 1\].*other values: "
                                         r"\['correct_answer', 'num_turns'\], name one in \[0, 1\] with --metric"):
        read_items(path)
    (ok,) = read_items(path, metric="correct_answer")
    assert ok.scores_N.max() == 1.0


def _lm_arm(tmp: Path, name: str, gen_right: set[int], revision: int = 0, mc_from: str = "a_seed0") -> Path:
    """One lm-eval run's output folder as lm-eval writes it (`<output_path>/<model>/samples_*.jsonl`): the
    multiple-choice task arith_add (the committed file) and the generative task arith_gen."""
    run = tmp / name / "__models__smollm2"
    run.mkdir(parents=True)
    mc = next((LM / mc_from).glob("samples_arith_add_*"))
    (run / mc.name).write_text(mc.read_text())
    flex = gen_right | {7}
    _write_lines(run / GEN, _gen_samples({"strict-match": gen_right, "flexible-extract": flex},
                                         revision=revision))
    return tmp / name


def test_lm_eval_documents_must_match_behind_each_doc_id(tmp_path, capsys):
    a = _lm_arm(tmp_path, "a", {0, 3})
    b = _lm_arm(tmp_path, "b", {0, 1, 3, 5}, revision=1, mc_from="b_seed0")  # another revision of arith_gen
    rc, _, err = _run(capsys, "--items", f"a={a}", f"b={b}", "--out", str(tmp_path / "out"))
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(r"doc_id 0 of task arith_gen is another item in b \(.*\) than in a \(.*\): its doc_hash "
                     r"differs \(8 of 16 items do\)", err), err
    assert not (tmp_path / "out").exists()
    # the task files named alone: the same check, the task named by its file
    files = [next(x.rglob("samples_arith_gen_*")) for x in (a, b)]
    with pytest.raises(ItemsError, match=r"doc_id 0 of task arith_gen is another item"):
        compare_items([f"a={files[0]}", f"b={files[1]}"], out=tmp_path / "out")
    # the same documents behind the ids: compared
    b2 = _lm_arm(tmp_path, "b2", {0, 1, 3, 5}, mc_from="b_seed0")
    assert compare_items([f"a={a}", f"b={b2}"], n_bootstrap=100, out=tmp_path / "ok")["n_items"] == 16


def test_an_lm_eval_folder_of_a_multiple_choice_and_a_generative_task(tmp_path, capsys):
    a = _lm_arm(tmp_path, "a", {0, 3})
    b = _lm_arm(tmp_path, "b", {0, 1, 3, 5}, mc_from="b_seed0")
    rc, out, err = _run(capsys, "--items", f"a={a}", f"b={b}", "--out", str(tmp_path / "out"), "--json",
                        "--bootstrap", "100")
    assert rc == 0, err
    res = json.loads(out)
    assert res["n_items"] == 16 and res["categories"]["names"] == ["arith_add", "arith_gen"]
    assert res["metric"] == "arith_add: acc,none; arith_gen: exact_match,strict-match"
    assert any("each task is scored by its own first metric" in n for n in res["notes"])
    # each task's accuracy per arm: the mean of its own metric, as lm-eval's results json reports it
    acc = {(r["arm"], r["category"]): r for r in res["categories"]["accuracy"]}
    for arm, src in (("a", "a_seed0"), ("b", "b_seed0")):
        mc = _lines(next((LM / src).glob("samples_arith_add_*")))
        assert acc[arm, "arith_add"]["accuracy"] == pytest.approx(np.mean([r["acc"] for r in mc]))
        assert acc[arm, "arith_add"]["metric"] == "acc,none" and acc[arm, "arith_add"]["n_items"] == 8
    assert acc["a", "arith_gen"]["accuracy"] == 2 / 8 and acc["b", "arith_gen"]["accuracy"] == 4 / 8
    assert acc["b", "arith_gen"]["metric"] == "exact_match,strict-match"
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "| arith_gen | exact_match,strict-match | 8 | 0.2500 | 0.5000 |" in md
    # a task missing in one arm is named as such
    next(b.rglob("samples_arith_gen_*")).unlink()
    rc, _, err = _run(capsys, "--items", f"a={a}", f"b={b}", "--out", str(tmp_path / "out2"))
    assert rc == 2 and re.search(r"b \(.*\) lacks task\(s\) \['arith_gen'\] that a \(.*\) has", err), err


def _old_lm_eval(src: Path, dest: Path, array: bool) -> Path:
    """The same samples as an older lm-eval writes them: 0.4.3-0.4.6 without `filter` / `metrics`
    (evaluator.py's `example` at v0.4.5), 0.4.0-0.4.2 also without the hashes, as one JSON array
    (`json.dumps(samples[task_name], indent=2)` into `<model_args>_<task>.jsonl`, __main__.py at v0.4.2)."""
    rows = []
    for r in _lines(src):
        r = {k: v for k, v in r.items() if k not in ("filter", "metrics")}
        if array:
            r = {k: v for k, v in r.items() if not k.endswith("_hash")}
        rows.append(r)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if array:
        dest.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    else:
        _write_lines(dest, rows)
    return dest


@pytest.mark.parametrize("array", [False, True], ids=["0.4.3-0.4.6", "0.4.0-0.4.2"])
def test_lm_eval_files_older_than_0_4_7_are_read(tmp_path, array):
    src = next((LM / "a_seed0").glob("samples_arith_add_*"))
    name = "pretrained__smollm2_arith_add.jsonl" if array else src.name
    old = _old_lm_eval(src, tmp_path / name, array)
    raw = _lines(src)
    (f,) = read_items(old)
    assert f.format == "lm_eval" and f.metric == "acc,none" and f.scores_N.tolist() == [r["acc"] for r in raw]
    assert any("older than 0.4.7" in n for n in f.notes)
    (norm,) = read_items(old, metric="acc_norm")
    assert norm.scores_N.tolist() == [r["acc_norm"] for r in raw]
    assert (f.content is None) == array  # 0.4.3 on write doc_hash
    # several filters without a `filter` key: which line is which cannot be told
    gen = _write_lines(tmp_path / "gen" / GEN, [{k: v for k, v in r.items() if k not in ("filter", "metrics")}
                                                for r in _gen_samples({"strict-match": {1}, "flex": {2}})])
    with pytest.raises(ItemsError, match=r":9: doc_id 0 again \(first on line 1\): an lm-eval file older than "
                                         r"0\.4\.7 names no filter"):
        read_items(gen)


def test_lm_eval_results_json_points_to_the_samples_files(tmp_path, capsys):
    results = {"results": {"arith_add": {"alias": "arith_add", "acc,none": 0.5, "acc_stderr,none": 0.189}},
               "group_subtasks": {"arith_add": []}, "configs": {"arith_add": {"task": "arith_add"}},
               "versions": {"arith_add": 1.0}, "n-shot": {"arith_add": 0}, "config": {"model": "hf"},
               "git_hash": "b5fa3b7", "date": 1796634445.3}
    path = tmp_path / "results_2026-12-07T09-07-25.331304.json"
    path.write_text(json.dumps(results, indent=2))
    rc, _, err = _run(capsys, "--items", f"a={path}", f"b={DATA / 'plain.jsonl'}", "--out", str(tmp_path / "o"))
    assert rc == 2 and err.count("\n") == 1
    assert "lm-eval's aggregate results" in err and "--log_samples" in err and "samples_<task>_<date>.jsonl" in err
    assert "truncated or corrupted" not in err
    renamed = tmp_path / "results.jsonl"  # by its content too, whatever its name, pretty-printed or not
    for text in (path.read_text(), json.dumps(results)):
        renamed.write_text(text)
        with pytest.raises(ItemsError, match="lm-eval's aggregate results"):
            read_items(renamed)
    # JSON lines in a file named .json are read as such
    lines = _write_lines(tmp_path / "plain.json", _lines(DATA / "plain.jsonl"))
    assert [f.seed for f in read_items(lines)] == [0, 1]


# ----------------------------------------------------------------------------- prime-rl, cookbook, verl
PRIME = DATA / "prime_rl"


def _prime_file(arm: str) -> Path:
    return PRIME / arm / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl"


def test_prime_rl_example_ids_must_name_the_same_question(tmp_path):
    rows = _lines(_prime_file("b"))
    for r in rows:
        if r["example_id"] == 3:  # another dataset (or order) behind the same index
            r["prompt"] = [{"role": "user", "content": "question 30"}]
            r["answer"] = "12"
    moved = _write_lines(tmp_path / "b" / "eval_rollouts_gsm8k.jsonl", rows)
    with pytest.raises(ItemsError, match=r"example_id 3 of env gsm8k is another item in b \(.*\) than in a "
                                         r"\(.*\): its question and answer differs \(1 of 5 items do\).*plain "
                                         r"files \(item_id, score\)"):
        compare_items([f"a={_prime_file('a')}", f"b={moved}"], out=tmp_path / "out")
    # a system prompt (the treatment, say) may differ: the question and the answer are the item
    rows = _lines(_prime_file("b"))
    for r in rows:
        r["prompt"].insert(0, {"role": "system", "content": "Think step by step."})
    sys_prompt = _write_lines(tmp_path / "sys" / "eval_rollouts_gsm8k.jsonl", rows)
    assert compare_items([f"a={_prime_file('a')}", f"b={sys_prompt}"], n_bootstrap=50,
                         out=tmp_path / "ok")["n_items"] == 5
    # within one file, one example_id with two questions
    rows = _lines(_prime_file("a"))
    rows[1]["prompt"] = [{"role": "user", "content": "question 9"}]
    two = _write_lines(tmp_path / "two.jsonl", rows)
    with pytest.raises(ItemsError, match=r"two\.jsonl:2: item '0' has another question and answer than on line 1"):
        read_items(two)


def test_prime_rl_errored_rollouts_are_left_out_as_prime_rl_leaves_them(tmp_path):
    rows = _lines(_prime_file("a"))
    error = {"error": "ModelError", "message": "vLLM request timed out", "traceback": None}
    by_id = defaultdict(list)
    for k, r in enumerate(rows):
        by_id[r["example_id"]].append(k)
    rows[by_id[2][0]].update(error=error, reward=0.0)  # one of example 2's two rollouts
    for k in by_id[4]:  # both of example 4's
        rows[k].update(error=error, reward=0.0)
    path = _write_lines(tmp_path / "a" / "eval_rollouts_gsm8k.jsonl", rows)
    (f,) = read_items(path)
    assert f.ids == ["0", "1", "2", "3"] and f.left_out == ["4"] and f.repeats == 2
    assert f.scores_N[2] == rows[by_id[2][1]]["reward"]  # the one rollout that did not error
    kept = [r["reward"] for r in rows if r["error"] is None]
    assert any("3 rollout(s) ended in an error: left out" in n for n in f.notes)
    # with one rollout per example the arm's accuracy is prime-rl's own eval reward over the effective set
    singles = _write_lines(tmp_path / "s" / "eval_rollouts_gsm8k.jsonl",
                           [rows[by_id[i][1]] for i in range(5)])
    (s,) = read_items(singles)
    assert s.scores_N.mean() == pytest.approx(np.mean([r["reward"] for r in _lines(singles) if not r["error"]]))
    assert len(kept) == 7
    res = compare_items([f"a={path}", f"b={_prime_file('b')}"], n_bootstrap=50, out=tmp_path / "out")
    assert res["n_items"] == 4
    assert any(n.startswith("1 item(s) left out of every arm") and "'4'" in n for n in res["notes"])


def _trace(idx: int, env: str, reward: float, error: bool = False, question: str | None = None) -> dict:
    """One eval record of prime-rl v0.7.0's traces.jsonl: `Rollout.to_record()` (verifiers v1
    `Trace.model_dump(mode="json")` plus kind, env_name, group_id, policy_version, eval_step)."""
    q = question or f"What is {idx} + {idx + 2}?"
    t0 = 1796634000.0 + idx
    node = {"parent": None, "sampled": False, "timestamp": t0, "token_ids": [], "mask": [], "is_content": []}
    return {
        "id": f"{idx:04d}{env}"[:32], "task": {"type": "SingleTurnTask", "data": {
            "idx": idx, "name": None, "description": None, "prompt": [{"role": "user", "content": q}],
            "system_prompt": None, "image": None, "workdir": None,
            "timeout": {"setup": None, "harness": None, "finalize": None, "scoring": None},
            "resources": {"cpu": None, "memory": None, "gpu": None}, "answer": str(2 * idx + 2)}},
        "runtime": None,
        "nodes": [{**node, "message": {"role": "user", "content": q}},
                  {**node, "parent": 0, "sampled": True, "message": {"role": "assistant", "content": "\\boxed{4}"}}],
        "rewards": {} if error else {"correct_answer": reward},
        "metrics": {} if error else {"correct_answer": reward, "num_turns": 1.0},
        "info": {}, "extra_usage": [], "is_completed": not error,
        "stop_condition": "error" if error else "no_tools_called",
        "errors": [{"type": "ModelError", "message": "request timed out", "traceback": None}] if error else [],
        "timing": {"start": t0, **{k: {"start": t0, "end": t0 + 1} for k in
                                   ("setup", "generation", "finalize", "scoring")}},
        "kind": "eval", "env_name": env, "group_id": "6f1c2d3e-0000-4000-8000-00000000000" + str(idx % 10),
        "policy_version": 20, "eval_step": 20}


def test_prime_rl_v0_7_eval_traces_are_read(tmp_path):
    right = {"a": {("gsm8k", 0), ("gsm8k", 2), ("math", 1)},
             "b": {("gsm8k", 0), ("gsm8k", 1), ("gsm8k", 2), ("math", 0), ("math", 1)}}
    folders = {}
    for arm, ok in right.items():
        step = tmp_path / arm / "rollouts" / "step_20"
        recs = [_trace(i, env, float((env, i) in ok), error=arm == "a" and (env, i) == ("gsm8k", 3))
                for env, n in (("gsm8k", 4), ("math", 2)) for i in range(n)]
        _write_lines(step / "eval" / "all" / "traces.jsonl", recs)
        _write_lines(step / "eval" / "effective" / "traces.jsonl", [r for r in recs if not r["errors"]])
        folders[arm] = step
    (f,) = read_items(folders["a"])
    assert f.format == "prime_rl" and f.metric == "reward" and f.category_kind == "env"
    assert f.ids == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "math/0", "math/1"] and f.left_out == ["gsm8k/3"]
    assert f.categories == ["gsm8k"] * 3 + ["math"] * 2 and f.scores_N.tolist() == [1, 0, 1, 0, 1]
    assert any("1 rollout(s) ended in an error" in n for n in f.notes)
    (m,) = read_items(folders["a"] / "eval" / "all" / "traces.jsonl", metric="correct_answer")
    assert m.scores_N.tolist() == f.scores_N.tolist()
    (e,) = read_items(folders["a"] / "eval" / "effective" / "traces.jsonl")
    assert e.ids == f.ids and e.left_out == [] and any("pass eval/all/traces.jsonl" in n for n in e.notes)
    res = compare_items([f"a={folders['a']}", f"b={folders['b']}"], n_bootstrap=50, out=tmp_path / "out")
    assert res["n_items"] == 5 and res["categories"]["names"] == ["gsm8k", "math"]
    assert any(n.startswith("1 item(s) left out of every arm") and "gsm8k/3" in n for n in res["notes"])
    acc = {(r["arm"], r["category"]): r["accuracy"] for r in res["categories"]["accuracy"]}
    assert acc["a", "gsm8k"] == 2 / 3 and acc["b", "math"] == 1.0
    # another question behind an index: refused
    _write_lines(folders["b"] / "eval" / "all" / "traces.jsonl",
                 [_trace(i, "gsm8k", 1.0, question="Another question?" if i == 2 else None) for i in range(4)]
                 + [_trace(i, "math", 1.0) for i in range(2)])
    with pytest.raises(ItemsError, match=r"example_id 2 of env gsm8k is another item"):
        compare_items([f"a={folders['a']}", f"b={folders['b']}"], out=tmp_path / "out2")


def test_a_timed_out_cookbook_trajectory_scores_0_on_every_metric(tmp_path, capsys):
    run = tmp_path / "runs" / "arm_b"
    rows = _lines(COOK / "b" / "runs" / "arm_b" / "gsm8k" / "trajectories.jsonl")
    # what the runner saves on a timeout: reward 0, the error, no metrics, no assistant turn
    rows[4].update(reward=0.0, metrics={}, error="timeout (600s)", turns=rows[4]["turns"][:1], logs={})
    _write_lines(run / "gsm8k" / "trajectories.jsonl", rows)
    (f,) = read_items(run, metric="correct")
    assert f.scores_N.tolist() == [r["metrics"].get("correct", 0.0) for r in rows] and f.scores_N[4] == 0.0
    assert any("1 trajectory(ies) ended in an error (a timeout, say): each scores 0 on correct" in n
               for n in f.notes)
    rc, out, err = _run(capsys, "--items", f"a={COOK / 'a' / 'runs' / 'arm_a'}", f"b={run}", "--metric",
                        "correct", "--out", str(tmp_path / "out"), "--bootstrap", "50")
    assert rc == 0 and "each scores 0 on correct" in out, err
    # a trajectory without the metric that did not fail is still refused
    rows[4]["error"] = None
    _write_lines(run / "gsm8k" / "trajectories.jsonl", rows)
    with pytest.raises(ItemsError, match=r"no metric 'correct' \(this trajectory has reward and metrics \[\]\)"):
        read_items(run, metric="correct")


def test_a_verl_folder_gives_its_latest_dump_and_a_shared_prompt_is_named(tmp_path):
    val = tmp_path / "val"
    val.mkdir()
    for step in (20, 40, 100):
        src = DATA / "verl" / "b" / "40.jsonl"
        rows = _lines(src)
        for r in rows:
            r["step"] = step
        _write_lines(val / f"{step}.jsonl", rows)
    (f,) = read_items(val)
    assert f.path == val / "100.jsonl" and f.eval_name == "verl step 100"
    assert any("steps [20, 40, 100]: the latest, 100.jsonl, is read" in n for n in f.notes)
    # two rows of the validation set with one prompt text
    rows = _lines(DATA / "verl" / "b" / "40.jsonl")
    rows.append(dict(rows[2]))
    dup = _write_lines(tmp_path / "dup" / "40.jsonl", rows)
    with pytest.raises(ItemsError, match=r"40\.jsonl:3: 1 prompt text\(s\) come 2x as often as the others "
                                         r"\(e\.g\. 'user\\nSolve: 2 \+ 2.*two rows of the validation set share "
                                         r"one prompt"):
        read_items(dup)


# ----------------------------------------------------------------------------- the report's words
def _bounds(obj, key=""):
    """Every interval bound of a difference in compare.json (the keys clip_to_score_range cuts)."""
    from eval.result import BOUND_KEYS as _BOUND_KEYS

    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _BOUND_KEYS and isinstance(v, float):
                yield k, v
            elif k == "rule_ci" and isinstance(v, list):
                yield from ((k, x) for x in v)
            else:
                yield from _bounds(v, k)
    elif isinstance(obj, list):
        for v in obj:
            yield from _bounds(v, key)


def test_intervals_stay_within_the_range_of_a_difference_of_scores(tmp_path):
    # 2 seeds of 16 items: seed t's interval (t = 12.7 at df 1) and Hoeffding's at 8 items reach past +-1
    arm = {a: ",".join(str(LM / f"{a}_seed{s}") for s in (0, 1)) for a in ("a", "b")}
    res = compare_items([f"a={arm['a']}", f"b={arm['b']}"], n_bootstrap=100, out=tmp_path)
    found = list(_bounds(res))
    assert len(found) > 20 and all(-1.0 <= v <= 1.0 for _, v in found)
    assert {v for _, v in found} & {-1.0, 1.0}, "no bound was cut: the case does not test the cut"
    assert any(n.startswith("intervals are cut to [-100, +100] pts") for n in res["notes"])
    md = (tmp_path / "compare.md").read_text()
    shown = [float(x) for x in re.findall(r"\[([+-]\d+\.\d+) pts, ", md) + re.findall(r", ([+-]\d+\.\d+) pts\]", md)]
    assert shown and all(abs(x) <= 100 for x in shown)
    assert res["verdict"] == "inconclusive"  # decided before the cut, and unchanged by it


def test_the_report_says_pre_registered_only_for_a_plan_and_advises_only_what_items_accept(tmp_path):
    add = [next((LM / f"{a}_seed0").glob("samples_arith_add_*")) for a in ("a", "b")]
    specs = [f"a={add[0]}", f"b={add[1]}"]
    compare_items(specs, n_bootstrap=50, out=tmp_path / "cli")
    md = (tmp_path / "cli" / "compare.md").read_text()
    assert "## Decision rule (not pre-registered: the command line's options)" in md
    assert "(pre-registered)" not in md and "resolved from the sweep" not in md
    assert "--aa" not in md and "--multirun" not in md and "one file per training seed" in md
    plan = tmp_path / "plan.yaml"
    plan.write_text("method: auto\nbaseline: a\n")
    compare_items(specs, plan=str(plan), n_bootstrap=50, out=tmp_path / "plan")
    md = (tmp_path / "plan" / "compare.md").read_text()
    assert "## Decision rule (pre-registered)" in md and f"Rule source: pre-registered in {plan}" in md
    assert "resolved from the files" in md
    # a sweep whose runs predate the decision config: its rule is the defaults, not pre-registered either
    from eval.compare import CompareRequest
    from eval.items import compare_item_files
    from eval.report import render_markdown

    res = compare_item_files(specs, CompareRequest(plan=str(plan), n_bootstrap=50, out=tmp_path / "plan2"))
    res.rule.source = "default (the runs' config has no `decision` group: made before it existed)"
    assert ("## Decision rule (not pre-registered: default (the runs' config has no `decision` group"
            in render_markdown(res, tmp_path))
    # one arm at two seeds: the A/A spread, with no --aa advice
    compare_items([f"a={LM / 'a_seed0'},{LM / 'a_seed1'}"], out=tmp_path / "aa")
    md = (tmp_path / "aa" / "compare.md").read_text()
    assert md.startswith("# A/A comparison") and "--aa" not in md


def test_the_default_output_folder_never_overwrites_another_comparison(tmp_path, capsys):
    root = tmp_path / "lm_out"
    for run, src in (("a", "a_seed0"), ("b", "b_seed0")):
        shutil.copytree(LM / src, root / run)
    task = {t: [str(next((root / r).glob(f"samples_{t}_*"))) for r in "ab"] for t in ("arith_add", "arith_mul")}
    rc, out, err = _run(capsys, "--items", f"a={task['arith_add'][0]}", f"b={task['arith_add'][1]}",
                        "--bootstrap", "50")
    assert rc == 0 and f"compare.json: {root / 'compare.json'}" in out, err
    first = (root / "compare.json").read_text()
    # the other task's comparison would land in the same folder: refused, naming --out, nothing written
    rc, _, err = _run(capsys, "--items", f"a={task['arith_mul'][0]}", f"b={task['arith_mul'][1]}")
    assert rc == 2 and err.count("\n") == 1
    assert f"{root / 'compare.json'} holds another comparison (per-item files of 'arith_add', arms ['a', 'b'])" in err and "--out DIR" in err
    assert (root / "compare.json").read_text() == first
    rc, _, err = _run(capsys, "--items", f"a={task['arith_mul'][0]}", f"b={task['arith_mul'][1]}", "--out",
                      str(tmp_path / "mul"), "--bootstrap", "50")
    assert rc == 0 and (tmp_path / "mul" / "compare.json").is_file(), err
    # the same comparison again writes over its own report
    rc, _, err = _run(capsys, "--items", f"a={task['arith_add'][0]}", f"b={task['arith_add'][1]}",
                      "--bootstrap", "50")
    assert rc == 0, err


def test_messages_say_what_to_do(tmp_path, capsys):
    def refused(*argv: str) -> str:
        rc, _, err = _run(capsys, "--items", *argv, "--out", str(tmp_path / "never"))
        assert rc == 2 and err.count("\n") == 1, err
        assert not (tmp_path / "never").exists()
        return err

    prime = _prime_file("a")
    plain = DATA / "plain.jsonl"
    # files of two frameworks: no advice to pass --metric, with it or without
    for extra in ([], ["--metric", "reward"]):
        err = refused(f"a={prime}", f"b={plain}", *extra) if not extra else refused(
            f"a={prime}", f"b={_write_lines(tmp_path / 'r.jsonl', [{'item_id': 'q', 'reward': 1.0}])}", *extra)
        assert "come from different frameworks" in err and "pass --metric" not in err
    # lm-eval files whose first filter differs, --metric without the filter: name the filter
    strict = _write_lines(tmp_path / "s" / GEN, _gen_samples({"strict-match": {1}, "flexible-extract": {2}}))
    flex = _write_lines(tmp_path / "f" / GEN, _gen_samples({"flexible-extract": {2}, "strict-match": {1}}))
    err = refused(f"a={strict}", f"b={flex}", "--metric", "exact_match")
    assert "name the filter too, --metric exact_match,<filter>" in err and "pass --metric" not in err
    err = refused(f"a={strict}", f"b={flex}")
    assert "pass --metric to name one metric every file has" in err
    # two lm_eval runs written into one folder: move them apart, not "name the file(s)"
    two = tmp_path / "two"
    shutil.copytree(LM / "a_seed0", two)
    for p in (LM / "a_seed1").glob("*.jsonl"):
        shutil.copy(p, two / p.name)
    err = refused(f"a={two}", f"b={LM / 'b_seed0'}")
    assert "two lm_eval runs wrote into one folder; move each run's files" in err and "name the file" not in err
    # a folder of nothing this command reads: how to name what it reads, and that a comma list is seeds
    empty = tmp_path / "empty"
    empty.mkdir()
    err = refused(f"a={empty}", f"b={LM / 'b_seed0'}")
    assert "comma-separated files are one arm's seeds, not its tasks" in err
    # prime-rl's rollouts folder: the step folder to name
    rollouts = tmp_path / "rollouts"
    for step in (20, 100):
        shutil.copytree(_prime_file("a").parent, rollouts / f"step_{step}")
    err = refused(f"a={rollouts}", f"b={_prime_file('b').parent}")
    assert f"name one step folder, e.g. the last, {rollouts / 'step_100'}" in err
    # the cookbook's EvalStore root: the run to name
    err = refused(f"a={COOK / 'a'}", f"b={COOK / 'b' / 'runs' / 'arm_b'}")
    assert f"name one run, {COOK / 'a' / 'runs' / 'arm_a'}" in err


def test_a_cookbook_run_notes_repeated_samples_for_the_benchmark_that_has_them(tmp_path):
    run = tmp_path / "runs" / "arm_a"
    gsm = _lines(COOK / "a" / "runs" / "arm_a" / "gsm8k" / "trajectories.jsonl")
    _write_lines(run / "gsm8k" / "trajectories.jsonl", gsm)
    math500 = []
    for k, r in enumerate(gsm[:3]):  # pass@k mode, num_samples = 2: each example twice
        for s in range(2):
            math500.append({**r, "idx": 2 * k + s, "benchmark": "math500",
                            "example_id": r["example_id"].replace("gsm8k", "math500"), "reward": float(s == 0)})
    _write_lines(run / "math500" / "trajectories.jsonl", math500)
    (f,) = read_items(run)
    assert f.categories == ["gsm8k"] * 6 + ["math500"] * 3 and f.scores_N[6:].tolist() == [0.5, 0.5, 0.5]
    assert [n for n in f.notes if "samples per item" in n] == [
        "tinker_cookbook math500: 2 samples per item, each item's score their mean"]


def test_cookbook_positional_ids_are_replaced_by_the_prompt(tmp_path):
    """A benchmark without example_id gets the runner's fallback str(idx): a position, matched by the prompt."""
    runs = {}
    for arm in ("a", "b"):
        rows = _lines(COOK / arm / "runs" / f"arm_{arm}" / "gsm8k" / "trajectories.jsonl")
        if arm == "b":  # the runner's own order differs (async completion, another shuffle)
            rows = rows[::-1]
        for k, r in enumerate(rows):
            r.update(idx=k, example_id=str(k))
        runs[arm] = tmp_path / arm / "runs" / f"arm_{arm}"
        _write_lines(runs[arm] / "gsm8k" / "trajectories.jsonl", rows)
    want = compare_items([f"a={COOK / 'a' / 'runs' / 'arm_a'}", f"b={COOK / 'b' / 'runs' / 'arm_b'}"],
                         n_bootstrap=50, out=tmp_path / "ids")
    got = compare_items([f"a={runs['a']}", f"b={runs['b']}"], n_bootstrap=50, out=tmp_path / "prompts")
    g, w = got["comparisons"][0], want["comparisons"][0]
    assert (g["b_items"], g["c_items"]) == (w["b_items"], w["c_items"]) and g["methods"] == w["methods"]
    assert any("6 trajectories carry no example_id but their position (idx)" in n for n in got["notes"])
