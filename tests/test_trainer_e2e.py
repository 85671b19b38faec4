"""End-to-end runs of `train.py` on the local engine with the tiny random model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from runs import ROOT, TINY, read_metrics, run_train, strip_times


def test_smoke_run_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.time()
    p = run_train([*TINY, "eval.at_start=true", f"hydra.run.dir={run_dir}"], tmp_path)
    elapsed = time.time() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert elapsed < 90, f"smoke run took {elapsed:.0f}s"
    assert "batch arithmetic" in p.stdout and "total optimizer steps      4" in p.stdout
    rows = read_metrics(run_dir)
    assert [(r["step"], r["update"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["global_update"] for r in rows] == [0, 1, 2, 3]
    # the second update of each batch trains on weights the sampler did not see
    for r in rows:
        for key in ("loss/dppo_masked_frac", "loss/grpo_clip_frac", "drift/abs_p_q90", "time/sample",
                    "time/train", "time/step", "env/reward_mean", "tokens/sampled"):
            assert key in r, key
    second = [r for r in rows if r["update"] == 1]
    assert all(r["drift/abs_p_max"] > 0 for r in second)
    for s in (0, 1):  # step-level timings are one value per step, on every row of it
        assert len({(r["time/step"], r["time/train"]) for r in rows if r["step"] == s}) == 1
    assert np.mean([r["drift/abs_p_max"] for r in second]) > np.mean(
        [r["drift/abs_p_max"] for r in rows if r["update"] == 0])
    ck = json.loads((run_dir / "checkpoint.json").read_text())
    assert ck["step"] == 2 and ck["optim_steps"] == 4 and ck["tinker_path"].startswith("tinker://")
    ev = [json.loads(x) for x in (run_dir / "eval" / "gsm8k_test.jsonl").read_text().splitlines()]
    assert [e["index"] for e in ev] == [0, 1, 2, 3]
    assert set(ev[0]) >= {"index", "question_sha256", "completion", "parsed", "gold", "correct"}
    summary = json.loads((run_dir / "eval" / "gsm8k_test.summary.json").read_text())
    assert summary["n"] == 4 and summary["greedy_deterministic"] is True
    # eval.at_start: the initial weights were evaluated on the same items and paired with the final eval
    start = [json.loads(x) for x in (run_dir / "eval" / "gsm8k_test_start.jsonl").read_text().splitlines()]
    assert [e["index"] for e in start] == [0, 1, 2, 3]
    paired = json.loads((run_dir / "result.json").read_text())["eval_vs_start"]
    assert paired["n"] == 4 and paired["acc_baseline"] == np.mean([e["correct"] for e in start])
    assert paired["acc_treatment"] == summary["accuracy"]
    assert "eval vs initial weights (4 paired items)" in p.stdout
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["arm"] == "grpo_seed0" and info["versions"]["torch"].startswith("2.")
    # the engine plan: the resolved precision and every implementation choice, made once, logged at the
    # start and recorded in one record; TINY names fp32, so what `auto` would mean here does not enter the run
    assert "precision" not in info
    plan = info["engine"]
    assert {k: plan[k] for k in ("sampler_dtype", "train_dtype", "auto")} == \
        {"sampler_dtype": "float32", "train_dtype": "float32", "auto": None}
    assert isinstance(plan["train_packed_weights"], bool) and plan["train_packing"]  # and why
    assert plan["kernels"].startswith(("native (", "torch path ("))
    assert plan["decode_attention"] == plan["kernels"].startswith("native (")
    assert not plan["amx_projections"]  # fp32 weights: the AMX tiles take bf16 only
    assert plan["head_inputs"] == plan["train_head_inputs"] == "float32"
    assert "engine plan: sampler float32, train float32" in p.stdout
    assert (run_dir / "config.yaml").exists() and (run_dir / "rollouts.jsonl").stat().st_size > 0


def test_tinker_backend_without_key_fails_fast(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TINKER_API_KEY"}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "backend=tinker", f"hydra.run.dir={tmp_path}/r"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "TINKER_API_KEY" in p.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_auto_precision_override_is_checked_and_recorded(tmp_path):
    """PAIREDRL_AUTO_PRECISION decides what `auto` means (the suite's --precision uses it); a bad value stops
    the run before anything is written, naming the variable."""
    args = [a for a in TINY if "_dtype=" not in a] + ["eval=none", "schedule.num_steps=1"]
    p = run_train([*args, f"hydra.run.dir={tmp_path}/bad"], tmp_path, env={"PAIREDRL_AUTO_PRECISION": "fp8"})
    assert p.returncode == 2
    assert "PAIREDRL_AUTO_PRECISION='fp8'" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    from trainer.backends.local.plan import measured_dtype

    forced = "float32" if measured_dtype()[0] == "bfloat16" else "bfloat16"  # what this CPU would not pick
    run_dir = tmp_path / forced
    p = run_train([*args, f"hydra.run.dir={run_dir}"], tmp_path, env={"PAIREDRL_AUTO_PRECISION": forced})
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads((run_dir / "run_info.json").read_text())
    assert {k: info["engine"][k] for k in ("sampler_dtype", "train_dtype", "auto")} == \
        {"sampler_dtype": forced, "train_dtype": forced, "auto": f"PAIREDRL_AUTO_PRECISION={forced}"}


@pytest.mark.slow
def test_multirun_pair_then_compare(tmp_path):
    """A real sweep, then eval.compare on its folders. The tiny random model answers no GSM8K item,
    so both arms would score 0 and the verdict could not depend on the pairing; the final eval's
    per-item `correct` flags are therefore re-seeded (items and question hashes kept from the run):
    the treatment (dppo) right on items 0-29, the baseline (grpo) on items 0-4, of 40."""
    from eval.records import read_item_records, write_item_records

    sweep = tmp_path / "sweep"
    # paired Hoeffding pre-registered (`auto` reads one run per arm on right / wrong scores with McNemar)
    p = run_train(["--multirun", "loss=grpo,dppo", "seed=0", *TINY, "eval.n_examples=40",
                   "decision.method=paired_hoeffding", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    arms = json.loads((sweep / "arms.json").read_text())
    assert {a["arm"] for a in arms.values()} == {"grpo_seed0", "dppo_seed0"}
    n_right = {"dppo": 30, "grpo": 5}
    for a in arms.values():
        f = Path(a["run_dir"]) / "eval" / "gsm8k_test.jsonl"
        recs = read_item_records(f)
        assert sorted(r["index"] for r in recs) == list(range(40))
        assert not any(r["correct"] for r in recs)  # the tiny model really scores 0
        write_item_records(f, [{**r, "correct": r["index"] < n_right[a["loss"]]} for r in recs])

    def compare(*extra):
        c = subprocess.run([sys.executable, "-m", "eval.compare", str(sweep), "--json", *extra], capture_output=True,
                           text=True, check=False, timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        assert c.returncode == 0, c.stderr[-3000:]
        return json.loads(c.stdout[c.stdout.index("{"):])

    out = compare()
    assert (out["treatment"], out["baseline"], out["n"]) == ("dppo", "grpo", 40)
    assert out["acc_treatment"] == pytest.approx(30 / 40) and out["acc_baseline"] == pytest.approx(5 / 40)
    assert out["diff"] == pytest.approx(25 / 40)
    assert (out["b"], out["c"]) == (25, 0)  # items right only under the treatment / only under the baseline
    # paired Hoeffding at alpha 0.05: half-width sqrt(2 ln(40) / 40) = 0.4295 < 0.625
    assert out["ci_low"] == pytest.approx(25 / 40 - math.sqrt(2 * math.log(2 / 0.05) / 40))
    assert out["ci_low"] > 0 and out["verdict"] == "validated", out["verdict"]
    assert (sweep / "compare.json").exists() and (sweep / "compare.md").exists()
    assert len(list((sweep / "compare_plots").glob("*.png"))) >= 3
    # the roles swapped: the same data now says the treatment is worse
    swapped = compare("--treatment", "grpo", "--baseline", "dppo", "--override-decision",
                      "--out", str(tmp_path / "swapped"), "--no-plots")
    assert swapped["diff"] == pytest.approx(-25 / 40) and (swapped["b"], swapped["c"]) == (0, 25)
    assert swapped["verdict"] == "worse", swapped["verdict"]


def test_periodic_evals_hold_the_final_eval_items_and_form_a_curve(tmp_path):
    """eval.every: every periodic eval (and the initial-weights one) evaluates the final eval's items, so
    eval.compare can pair the curve point by point (its reader refuses any other item set)."""
    from eval.endpoints import auc_scores, curve_files, load_curve
    from eval.records import read_item_records

    run_dir = tmp_path / "run"
    p = run_train([*TINY, "eval.every=1", "eval.at_start=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    files = curve_files(run_dir / "eval", "gsm8k_test", 2)
    assert sorted(files) == [0, 1, 2] and files[1].name == "gsm8k_test_step1.jsonl"
    final = read_item_records(files[2])
    curve = load_curve("run", run_dir / "eval", "gsm8k_test", 2, final)
    assert all(sorted(c) == sorted(r["index"] for r in final) for c in curve.values())
    auc = auc_scores(curve, [0, 1, 2], sorted(curve[2]))
    assert auc.shape == (4,) and ((auc >= 0) & (auc <= 1)).all()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                    reason="hydra-joblib-launcher not installed (pip install -e '.[dev]')")
def test_joblib_launcher_runs_the_arms_in_parallel_workers_with_the_same_results(tmp_path):
    """`--multirun hydra/launcher=joblib`: both arms run in two worker processes at once, both are recorded
    in arms.json (written under a lock by concurrent jobs), and an arm equals the same command run on its own
    (thread count pinned: joblib caps each worker's threads)."""
    args = [*TINY, "eval=none", "backend.num_threads=1"]
    sweep, alone = tmp_path / "sweep", tmp_path / "alone"
    p = run_train(["--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "loss=grpo,dppo", "seed=0",
                   *args, f"hydra.sweep.dir={sweep}"], tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    arms = json.loads((sweep / "arms.json").read_text())
    assert sorted(a["arm"] for a in arms.values()) == ["dppo_seed0", "grpo_seed0"]
    runs = {a["arm"]: Path(a["run_dir"]) for a in arms.values()}
    for arm, run in runs.items():
        rows = read_metrics(run)
        assert [(r["step"], r["update"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)], arm
        assert json.loads((run / "run_info.json").read_text())["arm"] == arm
        assert yaml.safe_load((run / "config.yaml").read_text())["loss"]["name"] == arm.split("_")[0]
    p = run_train(["loss=grpo", "seed=0", *args, f"hydra.run.dir={alone}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert strip_times(read_metrics(runs["grpo_seed0"])) == strip_times(read_metrics(alone))
