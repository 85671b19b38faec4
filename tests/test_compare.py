"""eval.records and eval.compare end to end on constructed run folders.

The run folders are written the way the trainer writes them: config.yaml and run_info.json by
trainer.run_info.write_run_files from a config composed from conf/ (as `python train.py loss=...`
would), per-item files by eval.records.write_item_records, metrics.jsonl by hand.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eval.compare import IGNORED_CONFIG_KEYS, CompareError, compare, config_differences, main  # noqa: E402
from eval.plots import load_metrics, per_update, reward_by_step  # noqa: E402
from eval.records import RecordError, read_item_records, summarize, write_item_records  # noqa: E402
from eval.stats import paired_compare, pvalue_verdict  # noqa: E402

EVAL = "arithmetic"  # eval.name of the default config
N = 200
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@functools.cache
def _composed(overrides: tuple[str, ...]):
    from trainer.config.compose import run_config

    return run_config(list(overrides))


def _sha(i: int) -> str:
    return hashlib.sha256(f"question {i}".encode()).hexdigest()


def _records(correct: np.ndarray, indices=None, sha=_sha) -> list[dict]:
    indices = range(len(correct)) if indices is None else indices
    return [{"index": int(i), "question_sha256": sha(int(i)), "completion": f"... {i}",
             "parsed": str(i) if c else None, "gold": str(i), "correct": bool(c)}
            for i, c in zip(indices, correct)]


ALL_KEYS = ("env/reward_mean", "loss/dppo_masked_frac", "loss/grpo_clip_frac", "drift/abs_p_q90")


def make_run(run_dir: Path, loss: str, seed: int, correct: np.ndarray, overrides: tuple[str, ...] = (),
             metric_keys=ALL_KEYS,
             records=None, steps: int = 4, updates: int = 2) -> Path:
    from trainer.run_info import write_run_files

    run_dir.mkdir(parents=True)
    write_run_files(run_dir, _composed((f"loss={loss}", f"seed={seed}", *overrides)), {})
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(steps):
            for u in range(updates):
                row = {"step": step, "update": u}
                for k in metric_keys:
                    row[k] = 0.1 * step + (0.05 if loss == "dppo" else 0.0) + 0.001 * u
                f.write(json.dumps(row) + "\n")
    write_item_records(run_dir / "eval" / f"{EVAL}.jsonl", records or _records(correct))
    return run_dir


def _arms(rng: np.random.Generator, p_t: float, p_b: float, n: int = N) -> tuple[np.ndarray, np.ndarray]:
    return rng.random(n) < p_t, rng.random(n) < p_b


def make_sweep(root: Path, seeds=(0,), p_t=0.8, p_b=0.5, arms_json=True, **kw) -> tuple[Path, dict]:
    """Sweep folder with jobs in Hydra's order (loss outer, seed inner); returns (sweep, correct)."""
    rng = np.random.default_rng(123)
    sweep = root / "sweep"
    sweep.mkdir()
    correct, arms, job = {}, {}, 0
    for s in seeds:
        correct["dppo", s], correct["grpo", s] = _arms(rng, p_t, p_b)
    for loss in ("grpo", "dppo"):
        for s in seeds:
            make_run(sweep / str(job), loss, s, correct[loss, s], **kw)
            arms[str(job)] = f"{loss}_seed{s}"
            job += 1
    if arms_json:
        (sweep / "arms.json").write_text(json.dumps(arms))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep, correct


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "eval.compare", *args], capture_output=True, text=True,
                          env=env, check=False, timeout=120)


