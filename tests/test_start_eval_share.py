"""The initial-weights eval of a sweep: computed once per model, eval set and engine, reused by the sweep's
other runs (recorded as reused), recomputed when anything its numbers depend on changes."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf
from runs import TINY, run_train

from eval.during_training import key_sha, start_eval_key
from trainer.config.compose import run_config
from trainer.run_info import resolved_config_dict

INFO = {"precision": {"sampler_dtype": "float32"}, "engine": {"kernels": "native"}, "torch_threads": 2,
        "cpu": "some CPU", "git": {"rev": "abc", "dirty": False}, "versions": {"torch": "2.13.0"}}


def _key(overrides: list[str], info: dict = INFO) -> str:
    cfg = run_config(overrides)
    return key_sha(start_eval_key(resolved_config_dict(cfg), info))


def test_the_key_follows_what_changes_the_numbers_and_ignores_the_arm():
    base = _key([])
    # the arms and seeds of a sweep, and when the eval runs, share it
    for same in (["loss=dppo"], ["seed=3"], ["optimizer.lr=0.1"], ["eval.every=4"], ["schedule.num_steps=2"]):
        assert _key(same) == base, same
    for other in (["eval.n_examples=50"], ["eval.max_tokens=8"], ["env.seed=1"],
                  ["backend.sampler_dtype=float32"], ["model.max_seq_len=256"], ["model=tiny_random"]):
        assert _key(other) != base, other
    for k, v in (("precision", {"sampler_dtype": "bfloat16"}), ("engine", {"kernels": "torch path"}),
                 ("torch_threads", 1), ("cpu", "another CPU"), ("git", {"rev": "def", "dirty": False})):
        assert _key([], {**INFO, k: v}) != base, k


def _summary(run: Path) -> dict:
    return json.loads((run / "eval" / "gsm8k_test_start.summary.json").read_text())


def test_a_sweep_evaluates_the_initial_weights_once_and_a_changed_key_recomputes(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*TINY, "eval.at_start=true", "schedule.num_steps=1", "report.enabled=false"]
    p = run_train(["--multirun", *args, "seed=0,1", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    first, second = _summary(sweep / "0"), _summary(sweep / "1")
    assert first["reused"] is False and second["reused"] is True
    assert second["reused_from"] == str(sweep / "initial_eval" / first["key_sha"])
    assert (sweep / "0" / "eval" / "gsm8k_test_start.jsonl").read_text() == \
        (sweep / "1" / "eval" / "gsm8k_test_start.jsonl").read_text()
    assert second["config_hash"] != first["config_hash"]  # each run's own (a resume keeps it)
    results = [json.loads((sweep / n / "result.json").read_text()) for n in ("0", "1")]
    assert [r["start_eval"]["reused"] for r in results] == [False, True]
    assert "reused from" in p.stdout and p.stdout.count("initial-weights eval: accuracy") == 2
    # the same sweep folder, another eval budget: another key, evaluated afresh
    p = run_train(["--multirun", *args, "seed=2", "eval.max_tokens=4", f"hydra.sweep.dir={sweep}",
                   "hydra.sweep.subdir=other"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    third = _summary(sweep / "other")
    assert third["reused"] is False and third["key_sha"] != first["key_sha"]
    assert sorted(x.name for x in (sweep / "initial_eval").iterdir() if x.is_dir()) == \
        sorted([first["key_sha"], third["key_sha"]])
    assert OmegaConf.load(sweep / "other" / "config.yaml").eval.max_tokens == 4
