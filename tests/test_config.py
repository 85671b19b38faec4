"""Config tree: composition, arms that differ only in the loss, and bad overrides failing by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from trainer.config.compose import compose_config, run_config, sweep_jobs
from trainer.config.schema import Config, ConfigError, validate
from trainer.run_info import batch_arithmetic

ROOT = Path(__file__).resolve().parents[1]


def _resolved(overrides):
    cfg = compose_config(overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def test_default_composes_and_validates():
    cfg = validate(compose_config([]))
    assert isinstance(cfg, Config)
    assert cfg.model.name == "smollm2_135m" and cfg.backend.name == "local" and cfg.env.name == "arithmetic"
    assert type(cfg.loss).__name__ == "GRPOLossConfig" and type(cfg.backend).__name__ == "LocalBackendConfig"
    assert type(cfg.env).__name__ == "ArithmeticEnvConfig" and type(cfg.report).__name__ == "ReportConfig"


# every option of every group, and each experiment with each backend: config_dict must hold for all of them
_OPTIONS = sorted({f"{g}={p.stem}" for g in ("model", "loss", "schedule", "env", "eval", "backend", "logger")
                   for p in (ROOT / "conf" / g).glob("*.yaml")})
_EXPERIMENTS = sorted(f"+experiment={p.stem}" for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


_MIXED = ["loss=dppo", "loss.mode=binary_kl", "sampling.max_tokens=7", "decision.looks=[3,6]",
          "preflight.planned_models=[a,b]", "backend.faults.p_sample=0.5", "run_name=x",
          "+backend.api_key=abcd1234", "+extra.key=1"]  # `+` keys: kept where the composed config has them


@pytest.mark.parametrize("overrides", [[o] for o in _OPTIONS] + [_MIXED]
                         + [[e, b] for e in _EXPERIMENTS for b in ("backend=local", "backend=tinker")])
def test_the_typed_config_writes_the_composed_config_byte_for_byte(overrides):
    """config.yaml, the resume hash, the plan hash and wandb's config are written from the typed Config
    (`config_dict`); it must be the composed config's own resolved container, key for key and in order, or
    the runs written before would no longer resume, or compare against new ones."""
    from trainer.config.digest import config_hash
    from trainer.config.schema import config_dict, config_yaml

    composed = compose_config(overrides)
    typed = config_dict(validate(composed))
    plain = OmegaConf.to_container(composed, resolve=True)
    assert typed == plain and list(_walk_keys(typed)) == list(_walk_keys(plain))
    assert config_yaml(typed) == OmegaConf.to_yaml(OmegaConf.create(plain))
    assert config_hash(typed) == config_hash(plain)


def _walk_keys(d, prefix=""):
    for k, v in d.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _walk_keys(v, f"{prefix}{k}.")


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


def test_the_local_testbed_composes_its_recorded_regime():
    """The regime the first answer was measured in (docs/lab-notes.md), composed as `+experiment=local_testbed`
    gives it: every testbed run is `slow`, so without this the quick suite never reads the experiment's
    schedule, and an edit to it (constant groups trained, one update per batch) would change the regime
    under the recorded answer unseen. The lr falls linearly from 1e-3 to 1e-4 over all 96 updates."""
    from trainer.lr_schedule import lr_at

    for arm in ("grpo", "dppo"):
        cfg = validate(compose_config(["+experiment=local_testbed", f"loss={arm}"]))
        s = cfg.schedule
        assert cfg.experiment == "local_testbed" and cfg.optimizer.lr == 1e-3 and cfg.env.format_coef == 0.1
        assert (s.num_steps, s.groups_per_batch, s.group_size, s.updates_per_batch) == (12, 4, 8, 8)
        assert s.drop_constant_groups is True and s.save_every == 0
        assert (s.lr_schedule, s.min_lr_ratio, s.warmup_steps) == ("linear", 0.1, 0)
        updates = s.num_steps * s.updates_per_batch
        lrs = [lr_at(u, updates, cfg.optimizer.lr, s.lr_schedule, s.warmup_steps, s.min_lr_ratio)
               for u in (0, updates)]
        assert lrs == pytest.approx([1e-3, 1e-4], rel=1e-12)
    assert type(cfg.loss).__name__ == "DPPOLossConfig" and cfg.loss.delta == 0.15


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
    b = batch_arithmetic(run_config(["+experiment=dppo_vs_grpo"]))
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
    ("backend.sampler_quant=int3", "backend.sampler_quant"), ("backend.sampler_logit_noise=-0.1",
                                                              "backend.sampler_logit_noise"),
    ("backend.sampler_logit_noise=nan", "backend.sampler_logit_noise"),
    ("backend.sampler_logit_noise=11", "backend.sampler_logit_noise"),
    ("sampling.coupling=antithetic", "sampling.coupling"),
    ("logger.projcet=x", "projcet"), ("logger.rollouts_per_step=many", "logger.rollouts_per_step"),
    ("logger.mode=sometimes", "logger.mode"),
]


# the overrides Hydra composes (known key, right type) that the schema's bounds then refuse
OUT_OF_BOUNDS = {"model.lora_rank=0", "loss.clip_eps=-1", "optimizer.beta2=1.5", "schedule.updates_per_batch=0",
                 "env.max_digits=9", "eval.every=-1", "backend.sampler_dtype=fp8", "logger.mode=sometimes",
                 "backend.sampler_quant=int3", "backend.sampler_logit_noise=-0.1",
                 "backend.sampler_logit_noise=nan", "backend.sampler_logit_noise=11",
                 "sampling.coupling=antithetic"}


@pytest.mark.parametrize("override,needle", BAD_OVERRIDES)
def test_bad_override_names_the_key(override, needle):
    """An unknown key or a value of the wrong type is refused by composition against the schema; a value
    out of bounds by `validate`'s checks."""
    expected = ConfigError if override in OUT_OF_BOUNDS else ConfigCompositionException
    with pytest.raises(expected) as ei:
        validate(compose_config([override]))
    assert type(ei.value) is expected and needle in str(ei.value)


