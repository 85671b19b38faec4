"""Compose configs outside `@hydra.main`: for `--multirun --cfg`, preflight, eval and tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import GROUP_SCHEMAS, Config, config_dict, register_configs, validate

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def compose_config(overrides: list[str] | None = None, conf_dir: Path | None = None,
                   return_hydra_config: bool = False) -> DictConfig:
    """Compose `conf/config.yaml` with command-line style overrides (no run folder is made)."""
    register_configs()
    conf_dir = Path(conf_dir or CONF_DIR)
    if not (conf_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"config folder not found: {conf_dir} (set it with the repo's conf/)")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides or []),
                       return_hydra_config=return_hydra_config)


def run_config(overrides: list[str] | None = None, conf_dir: Path | None = None) -> Config:
    """The typed, validated Config of `conf/config.yaml` with `overrides` (what the entry points pass down;
    tests and bench scripts build their runs with it)."""
    return validate(compose_config(overrides, conf_dir))


def arm_config(config: Config, loss: str) -> Config:
    """`config` with its loss group switched to the option `loss` (the same object when it already is that
    loss): the option's own settings, its interpolations (`norm_length: ${sampling.max_tokens}`, DPPO's
    mode-dependent delta) resolved against this config, as the arm would compose on the command line."""
    if config.loss.name == loss:
        return config
    node = OmegaConf.create(config_dict(config))
    node.loss = compose_config([f"loss={loss}"]).loss
    return dataclasses.replace(config, loss=OmegaConf.to_object(node.loss))


def _typed_group(group: str, node: object) -> object:
    """A run's group as its option's typed node (the root config types each group by its schema, so a
    plain mapping cannot be assigned over it); the option is the schema whose `name` the group states."""
    options = list(GROUP_SCHEMAS.get(group, {}).values())
    if not options or not isinstance(node, DictConfig):
        return node
    named = [cls for cls in options if getattr(cls, "name", None) == node.get("name")]
    cls = named[0] if named else options[0] if len(options) == 1 else None
    return node if cls is None else OmegaConf.merge(OmegaConf.structured(cls), node)


def with_run_groups(cfg: DictConfig, run_config: Path, groups: tuple[str, ...]) -> DictConfig:
    """`cfg` with `groups` taken from a run folder's config.yaml (`python -m eval.run checkpoint=<run>`: the
    run's model, env, backend and seed, the command line's eval settings). Each group is replaced, not
    merged: the run's option (env=gsm8k) may have other keys than the default's typed node
    (env=arithmetic)."""
    run_cfg = OmegaConf.load(run_config)
    merged = cfg.copy()
    for k in groups:
        if k in run_cfg:
            OmegaConf.update(merged, k, _typed_group(k, run_cfg[k]), merge=False)
    return merged


def sweep_jobs(overrides: list[str]) -> list[list[str]]:
    """Expand sweep syntax (`loss=grpo,dppo`) into one override list per job, in Hydra's order."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [job for batch in batches for job in batch]


def print_sweep_configs(conf_dir: Path, argv: list[str]) -> int:
    """Print each job's composed config for `--multirun ... --cfg job|all`."""
    args = [a for a in argv if a not in ("--multirun", "-m")]
    which = "job"
    for flag in ("--cfg", "-c"):
        if flag in args:
            i = args.index(flag)
            if i + 1 < len(args) and args[i + 1] in ("job", "all", "hydra"):
                which = args[i + 1]
                del args[i: i + 2]
            else:
                del args[i]
    # sweep axes an experiment sets in `hydra.sweeper.params` (e.g. loss: grpo,dppo) expand like the
    # command line's; a key given on the command line wins, as in Hydra's BasicSweeper
    first = sweep_jobs(args)[0]
    params = compose_config(first, conf_dir, return_hydra_config=True).hydra.sweeper.get("params") or {}
    given = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a}
    args = args + [f"{k}={v}" for k, v in params.items() if k not in given]
    for num, job in enumerate(sweep_jobs(args)):
        cfg = compose_config(job, conf_dir, return_hydra_config=(which != "job"))
        print(f"# ---- job {num}: {' '.join(job)}")
        print(OmegaConf.to_yaml(cfg if which != "hydra" else cfg.hydra))
    return 0


class HydraEntry:
    """Runs a `@hydra.main` function so that a config Hydra cannot compose (an unknown key, a value of the
    wrong type, a missing group option) exits 2, as every bad input of the project does; Hydra itself
    exits 1 for it, as for an error the task raises, which keeps its code. The task calls `composed()`
    first thing, so a SystemExit(1) before it came from the composition."""

    def __init__(self) -> None:
        self._composed = False

    def composed(self) -> None:
        self._composed = True

    def run(self, main: Callable[[], Any]) -> None:
        self._composed = False
        try:
            main()
        except SystemExit as e:
            if e.code == 1 and not self._composed:
                raise SystemExit(2) from None
            raise
