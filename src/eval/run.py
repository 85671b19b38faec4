"""Standalone greedy eval of a saved checkpoint: `python -m eval.run checkpoint=<path> eval=gsm8k_test`.

`checkpoint` is a run folder (its checkpoint.json and config.yaml are used, so the model and env
match the run) or a backend state path (tinker://...). Results go to <run>/eval/ for a run folder,
else to the Hydra output folder."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from trainer.config.compose import CONF_DIR, HydraEntry
from trainer.config.schema import register_configs

register_configs()
log = logging.getLogger("pairedrl.eval")
ENTRY = HydraEntry()


def _resolve_checkpoint(checkpoint: str | None) -> tuple[str, Path | None]:
    """(state path, run folder or None) of `checkpoint=`: a run folder's saved checkpoint, or a tinker://
    path."""
    from trainer.checkpoint import load_checkpoint
    from trainer.setup import fail

    if not checkpoint:
        fail("checkpoint=<run folder or tinker:// path> is required")
    p = Path(str(checkpoint))
    if p.is_dir():
        info = load_checkpoint(p)
        if info is None:
            fail(f"{p} has no checkpoint.json (not a run folder with a saved checkpoint)")
        return info.tinker_path, p
    if not str(checkpoint).startswith("tinker://"):
        fail(f"checkpoint={checkpoint!r} is neither a run folder nor a tinker:// path")
    return str(checkpoint), None


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(composed: DictConfig) -> float:
    ENTRY.composed()
    from hydra.core.hydra_config import HydraConfig

    from eval.greedy import greedy_eval_budgets, run_greedy_eval
    from trainer.backends import build_service_client
    from trainer.config.compose import with_run_groups
    from trainer.config.schema import ConfigError, validate
    from trainer.retry import RetryPolicy
    from trainer.setup import build_components, eval_task, fail

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = validate(composed)
        path, run_dir = _resolve_checkpoint(cfg.checkpoint)
        if run_dir is not None:  # the run's model, env, backend and seed; the command line's eval settings
            run_groups = ("model", "env", "backend", "seed")
            cfg = validate(with_run_groups(composed, run_dir / "config.yaml", run_groups))
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