def test_gumbel_coupling_needs_the_local_engine():
    """A service draws tokens its own way; the Tinker protocol has no field to ask it for Gumbel-max."""
    validate(compose_config(["sampling.coupling=gumbel"]))
    with pytest.raises(ConfigError, match="sampling.coupling=gumbel needs backend=local"):
        validate(compose_config(["backend=tinker", "sampling.coupling=gumbel"]))


def test_the_default_advantage_is_the_cookbooks_group_mean():
    """The default estimator subtracts the group mean (tinker-cookbook's `compute_advantages`); under
    `none`, 0/1 rewards give A >= 0 and no rule's A <= 0 branch ever acts."""
    assert compose_config([]).advantage == "group_mean"
    from dataclasses import fields

    from trainer.config.schema import Config

    assert {f.name: f.default for f in fields(Config)}["advantage"] == "group_mean"


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
    with pytest.raises(MissingConfigException, match="loss"):
        compose_config(["loss=ppo2"])


@pytest.mark.parametrize("override,needle", [
    ("loss.clip_eps=-1", "loss.clip_eps"), ("schedule.updates_per_batch=0", "schedule.updates_per_batch"),
    ("loss.clip_epsilon=0.1", "clip_epsilon"), ("schedule.group_size=abc", "schedule.group_size"),
])
def test_cli_bad_override_exits_nonzero(tmp_path, override, needle):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), override, f"hydra.run.dir={tmp_path}/run"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
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
        return config_hash(resolved_config_dict(run_config(list(overrides))))

    base = h()
    for same in (["eval.every=5"], ["logger=wandb"], ["retry.max_attempts=9"], ["resume=true"]):
        assert h(*same) == base, same
    for other in (["eval.n_examples=50"], ["optimizer.lr=0.001"], ["schedule.num_steps=7"], ["loss=dppo"],
                  ["sampling.max_tokens=9"]):
        assert h(*other) != base, other


