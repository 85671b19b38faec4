"""The evals a training run makes: of the initial weights (before training), every `eval.every` rollout
steps, and of the final weights, each the configured greedy eval into `<run>/eval/`; and the paired
start-vs-final comparison on the same items. `trainer/main.py` calls them around the loop; `loop` is
the run's RLLoop (its `sampling_client()` on the current weights and its `retry` policy)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from eval.greedy import greedy_eval_budgets, run_greedy_eval
from eval.records import read_item_records
from eval.stats import paired_compare
from trainer.config.schema import Config
from trainer.utils.io import atomic_write_json, read_json

log = logging.getLogger("pairedrl")


def _greedy_eval(cfg: Config, etask: Any, sampling_client: Any, retry: Any, out_path: Path, extra: dict,
                 check_determinism: bool) -> dict:
    """The configured eval (`eval.n_examples` test items, budgets and concurrency) on one sampler."""
    return run_greedy_eval(etask, etask.test_problems(cfg.eval.n_examples), sampling_client,
                           **greedy_eval_budgets(cfg), retry=retry, out_path=out_path,
                           extra={"name": cfg.eval.name, **extra}, check_determinism=check_determinism)


def periodic_eval(cfg: Config, loop: Any, etask: Any, run_dir: Path, step: int) -> None:
    """Greedy eval every `eval.every` rollout steps (not at the end: the final eval covers that). Skips a
    step whose eval already finished (its summary is written last), so the loop can call it again for
    the step a resumed run restarts from: a run killed during that eval gets it on resume."""
    out = run_dir / "eval" / f"{cfg.eval.name}_step{step}.jsonl"
    if step % cfg.eval.every or step >= cfg.schedule.num_steps or out.with_suffix(".summary.json").is_file():
        return
    summary = _greedy_eval(cfg, etask, loop.sampling_client(), loop.retry, out, {"step": step}, False)
    log.info("eval %s at step %d: accuracy %.4f", cfg.eval.name, step, summary["accuracy"])


# the eval keys that do not change the initial-weights eval's numbers (when it runs, and whether)
_START_EVAL_INERT_KEYS = ("every", "at_start")


def start_eval_key(config_dict: dict, run_info: dict) -> dict:
    """Everything the initial-weights eval's numbers depend on, for sharing it between the runs of a sweep:
    the model (the base model, its renderer and context), the eval set (the eval group, and the env whose
    test split or renderer it may use), the backend's settings and the engine's resolved choices (precision,
    native kernels, thread count, CPU; `run_info.json`), and the code that ran. Not the seed, the loss or the
    optimizer: the initial weights are the base model's (LoRA starts with B = 0) and decoding is greedy."""
    return {
        "model": config_dict["model"],
        "env": config_dict["env"],
        "eval": {k: v for k, v in config_dict["eval"].items() if k not in _START_EVAL_INERT_KEYS},
        "backend": {k: v for k, v in config_dict["backend"].items() if k != "state_dir"},
        "engine": {k: run_info.get(k) for k in ("precision", "engine", "torch_threads", "cpu")},
        "code": {"git": run_info.get("git"), "versions": run_info.get("versions")},
    }


def key_sha(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_start_eval(cfg: Config, service_client: Any, etask: Any, run_dir: Path, retry: Any,
                   cfg_hash: str, share: tuple[Path, dict] | None = None) -> tuple[Path, dict]:
    """Greedy eval of the initial weights, i.e. the base model (LoRA starts with B = 0, so the adapter
    adds nothing): the baseline the final eval is paired with. Kept on resume (not recomputed) when it
    was made under the same config; one left by a run of another config in this folder (e.g. one that
    stopped before its first checkpoint) is redone.

    `share` = (folder, `start_eval_key`): the runs of a sweep compute it once. The first run to get there
    (a lock, for parallel launchers) evaluates and stores the records under `<folder>/<key sha>/`; every
    later run whose key is the same copies them, its summary saying `reused: true` and where from. Returns
    (records path, {"reused", "key_sha", "from"})."""
    out = run_dir / "eval" / f"{cfg.eval.name}_start.jsonl"
    done = out.with_suffix(".summary.json")
    if done.is_file():  # written last, so the records are complete
        try:
            summary = read_json(done, "start-eval summary")
        except ValueError:  # torn by hand or by a disk error: redo it
            summary = {}
        if summary.get("config_hash") == cfg_hash:
            return out, {k: summary.get(k) for k in ("reused", "key_sha", "reused_from")}
        log.warning("%s was not made under this run's config; redoing the initial-weights eval", out)
    if share is None:
        return out, _start_eval(cfg, service_client, etask, out, retry, cfg_hash, {})
    folder, key = share
    sha = key_sha(key)
    entry = folder / sha
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{sha}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a parallel run of the sweep waits for the first one's eval
        stored = entry / out.name
        stored_summary = stored.with_suffix(".summary.json")
        if stored_summary.is_file() and (entry / "key.json").is_file() and read_json(
                entry / "key.json", "start-eval key") == json.loads(json.dumps(key, default=str)):
            return out, _reuse_start_eval(stored, out, cfg_hash, sha)
        rec = _start_eval(cfg, service_client, etask, out, retry, cfg_hash, {"key_sha": sha})
        entry.mkdir(exist_ok=True)
        atomic_write_json(entry / "key.json", json.loads(json.dumps(key, default=str)))
        shutil.copyfile(out, stored)
        shutil.copyfile(done, stored_summary)  # last: an entry without it is not used
    return out, rec


def _start_eval(cfg: Config, service_client: Any, etask: Any, out: Path, retry: Any, cfg_hash: str,
                extra: dict) -> dict:
    # tinker 0.38 returns a future of the client (`BackcompatSamplingClientFuture`); using it as the client
    # is deprecated, so take its result, inside the retry so a failed creation is really retried
    sampler = retry.call("create_sampling_client", lambda: service_client.create_sampling_client(
        base_model=cfg.model.base_model).result())
    summary = _greedy_eval(cfg, etask, sampler, retry, out,
                           {"step": 0, "config_hash": cfg_hash, "reused": False, **extra}, False)
    log.info("eval %s of the initial weights: accuracy %.4f [%.4f, %.4f] on %d items", cfg.eval.name,
             summary["accuracy"], summary["wilson_low"], summary["wilson_high"], summary["n"])
    print(f"initial-weights eval: accuracy {summary['accuracy']:.4f} on {summary['n']} items "
          f"({summary['time_s']:.0f} s)", flush=True)
    return {"reused": False, "key_sha": extra.get("key_sha"), "reused_from": None}


def _reuse_start_eval(stored: Path, out: Path, cfg_hash: str, sha: str) -> dict:
    """The sweep's stored initial-weights eval copied into this run, its summary naming where it came from."""
    summary = read_json(stored.with_suffix(".summary.json"), "stored start-eval summary")
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stored, out)
    summary.update({"config_hash": cfg_hash, "reused": True, "reused_from": str(stored.parent),
                    "key_sha": sha})
    atomic_write_json(out.with_suffix(".summary.json"), summary)
    print(f"initial-weights eval: accuracy {summary['accuracy']:.4f} on {summary['n']} items, reused from "
          f"{stored.parent} (same model, eval set and engine)", flush=True)
    return {"reused": True, "key_sha": sha, "reused_from": str(stored.parent)}


def run_final_eval(cfg: Config, loop: Any, etask: Any, run_dir: Path, result: dict) -> float:
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