# ----------------------------------------------------------------------------- records
def test_records_roundtrip_summary_and_malformed_files(tmp_path):
    correct = np.array([True, False, True, True])
    path = write_item_records(tmp_path / "eval" / "x.jsonl", _records(correct))
    assert read_item_records(path) == _records(correct)
    assert [p.name for p in path.parent.iterdir()] == ["x.jsonl"]  # no temp file left behind
    s = summarize(read_item_records(path), step=7)
    assert s["n"] == 4 and s["accuracy"] == 0.75 and s["step"] == 7
    assert 0.0 < s["wilson_low"] < 0.75 < s["wilson_high"] < 1.0

    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:2] + ['{"index": 9, "question_sha'] + lines[3:]) + "\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:3: not valid JSON"):
        read_item_records(bad)
    rec = json.loads(lines[1])
    del rec["gold"]
    bad.write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:2: .*missing key\(s\) \['gold'\]"):
        read_item_records(bad)
    bad.write_text("\n".join([lines[0], lines[1], lines[0]]) + "\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:3: duplicate index 0 \(first seen on line 1\)"):
        read_item_records(bad)
    rec = json.loads(lines[1])
    rec["correct"] = 1
    with pytest.raises(RecordError, match="'correct' must be true/false"):
        write_item_records(tmp_path / "y.jsonl", [rec])
    assert not (tmp_path / "y.jsonl").exists()
    with pytest.raises(RecordError, match="share index 0"):
        write_item_records(tmp_path / "y.jsonl", _records(correct)[:1] * 2)


