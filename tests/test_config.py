"""Config tree: composition, arms that differ only in the loss, and bad overrides failing by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trainer.config.compose import compose_config, sweep_jobs
from trainer.config.schema import ConfigError, validate
from trainer.run_info import batch_arithmetic

ROOT = Path(__file__).resolve().parents[1]


def _resolved(overrides):
    cfg = compose_config(overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def test_default_composes_and_validates():
    cfg = compose_config([])
    objs = validate(cfg)
    assert cfg.model.name == "smollm2_135m" and cfg.backend.name == "local" and cfg.env.name == "arithmetic"
    assert type(objs["loss"]).__name__ == "GRPOLossConfig"


def test_arms_differ_only_in_loss_group():
    a = _resolved(["loss=grpo", "seed=0"])
    b = _resolved(["loss=dppo", "seed=0"])
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    assert diff == ["loss"]
    assert a["loss"]["name"] == "grpo" and b["loss"]["name"] == "dppo"


def test_experiment_arms_differ_only_in_loss_group():
    a = _resolved(["+experiment=dppo_vs_grpo", "loss=grpo"])
    b = _resolved(["+experiment=dppo_vs_grpo", "loss=dppo"])
    assert sorted(k for k in a if a[k] != b[k]) == ["loss"]
    assert a["model"]["base_model"] == "Qwen/Qwen3.5-2B" and a["model"]["lora_rank"] == 32
    assert a["optimizer"]["lr"] == 2e-5 and a["optimizer"]["beta2"] == 0.95
    assert a["schedule"]["groups_per_batch"] == 32 and a["schedule"]["group_size"] == 8
    assert a["schedule"]["num_steps"] == 50 and a["schedule"]["updates_per_batch"] == 2
    assert a["env"]["n_examples"] == 1600 and a["sampling"]["max_tokens"] == 512
    assert a["model"]["renderer"] == "qwen3_5_disable_thinking" and a["eval"]["name"] == "gsm8k_test"
    assert b["loss"]["mode"] == "binary_tv" and b["loss"]["delta"] == 0.15


def test_cfg_job_printer_expands_the_experiments_own_sweep_axes(capsys):
    """`--multirun +experiment=dppo_vs_grpo --cfg job` shows both arms (the experiment's
    hydra.sweeper.params), and a command-line axis wins over the experiment's."""
    from trainer.config.compose import CONF_DIR, print_sweep_configs

    print_sweep_configs(CONF_DIR, ["--multirun", "+experiment=dppo_vs_grpo", "--cfg", "job"])
    heads = [x for x in capsys.readouterr().out.splitlines() if x.startswith("# ---- job")]
    assert heads == ["# ---- job 0: +experiment=dppo_vs_grpo loss=grpo",
                     "# ---- job 1: +experiment=dppo_vs_grpo loss=dppo"]
    print_sweep_configs(CONF_DIR, ["--multirun", "+experiment=dppo_vs_grpo", "loss=dppo", "--cfg", "job"])
    heads = [x for x in capsys.readouterr().out.splitlines() if x.startswith("# ---- job")]
    assert heads == ["# ---- job 0: +experiment=dppo_vs_grpo loss=dppo"]


def test_sweep_expansion():
    assert sweep_jobs(["loss=grpo,dppo", "seed=0"]) == [["loss=grpo", "seed=0"], ["loss=dppo", "seed=0"]]


def test_batch_arithmetic():
    cfg = compose_config(["+experiment=dppo_vs_grpo"])
    b = batch_arithmetic(cfg)
    assert b["rollouts_per_step"] == 256 and b["rollouts_per_minibatch"] == 128
    assert b["total_optim_steps"] == 100