# ----------------------------------------------------------------------------- one source of truth
LOSS_OPTIONS = ("grpo", "dppo", "importance_sampling", "cispo", "gspo", "cppo")


@pytest.mark.parametrize("option", LOSS_OPTIONS)
def test_composed_loss_group_equals_the_typed_config_defaults(option):
    """conf/loss/<option>.yaml + its schema compose to the dataclass defaults: the only values that differ
    are the interpolated ones (norm_length = the completion budget, DPPO's delta = the mode's default)."""
    import dataclasses

    from trainer.config.enums import DPPO_DEFAULT_DELTA
    from trainer.config.losses import LOSS_SCHEMAS
    from trainer.losses import build_loss

    config_class = LOSS_SCHEMAS[f"{option}_schema"]
    cfg = compose_config([f"loss={option}"])
    composed = _resolved([f"loss={option}"])["loss"]
    defaults = {f.name: f.default for f in dataclasses.fields(config_class)}
    assert list(composed) == list(defaults)  # same keys, in the dataclass's order
    interpolated = {"norm_length": float(cfg.sampling.max_tokens)}
    if option == "dppo":
        interpolated["delta"] = DPPO_DEFAULT_DELTA[defaults["mode"]]
    for key, value in composed.items():
        assert value == interpolated.get(key, defaults[key]), (option, key, value)
    # the plugin built from the composed group is the plugin at its defaults
    loss = build_loss(validate(cfg).loss)
    assert loss.config == config_class(**interpolated)
    assert repr(loss) == repr(type(loss)())


@pytest.mark.parametrize("option,fields,message", [
    ("grpo", {"cf_dppo_delta": 1.5}, "loss.cf_dppo_delta must be in (0, 1], got 1.5"),
    ("grpo", {"clip_eps_high": 0.0}, "loss.clip_eps_high must be > 0 (inf disables the clip), got 0.0"),
    ("dppo", {"is_cap": 0.5}, "loss.is_cap must be >= 1, got 0.5"),
    ("dppo", {"mode": "binary_kl", "delta_low": -1.0}, "loss.delta_low must be > 0 for binary_kl, got -1.0"),
    ("dppo", {"mode": "topk"}, "loss.mode must be one of ['binary_tv', 'binary_kl'], got 'topk'"),
    ("cispo", {"clip_low_threshold": 2.0}, "loss.clip_low_threshold must be in [0, 1], got 2.0"),
    ("gspo", {"seq_clip_eps_low": -1e-4}, "loss.seq_clip_eps_low must be > 0"),
    ("cppo", {"delta": 1.5}, "loss.delta must be in (0, 1] (a binary-TV threshold), got 1.5"),
    ("cppo", {"w_min": -0.5}, "loss.w_min must be in [0, 1], got -0.5"),
    ("cppo", {"delta_b": 0.0}, "loss.delta_b must be a finite number > 0 (any value >= 1 turns the prefix "
     "budget off), got 0.0"),
    ("importance_sampling", {"aggregation": "mean"}, "loss.aggregation must be one of ['sum', "),
])
def test_bad_loss_bound_fails_with_one_message_naming_the_key(option, fields, message):
    """A bound is stated once: the same check rejects a command-line override (prefixed with the group)
    and the same value given to the plugin in Python (prefixed with the plugin)."""
    from trainer.losses import build_loss

    with pytest.raises(ConfigError) as ei:
        validate(compose_config([f"loss={option}"] + [f"loss.{k}={v}" for k, v in fields.items()]))
    assert message in str(ei.value)
    cls = type(build_loss(run_config([f"loss={option}"]).loss))
    with pytest.raises(ConfigError) as ei:
        cls(**fields)
    assert str(ei.value).startswith(f"{cls.__name__}: ") and message.removeprefix("loss.") in str(ei.value)


