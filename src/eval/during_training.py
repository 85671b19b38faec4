"""The evals a training run makes: of the initial weights (before training), every `eval.every` rollout
steps, and of the final weights, each the configured greedy eval into `<run>/eval/`; and the paired
start-vs-final comparison on the same items. `trainer/main.py` calls them around the loop; `loop` is
the run's RLLoop (its `sampling_client()` on the current weights and its `retry` policy)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eval.greedy import greedy_eval_budgets, run_greedy_eval
from eval.records import read_item_records
from eval.stats import paired_compare
from trainer.utils.io import read_json

log = logging.getLogger("pairedrl")


def _greedy_eval(cfg: DictConfig, etask: Any, sampling_client: Any, retry: Any, out_path: Path, extra: dict,
                 check_determinism: bool) -> dict:
    """The configured eval (`eval.n_examples` test items, budgets and concurrency) on one sampler."""
    return run_greedy_eval(etask, etask.test_problems(cfg.eval.n_examples), sampling_client,
                           **greedy_eval_budgets(cfg), retry=retry, out_path=out_path,
                           extra={"name": cfg.eval.name, **extra}, check_determinism=check_determinism)


def periodic_eval(cfg: DictConfig, loop: Any, etask: Any, run_dir: Path, step: int) -> None:
    """Greedy eval every `eval.every` rollout steps (not at the end: the final eval covers that). Skips a
    step whose eval already finished (its summary is written last), so the loop can call it again for
    the step a resumed run restarts from: a run killed during that eval gets it on resume."""
    out = run_dir / "eval" / f"{cfg.eval.name}_step{step}.jsonl"
    if step % cfg.eval.every or step >= cfg.schedule.num_steps or out.with_suffix(".summary.json").is_file():
        return
    summary = _greedy_eval(cfg, etask, loop.sampling_client(), loop.retry, out, {"step": step}, False)
    log.info("eval %s at step %d: accuracy %.4f", cfg.eval.name, step, summary["accuracy"])


def run_start_eval(cfg: DictConfig, service_client: Any, etask: Any, run_dir: Path, retry: Any,
                   cfg_hash: str) -> Path:
    """Greedy eval of the initial weights, i.e. the base model (LoRA starts with B = 0, so the adapter
    adds nothing): the baseline the final eval is paired with. Kept on resume (not recomputed) when it
    was made under the same config; one left by a run of another config in this folder (e.g. one that
    stopped before its first checkpoint) is redone."""
    out = run_dir / "eval" / f"{cfg.eval.name}_start.jsonl"
    done = out.with_suffix(".summary.json")
    if done.is_file():  # written last, so the records are complete
        try:
            made_under = read_json(done, "start-eval summary").get("config_hash")
        except ValueError:  # torn by hand or by a disk error: redo it
            made_under = None
        if made_under == cfg_hash:
            return out
        log.warning("%s was not made under this run's config; redoing the initial-weights eval", out)
    # tinker 0.38 returns a future of the client (`BackcompatSamplingClientFuture`); using it as the client
    # is deprecated, so take its result, inside the retry so a failed creation is really retried
    sampler = retry.call("create_sampling_client", lambda: service_client.create_sampling_client(
        base_model=cfg.model.base_model).result())
    summary = _greedy_eval(cfg, etask, sampler, retry, out, {"step": 0, "config_hash": cfg_hash}, False)
    log.info("eval %s of the initial weights: accuracy %.4f [%.4f, %.4f] on %d items", cfg.eval.name,
             summary["accuracy"], summary["wilson_low"], summary["wilson_high"], summary["n"])
    print(f"initial-weights eval: accuracy {summary['accuracy']:.4f} on {summary['n']} items "
          f"({summary['time_s']:.0f} s)", flush=True)
    return out


def run_final_eval(cfg: DictConfig, loop: Any, etask: Any, run_dir: Path, result: dict) -> float:
    """Greedy eval of the trained weights (with the determinism check) into `<run>/eval/<name>.jsonl`;
    adds its summary and seconds to `result`."""
    t0 = time.time()
    summary = _greedy_eval(cfg, etask, loop.sampling_client(), loop.retry, run_dir / "eval" / f"{cfg.eval.name}.jsonl",
                           {"step": result["steps"], "checkpoint": result.get("checkpoint")}, True)
    result["time/eval"] = time.time() - t0
    result["eval"] = summary
    log.info("eval %s: accuracy %.4f [%.4f, %.4f] on %d items", cfg.eval.name, summary["accuracy"],
             summary["wilson_low"], summary["wilson_high"], summary["n"])
    return float(summary["accuracy"])


def compare_with_start(start_path: Path, final_path: Path) -> dict:
    """Paired statistics (same items) of the final eval against the initial-weights eval."""
    start = {r["index"]: r["correct"] for r in read_item_records(start_path)}
    final = {r["index"]: r["correct"] for r in read_item_records(final_path)}
    if set(start) != set(final):
        raise ValueError(f"{start_path} and {final_path} hold different items; cannot pair them")
    idx = sorted(start)
    return paired_compare([final[i] for i in idx], [start[i] for i in idx])