def test_metrics_dedup_by_step_and_global_update_index(tmp_path):
    rows = [{"step": 0, "update": 0, "env/reward_mean": 0.1, "drift/abs_p_q90": 0.01},
            {"step": 0, "update": 1, "env/reward_mean": 0.1, "drift/abs_p_q90": 0.02},
            {"step": 1, "update": 0, "env/reward_mean": 0.3, "drift/abs_p_q90": 0.03},
            {"step": 1, "update": 0, "env/reward_mean": 0.4, "drift/abs_p_q90": 0.04},  # resumed: wins
            {"step": 1, "update": 1, "env/reward_mean": 0.4}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "upd')
    loaded, notes = load_metrics(path)
    assert len(loaded) == 4 and any("unparsable" in n for n in notes)
    assert reward_by_step(loaded) == ([0, 1], [0.1, 0.4])
    assert per_update(loaded, "drift/abs_p_q90") == ([0, 1, 2], [0.01, 0.02, 0.04])


# ----------------------------------------------------------------------------- end to end
def test_cli_on_one_seed_sweep_writes_report_and_plots(tmp_path):
    # the rule paired_compare reports (auto would read one run per arm with exact McNemar)
    sweep, correct = make_sweep(tmp_path, overrides=("decision.method=paired_hoeffding",))
    proc = _cli(str(sweep), "--bootstrap", "2000", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == json.loads((sweep / "compare.json").read_text())

    t, b = correct["dppo", 0], correct["grpo", 0]
    want = paired_compare(t, b, n_bootstrap=2000, seed=0)
    for key in ("n", "acc_treatment", "acc_baseline", "diff", "ci_low", "ci_high", "method", "verdict",
                "mcnemar_p", "b", "c", "bootstrap_low", "bootstrap_high", "alpha"):
        assert out[key] == pytest.approx(want[key]) if isinstance(want[key], float) else out[key] == want[key]
    assert out["n"] == N and out["diff"] == pytest.approx((t.sum() - b.sum()) / N)
    assert out["b"] == int((t & ~b).sum()) and out["c"] == int((~t & b).sum())
    assert out["verdict"] == "validated" and out["eval_name"] == EVAL
    assert out["treatment"] == "dppo" and out["baseline"] == "grpo"
    assert [(a["arm"], a["role"], a["job"]) for a in out["arms"]] == [
        ("grpo_seed0", "baseline", "0"), ("dppo_seed0", "treatment", "1")]
    assert out["arms"][1]["accuracy"] == pytest.approx(t.mean())
    assert len(out["per_seed"]) == 1 and out["per_seed"][0]["diff"] == out["diff"]

    assert set(out["plots"]) == {"reward", "masked_frac", "clip_frac", "drift_q90", "accuracy"}
    for rel in out["plots"].values():
        data = (sweep / rel).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    md = (sweep / "compare.md").read_text()
    assert "## Verdict: **validated**" in md and "Decision rule (pre-registered)" in md
    assert f"{100 * out['diff']:+.2f} pts" in md
    for rel in out["plots"].values():
        assert f"]({rel})" in md


def test_two_seeds_pooled_and_missing_metric_key_skips_plot(tmp_path):
    sweep, correct = make_sweep(tmp_path, seeds=(0, 1), p_t=0.55, p_b=0.5,
                                metric_keys=ALL_KEYS[:3])
    out = compare([sweep], n_bootstrap=500)
    assert [s["seed"] for s in out["per_seed"]] == [0, 1]
    assert out["n"] == 2 * N and out["n_seeds"] == 2 and out["n_items"] == N
    k_t = sum(int(correct["dppo", s].sum()) for s in (0, 1))
    k_b = sum(int(correct["grpo", s].sum()) for s in (0, 1))
    assert out["diff"] == pytest.approx((k_t - k_b) / (2 * N))
    assert out["b"] == sum(s["b"] for s in out["per_seed"])
    for s in out["per_seed"]:
        ct, cb = correct["dppo", s["seed"]], correct["grpo", s["seed"]]
        assert s["diff"] == pytest.approx((ct.sum() - cb.sum()) / N)
        assert s["treatment_arm"] == f"dppo_seed{s['seed']}"
    assert "drift_q90" not in out["plots"] and "reward" in out["plots"]
    assert any("drift_q90 plot skipped" in n and "drift/abs_p_q90" in n for n in out["notes"])
    md = (sweep / "compare.md").read_text()
    assert "**combined**" in md and "drift_q90 plot skipped" in md


def test_two_run_folders_pick_roles_by_loss(tmp_path):
    rng = np.random.default_rng(5)
    t, b = _arms(rng, 0.52, 0.5)
    base = tmp_path / "runs"
    # different output-path / logging keys must not count as a config difference
    dppo = make_run(base / "a", "dppo", 0, t, overrides=("backend.state_dir=/tmp/x", "logger.group=g1"))
    grpo = make_run(base / "b", "grpo", 0, b, overrides=("logger.group=g2",))
    out = compare([dppo, grpo], n_bootstrap=0, make_plots=False)
    assert out["acc_treatment"] == pytest.approx(t.mean()) and out["acc_baseline"] == pytest.approx(b.mean())
    assert out["config_diff"] == [] and out["bootstrap_low"] is None
    assert out["output_dir"] == str(base.resolve()) and (base / "compare.json").is_file()
    # one run per arm on right / wrong scores: `auto` decides with exact McNemar
    m = out["methods"]["mcnemar_exact"]
    assert out["decision"]["method"] == "mcnemar_exact"
    assert out["verdict"] == pvalue_verdict(m["b_items"], m["c_items"], m["p"], 0.05)


def test_config_differences_respects_ignore_list():
    a = {"loss": {"name": "grpo"}, "seed": 0, "run_name": "x", "logger": {"group": "a"},
         "backend": {"state_dir": "/a", "micro_batch_size": 8}, "optimizer": {"lr": 1e-4}}
    b = {"loss": {"name": "dppo", "delta": 0.1}, "seed": 1, "run_name": "y", "logger": {"group": "b"},
         "backend": {"state_dir": "/b", "micro_batch_size": 4}, "optimizer": {"lr": 1e-4}, "new": 1}
    assert config_differences(a, b) == [("backend.micro_batch_size", 8, 4), ("new", "<absent>", 1)]
    assert "loss" in IGNORED_CONFIG_KEYS and "experiment" not in IGNORED_CONFIG_KEYS


# ----------------------------------------------------------------------------- bad input
def _sentinel(sweep: Path) -> bytes:
    data = b'{"sentinel": true}\n'
    (sweep / "compare.json").write_bytes(data)
    return data


def test_cli_missing_eval_file_fails_and_keeps_old_report(tmp_path):
    sweep, _ = make_sweep(tmp_path)
    old = _sentinel(sweep)
    (sweep / "1" / "eval" / f"{EVAL}.jsonl").unlink()
    proc = _cli(str(sweep))
    assert proc.returncode != 0 and proc.stdout == ""
    assert "dppo_seed0" in proc.stderr and f"eval/{EVAL}.jsonl" in proc.stderr and "missing" in proc.stderr
    assert (sweep / "compare.json").read_bytes() == old
    assert not (sweep / "compare.md").exists() and not (sweep / "compare_plots").exists()


def test_cli_other_experiment_refused_unless_allowed(tmp_path, capsys):
    rng = np.random.default_rng(9)
    t, b = _arms(rng, 0.6, 0.5)
    base = tmp_path / "runs"
    dppo = make_run(base / "a", "dppo", 0, t, overrides=("optimizer.lr=0.001",))
    cfg = yaml.safe_load((dppo / "config.yaml").read_text())
    cfg["experiment"] = "other"  # as written by a run of `+experiment=other`
    (dppo / "config.yaml").write_text(yaml.safe_dump(cfg))
    grpo = make_run(base / "b", "grpo", 0, b)
    proc = _cli(str(dppo), str(grpo))
    assert proc.returncode != 0
    assert "configs differ outside the `loss` group" in proc.stderr
    assert "experiment: 'default'" in proc.stderr and "'other'" in proc.stderr
    assert "optimizer.lr" in proc.stderr
    assert not (base / "compare.json").exists()

    assert main([str(dppo), str(grpo), "--allow-config-diff", "--bootstrap", "0", "--no-plots", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any(d.startswith("experiment:") for d in out["config_diff"])
    assert "--allow-config-diff" in (base / "compare.md").read_text()


@pytest.mark.parametrize("problem", ["missing_index", "other_questions"])
def test_mismatched_item_sets_refused(tmp_path, capsys, problem):
    rng = np.random.default_rng(3)
    t, b = _arms(rng, 0.6, 0.5)
    base = tmp_path / "runs"
    if problem == "missing_index":
        recs = _records(t[:-1])
    else:
        recs = _records(t, sha=lambda i: _sha(i + 1000 * (i == 17)))
    dppo = make_run(base / "a", "dppo", 0, t, records=recs)
    grpo = make_run(base / "b", "grpo", 0, b)
    old = _sentinel(base)
    assert main([str(dppo), str(grpo)]) == 2
    err = capsys.readouterr().err
    assert "item sets differ" in err
    assert ("indices only in grpo_seed0: [199]" in err) if problem == "missing_index" else ("[17]" in err)
    assert (base / "compare.json").read_bytes() == old


def test_a_loss_setting_both_arms_have_must_match_between_arms(tmp_path):
    """Only the loss function may differ: the token aggregation (a key of both loss configs) may not."""
    rng = np.random.default_rng(5)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t, overrides=("loss.aggregation=token_mean",))
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    with pytest.raises(CompareError, match=r"loss\.aggregation: 'token_mean' \(dppo_seed0\) vs 'sum' "
                                           r"\(grpo_seed0\): a setting both losses have differs"):
        compare([dppo, grpo], make_plots=False, out=tmp_path / "out")
    for run, path in ((dppo, "two_pass"), (grpo, "one_pass")):  # the non-sum aggregation runs two-pass
        rows = (run / "metrics.jsonl").read_text().splitlines()
        rows[0] = json.dumps({**json.loads(rows[0]), "loss/path": path})
        (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "out", allow_config_diff=True)
    assert any(d.startswith("loss.aggregation") for d in out["config_diff"])
    assert any("different paths" in n and "'dppo_seed0': 'two_pass'" in n for n in out["notes"])


def test_sweep_structure_errors(tmp_path):
    sweep, _ = make_sweep(tmp_path, seeds=(0, 1))
    # the dppo arm's loss must not change between seeds
    other = tmp_path / "other"
    make_run(other, "dppo", 1, np.ones(N, bool), overrides=("loss.delta=0.3",))
    (sweep / "3" / "config.yaml").write_text((other / "config.yaml").read_text())
    with pytest.raises(CompareError, match=r"loss\.delta: 0\.15 .*0\.3 .*loss differs between seeds"):
        compare([sweep], make_plots=False)
    # a seed without its partner arm
    import shutil

    shutil.rmtree(sweep / "3")
    (sweep / "arms.json").unlink()
    with pytest.raises(CompareError, match="seed 1 has no 'dppo' run to pair with grpo_seed1"):
        compare([sweep], make_plots=False)
    # arms.json names a job whose folder is gone
    (sweep / "arms.json").write_text(json.dumps({str(i): f"arm{i}" for i in range(4)}))
    with pytest.raises(CompareError, match=r"lists job\(s\) \['3'\] \(\['arm3'\]\).*did those runs fail"):
        compare([sweep], make_plots=False)
    # treatment == baseline, and a run of a third loss name
    with pytest.raises(CompareError, match="both 'grpo'"):
        compare([sweep], treatment="grpo", baseline="grpo", make_plots=False)
    with pytest.raises(CompareError, match="no run has the treatment arm 'ppo'"):
        compare([sweep / "0", sweep / "2"], treatment="ppo", make_plots=False)
    assert not (sweep / "compare.json").exists()


def test_arms_on_different_loss_paths_are_refused_unless_allowed(tmp_path):
    """backend.loss_path=auto may fall back to two passes in one arm only: compare refuses such a pair."""
    rng = np.random.default_rng(6)
    t, b = _arms(rng, 0.6, 0.5)
    dppo, grpo = make_run(tmp_path / "d", "dppo", 0, t), make_run(tmp_path / "g", "grpo", 0, b)
    for run, path in ((dppo, "two_pass"), (grpo, "one_pass")):
        rows = (run / "metrics.jsonl").read_text().splitlines()
        rows[0] = json.dumps({**json.loads(rows[0]), "loss/path": path})
        (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(CompareError, match=r"different paths .*'dppo_seed0': 'two_pass'.*--allow-mixed-loss-paths"):
        compare([dppo, grpo], make_plots=False, out=tmp_path / "out")
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "out", allow_mixed_loss_paths=True)
    assert any("different paths" in n for n in out["notes"])


def test_arms_run_with_different_thread_counts_are_named(tmp_path):
    """A joblib worker runs on one thread, a plain run on all cores: the arms' last bits then differ, which a
    reader of the verdict should know (a rerun of one would not reproduce the other's numbers)."""
    rng = np.random.default_rng(6)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t)
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "same")
    assert not any("thread counts" in n for n in out["notes"])
    info = json.loads((dppo / "run_info.json").read_text())
    (dppo / "run_info.json").write_text(json.dumps({**info, "torch_threads": info["torch_threads"] + 1}))
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "differ")
    assert any("different torch thread counts" in n and "backend.num_threads" in n for n in out["notes"])