def test_cli_bad_loss_bound_exits_2_naming_the_key(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "loss=dppo", "loss.delta=2",
                        f"hydra.run.dir={tmp_path}/run"], check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "error: config: loss.delta must be in (0, 1] for binary_tv, got 2.0" in p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_runtime_enumerations_are_the_config_ones():
    """Each choice list is defined once (trainer.config.enums) and the runtime uses that object."""
    import importlib

    import envs.arithmetic
    import envs.gsm8k
    import envs.tokenizers
    import eval.compare
    import eval.design
    import eval.methods
    import eval.stats
    import trainer.losses.trust_region
    import trainer.preflight.correctness
    from trainer.config import enums, schema

    aggregate = importlib.import_module("trainer.losses.aggregate")  # the package re-exports a function of that name
    assert aggregate.AGGREGATIONS is enums.AGGREGATIONS
    assert aggregate.NEEDS_NORM_LENGTH is enums.NEEDS_NORM_LENGTH
    assert trainer.preflight.correctness.AGGREGATIONS is enums.AGGREGATIONS
    assert trainer.losses.trust_region.DPPO_MODES is enums.DPPO_MODES
    assert envs.tokenizers.TOKENIZER_KINDS is enums.TOKENIZER_KINDS
    assert envs.gsm8k.CONVO_PREFIXES is enums.CONVO_PREFIXES is envs.arithmetic.CONVO_PREFIXES
    assert eval.design.METHODS is eval.methods.DECIDING and eval.methods.DECIDING == enums.DECISION_METHODS
    assert schema.DECISION_METHODS is enums.DECISION_METHODS and schema.LOSS_PATHS is enums.LOSS_PATHS
    assert eval.compare.ENDPOINTS is enums.ENDPOINTS
    # and the schema's messages list the same options the runtime accepts
    with pytest.raises(ConfigError, match=r"model\.tokenizer must be one of " + repr(list(enums.TOKENIZER_KINDS))
                       .replace("[", r"\[").replace("]", r"\]")):
        validate(compose_config(["model.tokenizer=sentencepiece"]))


def test_the_local_engines_defaults_are_the_schemas():
    """`LocalServiceClient` built in code (bench/, a notebook) runs with
    `backend=local`'s defaults: every keyword it shares with `LocalBackendConfig` defaults to the schema's
    value (`auto` precision included), so the two cannot drift apart."""
    import inspect

    from trainer.backends.local import LocalServiceClient
    from trainer.config.schema import LocalBackendConfig

    schema = LocalBackendConfig()
    params = inspect.signature(LocalServiceClient.__init__).parameters
    shared = [n for n in params if n in LocalBackendConfig.__dataclass_fields__ and n not in ("state_dir", "faults")]
    assert {"sampler_dtype", "train_dtype", "micro_batch_size", "max_sample_batch"} <= set(shared)
    assert {n: params[n].default for n in shared} == {n: getattr(schema, n) for n in shared}
    assert schema.sampler_dtype == schema.train_dtype == "auto"