# (override, text that must appear in the message): one wrong key, wrong type and out-of-range per group
BAD_OVERRIDES = [
    ("model.lora_rnk=8", "lora_rnk"), ("model.lora_rank=eight", "model.lora_rank"),
    ("model.lora_rank=0", "model.lora_rank"),
    ("loss.clip_epsilon=0.1", "clip_epsilon"), ("loss.clip_eps=wide", "loss.clip_eps"),
    ("loss.clip_eps=-1", "loss.clip_eps"),
    ("optimizer.learning_rate=1", "learning_rate"), ("optimizer.lr=fast", "optimizer.lr"),
    ("optimizer.beta2=1.5", "optimizer.beta2"),
    ("schedule.update_per_batch=2", "update_per_batch"), ("schedule.group_size=abc", "schedule.group_size"),
    ("schedule.updates_per_batch=0", "schedule.updates_per_batch"),
    ("env.n_exampels=5", "n_exampels"), ("env.max_digits=two", "env.max_digits"),
    ("env.max_digits=9", "env.max_digits"),
    ("eval.evry=1", "evry"), ("eval.every=often", "eval.every"), ("eval.every=-1", "eval.every"),
    ("backend.micro_batch=4", "micro_batch"), ("backend.micro_batch_size=big", "backend.micro_batch_size"),
    ("backend.sampler_dtype=fp8", "backend.sampler_dtype"),
    ("logger.projcet=x", "projcet"), ("logger.rollouts_per_step=many", "logger.rollouts_per_step"),
    ("logger.mode=sometimes", "logger.mode"),
]


@pytest.mark.parametrize("override,needle", BAD_OVERRIDES)
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(Exception) as ei:
        validate(compose_config([override]))
    assert needle in str(ei.value)


def test_dppo_delta_follows_the_mode_unless_set():
    """The yaml's delta is the authors' default of the chosen mode (TV 0.15, KL 0.05), resolved into the
    run's config; an explicit override wins."""
    import hydra

    for overrides, expected in ((["loss=dppo"], 0.15), (["loss=dppo", "loss.mode=binary_kl"], 0.05),
                                (["loss=dppo", "loss.mode=binary_kl", "loss.delta=0.2"], 0.2)):
        cfg = compose_config(overrides)
        validate(cfg)
        assert _resolved(overrides)["loss"]["delta"] == expected
        loss = hydra.utils.instantiate(cfg.loss)
        assert loss.delta == loss.delta_low == loss.delta_high == expected


def test_dppo_delta_out_of_range():
    with pytest.raises(ConfigError, match=r"loss\.delta must be in \(0, 1\]"):
        validate(compose_config(["loss=dppo", "loss.delta=2"]))


def test_unknown_group_option_fails():
    with pytest.raises(Exception, match="loss"):
        compose_config(["loss=ppo2"])


@pytest.mark.parametrize("override,needle", [
    ("loss.clip_eps=-1", "loss.clip_eps"), ("schedule.updates_per_batch=0", "schedule.updates_per_batch"),
    ("loss.clip_epsilon=0.1", "clip_epsilon"), ("schedule.group_size=abc", "schedule.group_size"),
])
def test_cli_bad_override_exits_nonzero(tmp_path, override, needle):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), override, f"hydra.run.dir={tmp_path}/run"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode != 0
    assert needle in p.stderr + p.stdout
    # nothing was trained: no metrics or checkpoint written
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_cfg_job_prints_loss():
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--cfg", "job", "loss=dppo"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "name: dppo" in p.stdout and "binary_tv" in p.stdout


def test_cli_multirun_cfg_composes_both_arms():
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--multirun", "loss=grpo,dppo", "seed=0",
                        "--cfg", "job"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("# ---- job") == 2
    assert "name: grpo" in p.stdout and "name: dppo" in p.stdout


def test_resume_hash_ignores_only_keys_that_do_not_change_the_computation():
    from trainer.checkpoint import config_hash
    from trainer.run_info import resolved_config_dict

    def h(*overrides):
        return config_hash(resolved_config_dict(compose_config(list(overrides))))

    base = h()
    for same in (["eval.every=5"], ["logger=wandb"], ["retry.max_attempts=9"], ["resume=true"]):
        assert h(*same) == base, same
    for other in (["eval.n_examples=50"], ["optimizer.lr=0.001"], ["schedule.num_steps=7"], ["loss=dppo"],
                  ["sampling.max_tokens=9"]):
        assert h(*other) != base, other