def _engine(dtype: str, **choices) -> dict:
    """A run_info.json `engine` record as this build writes it: the resolved dtypes, how `auto` was decided
    and the plan's choices."""
    return {"sampler_dtype": dtype, "train_dtype": dtype, "auto": "measured: bf16 GEMMs 1.96x as fast",
            "kernels": "native (cc -O3)", "cpu": "avx2,avx512f,avx512_bf16", "decode_attention": True,
            "sampler_rows": True, "onednn_packing": True, "head_inputs": "float32", "train_rows": True,
            "train_head_inputs": "float32", "train_packed_weights": False,
            "train_packing": "measured: packed training GEMMs 1.05x as fast as F.linear", **choices}


def _older_records(dtype: str) -> dict:
    """The records a run of an older build wrote: the dtypes and reasons in `precision`, beside an `engine`
    record of fewer fields."""
    newer = ("auto", "train_packing", "train_head_inputs")
    engine = {k: v for k, v in _engine(dtype).items() if k not in newer}
    return {"engine": engine, "precision": {"sampler_dtype": dtype, "train_dtype": dtype, "auto": "measured",
                                            "train_packed_weights": False, "train_packing": "measured",
                                            "native_kernels": "native (cc -O3)"}}


def _set_info(run: Path, **fields) -> None:
    info = {k: v for k, v in json.loads((run / "run_info.json").read_text()).items()
            if k not in ("engine", "precision")}
    (run / "run_info.json").write_text(json.dumps({**info, **fields}))