def test_every_arm_reports_the_same_rules_at_default_settings():
    """The counterfactual rules an arm logs default to the other losses' own defaults, so at default
    settings the GRPO, DPPO, IS, CISPO, GSPO and CPPO arms report the same rules."""
    from trainer.config.losses import LOSS_SCHEMAS, RULE_TABLE, rules_owned_by
    from trainer.losses import (
        CISPOLoss,
        CPPOLoss,
        DPPOLoss,
        GRPOLoss,
        GSPOLoss,
        ImportanceSamplingLoss,
        reference,
        trust_region,
    )
    from trainer.losses.trust_region import TrustRegionRules

    arms = (GRPOLoss, DPPOLoss, ImportanceSamplingLoss, CISPOLoss, GSPOLoss, CPPOLoss)
    rules = {cls.__name__: cls().rules for cls in arms}
    assert all(r == TrustRegionRules() for r in rules.values()), rules
    assert reference.DEFAULT_RULES == TrustRegionRules().settings
    # the table: each rule's owner is a loss, its mask a trust_region function, its settings named by owner
    losses = {c.name for c in LOSS_SCHEMAS.values()}
    for spec in RULE_TABLE:
        assert spec.owner in losses and callable(getattr(trust_region, spec.mask))
        assert all(k.startswith(spec.owner + "_") for k, _ in spec.defaults), spec
    assert rules_owned_by(("grpo", "dppo")) == ("dppo_masked", "grpo_clip")
    assert rules_owned_by(("importance_sampling",)) == ()
    assert rules_owned_by(("cppo",)) == ("cppo_masked", "cppo_token_masked", "cppo_budget_masked")
    with pytest.raises(TypeError, match="unknown rule setting"):
        TrustRegionRules(grpo_eps=0.1)


def _ignored_keys_table() -> list[tuple[list[str], dict[str, str]]]:
    """(keys, {list: ignored|hashed|dropped}) per row of the table in trainer.config.ignored_keys."""
    from trainer.config import ignored_keys

    rows: list[tuple[list[str], dict[str, str]]] = []
    for line in (ignored_keys.__doc__ or "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 5 or cells[0] in ("key", "") or set(cells[0]) <= {"-"}:
            continue
        keys = [k.strip() for k in cells[0].split(",") if k.strip()]
        if not cells[1]:  # a continuation line of the row above
            rows[-1][0].extend(keys)
            continue
        rows.append((keys, dict(zip(("resume", "plan", "compare"), cells[1:4]))))
    return rows


def test_ignored_key_lists_do_what_their_table_says():
    """trainer.config.ignored_keys documents, per key, whether a resume, the preflight plan and eval.compare
    ignore it; each claim is checked against the real hash / comparison, and each listed key has a row."""
    import copy
    import inspect

    import eval.compare
    import trainer.checkpoint
    from trainer.config import ignored_keys
    from trainer.preflight import gates

    assert inspect.signature(trainer.checkpoint.config_hash).parameters["ignored"].default \
        is ignored_keys.RESUME_IGNORED_KEYS
    assert gates._PLAN_IGNORED is ignored_keys.PLAN_IGNORED_KEYS
    assert eval.compare.IGNORED_CONFIG_KEYS is ignored_keys.IGNORED_CONFIG_KEYS
    base = _resolved([])

    def changed(key: str) -> dict:
        d = copy.deepcopy(base)
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = "<changed>"
        return d

    def behaviour(key: str) -> dict[str, str]:
        d = changed(key)
        out = {
            "resume": trainer.checkpoint.config_hash(base) == trainer.checkpoint.config_hash(d),
            "plan": gates.plan_hash_of(base) == gates.plan_hash_of(d),
            "compare": eval.compare.config_differences(base, d) == [],
        }
        return {k: "ignored" if v else "hashed" for k, v in out.items()}

    rows = _ignored_keys_table()
    assert len(rows) >= 10
    documented: set[str] = set()
    for keys, claims in rows:
        for key in keys:
            probe = key.replace(".*", ".pilot_steps")
            documented.add(key.removesuffix(".*"))
            got = behaviour(probe)
            for which, claim in claims.items():
                if claim == "dropped":  # Hydra's section: removed before hashing (run_info / plan_hash)
                    continue
                assert got[which] == claim, (key, which, claim)
    for listed in (ignored_keys.RESUME_IGNORED_KEYS + ignored_keys.PLAN_IGNORED_KEYS
                   + ignored_keys.IGNORED_CONFIG_KEYS):
        assert listed in documented, f"{listed} is in an ignored-key list but not in the table"
    # a key in no list is hashed by all three (the checks above are not vacuous)
    assert behaviour("optimizer.lr") == {"resume": "hashed", "plan": "hashed", "compare": "hashed"}
