"""Standalone greedy eval of a saved checkpoint: `python -m eval.run checkpoint=<path> eval=gsm8k_test`.

`checkpoint` is a run folder (its checkpoint.json and config.yaml are used, so the model and env
match the run) or a backend state path (tinker://...). Results go to <run>/eval/ for a run folder,
else to the Hydra output folder."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from trainer.config.compose import CONF_DIR, HydraEntry
from trainer.config.schema import register_configs

register_configs()
log = logging.getLogger("pairedrl.eval")
ENTRY = HydraEntry()


def _typed(group: str, node: object) -> object:
    """The run's group as its option's typed node (the root config types each group by its schema, so a
    plain mapping cannot be assigned over it); the option is the schema whose `name` the group states."""
    from trainer.config.schema import GROUP_SCHEMAS

    options = list(GROUP_SCHEMAS.get(group, {}).values())
    if not options or not isinstance(node, DictConfig):
        return node
    named = [cls for cls in options if getattr(cls, "name", None) == node.get("name")]
    cls = named[0] if named else options[0] if len(options) == 1 else None
    return node if cls is None else OmegaConf.merge(OmegaConf.structured(cls), node)


def _resolve_checkpoint(cfg: DictConfig) -> tuple[str, Path | None, DictConfig]:
    from trainer.checkpoint import load_checkpoint
    from trainer.setup import fail

    ck = cfg.checkpoint
    if not ck:
        fail("checkpoint=<run folder or tinker:// path> is required")
    p = Path(str(ck))
    if p.is_dir():
        info = load_checkpoint(p)
        if info is None:
            fail(f"{p} has no checkpoint.json (not a run folder with a saved checkpoint)")
        run_cfg = OmegaConf.load(p / "config.yaml")
        # the run's model/env/backend, the command line's eval settings; each group is replaced, not merged:
        # the run's option (env=gsm8k) may have other keys than the default's typed node (env=arithmetic)
        merged = cfg.copy()
        for k in ("model", "env", "backend", "seed"):
            if k in run_cfg:
                OmegaConf.update(merged, k, _typed(k, run_cfg[k]), merge=False)
        return info.tinker_path, p, merged
    if not str(ck).startswith("tinker://"):
        fail(f"checkpoint={ck!r} is neither a run folder nor a tinker:// path")
    return str(ck), None, cfg


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    ENTRY.composed()
    from hydra.core.hydra_config import HydraConfig

    from eval.greedy import greedy_eval_budgets, run_greedy_eval
    from trainer.backends import build_service_client
    from trainer.config.schema import ConfigError, validate
    from trainer.retry import RetryPolicy
    from trainer.setup import build_components, eval_task, fail

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    path, run_dir, cfg = _resolve_checkpoint(cfg)
    try:
        validate(cfg)
    except ConfigError as e:
        fail(f"config: {e}")
    if cfg.eval.name == "none":
        fail("eval=none: choose an eval (eval=gsm8k_test or eval=arithmetic)")
    out_root = run_dir or Path(HydraConfig.get().runtime.output_dir)
    sc = build_service_client(cfg, out_root)
    _, renderer, task = build_components(cfg)
    etask = eval_task(cfg, renderer, task)
    retry = RetryPolicy.from_config(cfg.retry)
    tc = retry.call("load_state", lambda: sc.create_training_client_from_state(path).result())
    sampler = retry.call("sampling_client", lambda: tc.save_weights_and_get_sampling_client().result())
    out_path = out_root / "eval" / f"{cfg.eval.name}.jsonl"
    if out_path.exists():  # never overwrite the run's own eval: write beside it
        out_path = out_path.with_name(f"{cfg.eval.name}_standalone_{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    summary = run_greedy_eval(etask, etask.test_problems(cfg.eval.n_examples), sampler,
                              **greedy_eval_budgets(cfg), retry=retry, out_path=out_path,
                              extra={"name": cfg.eval.name, "checkpoint": path})
    print(f"{cfg.eval.name}: accuracy {summary['accuracy']:.4f} "
          f"[{summary['wilson_low']:.4f}, {summary['wilson_high']:.4f}] n={summary['n']} -> {out_path}")
    return float(summary["accuracy"])


if __name__ == "__main__":
    # Hydra's decorated main returns None whatever the task returned; a failure exits through SystemExit
    ENTRY.run(main)