def test_arms_at_different_precision_cpu_or_torch_are_noted_and_precision_refused(tmp_path, capsys):
    """run_info.json records the engine's resolved precision, the CPU model and the torch version. One arm
    in bf16 on an AMX CPU, the other (a run of an older build, its dtypes in a `precision` record) in fp32 on
    an AVX2 one: refused (the arithmetic differs beyond the last bits); allowed with --allow-config-diff,
    with a note naming each difference."""
    rng = np.random.default_rng(7)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t)
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    for run, rec, cpu, torch_v in ((dppo, {"engine": _engine("bfloat16")}, "AMD EPYC 9R14", "2.13.0"),
                                   (grpo, _older_records("float32"), "Intel Xeon", "2.12.1")):
        info = json.loads((run / "run_info.json").read_text())
        _set_info(run, **rec, cpu=cpu, versions={**info.get("versions", {}), "torch": torch_v})
    assert main([str(dppo), str(grpo), "--no-plots", "--no-wandb", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "different resolved precisions" in err and "dppo_seed0" in err and "grpo_seed0" in err
    assert not (tmp_path / "x").exists()
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "allowed", allow_config_diff=True)
    for what, a, b in (("precision", "bfloat16", "float32"), ("cpu", "AMD EPYC 9R14", "Intel Xeon"),
                       ("torch", "2.13.0", "2.12.1")):
        assert any(f"different {what}" in n and a in n and b in n for n in out["notes"]), what
    # the same precision, another CPU: compared, with the note
    info = json.loads((grpo / "run_info.json").read_text())
    _set_info(grpo, **_older_records("bfloat16"), cpu=info["cpu"], versions=info["versions"])
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "cpu")
    assert any("different cpu" in n for n in out["notes"]) and not any("different precision" in n for n in out["notes"])
    # the same plan recorded by both builds: no engine note (a field only the newer build records is no
    # difference)
    assert not any("engine plans" in n for n in out["notes"]), out["notes"]


def test_precision_is_read_from_the_engine_record(tmp_path, capsys):
    """Runs of this build keep the resolved dtypes in `engine` only: arms whose engine records name different
    dtypes are refused as different precisions, whatever else the records say."""
    rng = np.random.default_rng(9)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t)
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    _set_info(dppo, engine=_engine("bfloat16"))
    _set_info(grpo, engine=_engine("float32"))
    assert main([str(dppo), str(grpo), "--no-plots", "--no-wandb", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "different resolved precisions" in err and "'sampler_dtype': 'float32'" in err
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "allowed", allow_config_diff=True)
    assert any("different precision" in n for n in out["notes"])
    assert not any("engine plans" in n for n in out["notes"]), out["notes"]  # the dtypes are noted once


def test_arms_with_different_engine_plans_are_noted(tmp_path):
    """Arms whose engine plans differ (one with PAIREDRL_TORCH_OPS=decode_attention) compute other
    summation orders: compared, with a note naming the choices that differ; identical plans give none, even
    where `auto` and the training packing were decided for other reasons (a forced precision, a timing)."""
    rng = np.random.default_rng(8)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t)
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    _set_info(dppo, engine=_engine("float32"))
    _set_info(grpo, engine=_engine("float32", auto="PAIREDRL_AUTO_PRECISION=float32",
                                   train_packing="PAIREDRL_TRAIN_PACKING=0"))
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "same")
    assert not any("engine plans" in n for n in out["notes"]), out["notes"]
    # the sampler's mismatch knobs and draw are config values (the config diff names them), not plan choices
    _set_info(grpo, engine=_engine("float32", sampler_quant="int4", sampler_logit_noise=0.5,
                                   sampling_coupling="gumbel"))
    _set_info(dppo, engine=_engine("float32", sampler_quant="none", sampler_logit_noise=0.0,
                                   sampling_coupling="inverse_cdf"))
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "knobs")
    assert not any("engine plans" in n for n in out["notes"]), out["notes"]
    _set_info(dppo, engine=_engine("float32"))
    _set_info(grpo, engine=_engine("float32", decode_attention=False, sampler_rows=False,
                                   auto="PAIREDRL_AUTO_PRECISION=float32"))
    out = compare([dppo, grpo], make_plots=False, out=tmp_path / "differ")
    note = [n for n in out["notes"] if "different engine plans" in n]
    assert len(note) == 1 and "decode_attention, sampler_rows:" in note[0], out["notes"]
    assert "dppo_seed0 {decode_attention=True, sampler_rows=True}" in note[0]
    assert "grpo_seed0 {decode_attention=False, sampler_rows=False}" in note[0]
    assert not any("different precision" in n for n in out["notes"])


def test_cli_prints_the_verdict_lines_notes_and_paths(tmp_path, capsys):
    """What a person reads first: the verdict with its scope, estimate and the rule's interval, the rule,
    notes, the paths; --json prints compare.json; bad input exits with 2 and writes nothing."""
    sweep, _ = make_sweep(tmp_path, seeds=(0, 1))
    assert main([str(sweep), "--no-plots", "--no-wandb", "--bootstrap", "0"]) == 0
    text = capsys.readouterr().out
    res = json.loads((sweep / "compare.json").read_text())
    lines = text.splitlines()
    assert lines[0].startswith(f"{res['verdict']} (this training procedure): dppo vs grpo: ")
    assert f"t over seeds estimate {100 * res['estimate']:+.2f} pts (95% interval [{100 * res['ci_low']:+.2f} pts, " \
           f"{100 * res['ci_high']:+.2f} pts])" in lines[0]
    assert lines[1].startswith("rule: Student t 95% interval over seeds") and "auto -> seed_t (2 seeds per arm)" in lines[1]
    assert f"compare.md: {sweep / 'compare.md'}" in lines and f"compare.json: {sweep / 'compare.json'}" in lines
    assert len(text) < 2000 and "{" not in text
    assert main([str(sweep), "--no-plots", "--no-wandb", "--bootstrap", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdicts"] == res["verdicts"]
    old = _sentinel(sweep)
    assert main([str(sweep), "--baseline", "cispo", "--override-decision", "--no-plots", "--no-wandb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the baseline 'cispo'" in err and "['dppo', 'grpo']" in err
    assert (sweep / "compare.json").read_bytes() == old


def test_wandb_compare_run_carries_each_verdict_with_its_scope(tmp_path, monkeypatch):
    """The compare run (wandb offline, the real library) holds the headline and the scope of each verdict in
    its summary, and the verdict table's rows carry the scope column of the rule."""
    from wandb_records import offline_runs

    from eval.wandb_log import log_compare

    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep, _ = make_sweep(tmp_path, seeds=(0, 1), overrides=("logger=wandb", "logger.mode=offline"))
    res = compare([sweep], n_bootstrap=0, make_plots=False)
    log_compare(res)
    (cr,) = offline_runs(sweep)
    assert cr.summary["compare/headline/dppo"] == res["headline"]
    assert cr.summary["compare/headline/dppo"].startswith(f"{res['verdict']} (this training procedure): dppo vs grpo")
    assert cr.summary["compare/verdict_scope/dppo"] == "across_seeds" == cr.summary["compare/verdict_scope"]
    (row,) = [h for h in cr.history if "compare/verdict" in h]
    table = cr.table(row["compare/verdict"])
    assert [v["scope"] for v in table] == ["seed 0", "seed 1", "combined"]
    assert table[-1]["verdict_scope"] == "across_seeds" and table[-1]["verdict"] == res["verdict"]
    assert table[0]["verdict"] is None  # one seed pair has no verdict under a seed-level rule


def test_run_report_states_the_scope_of_the_start_vs_final_verdict(tmp_path):
    """eval.report's paired start-vs-final result is an item-level verdict about one run's two checkpoints
    (initial and final weights): the report and the record say so."""
    from eval.run_report import render_run_markdown

    final = np.zeros(N, bool)
    final[:120] = True
    start = np.zeros(N, bool)
    start[:40] = True
    paired = paired_compare(final, start, n_bootstrap=0)
    assert paired["verdict"] == "validated" and paired["verdict_scope"] == "fixed_checkpoints"
    md = render_run_markdown(tmp_path, {"arm": "grpo_seed0"}, {"eval_vs_start": paired}, [], [], {}, [])
    assert "Paired Hoeffding verdict: **validated** (these checkpoints: the final weights against the initial" \
        in md


def test_a_second_switch_beside_the_loss_is_one_error_line_naming_the_runs(tmp_path, capsys):
    """loss=grpo,dppo and another optimizer.lr in one arm: two switches at once. One line on stderr, exit 2,
    naming the key, both values and both runs; nothing written."""
    rng = np.random.default_rng(8)
    t, b = _arms(rng, 0.6, 0.5)
    dppo = make_run(tmp_path / "d", "dppo", 0, t, overrides=("optimizer.lr=0.001", "optimizer.beta1=0.8"))
    grpo = make_run(tmp_path / "g", "grpo", 0, b)
    assert main([str(dppo), str(grpo), "--no-plots", "--no-wandb", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer.lr: 0.0002" in err and "0.001" in err and "optimizer.beta1" in err
    assert str(dppo) in err and str(grpo) in err
    assert not (tmp_path / "x").exists()
