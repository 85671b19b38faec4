"""`python train.py ...`: validate, set up the run folder, build the pieces, train, evaluate.

The entry module: only train.py imports it. The parts it puts together are built in trainer/setup.py
and the evals around the loop live in eval/during_training.py, where the other entry points (the
preflight gates, `python -m eval.run`, bench/) find them too."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from eval.during_training import (compare_with_start, periodic_eval, run_final_eval, run_start_eval,
                                  start_eval_key)
from eval.run_report import write_run_report
from trainer.backends import BackendConfigError, backend_of, build_service_client, session_finished
from trainer.backends.errors import BackendRequestError, is_lost
from trainer.checkpoint import ResumeError, check_resumable, config_hash
from trainer.config.schema import Config, ConfigError, arm_name, composed_dict, validate
from trainer.hydra_callbacks import SWEEP_RECORD, probe_output_dir
from trainer.loop import RLLoop, TrainingClientLost, _ClientFailure
from trainer.preflight.gates import require_passed
from trainer.redaction import install as install_redaction
from trainer.run_info import (
    batch_arithmetic,
    config_secrets,
    format_batch_arithmetic,
    git_revision,
    redact_hydra_record,
    resolved_config_dict,
    write_run_files,
)
from trainer.setup import build_components, eval_task, fail, make_loss
from trainer.utils.io import atomic_write_json, read_json
from trainer.utils.load import LoadMonitor
from trainer.wandb_run import WandbRun

log = logging.getLogger("pairedrl")


def hydra_dirs() -> tuple[Path, Path | None]:
    """(run folder, sweep folder or None) of the current Hydra job."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    return run_dir, sweep_dir


def check_output_dir(run_dir: Path, cfg: Config) -> None:
    # the job's own folder (a sweep's job folder, or one Hydra was told to use by a caller without the
    # callback); trainer.hydra_callbacks probed the run or sweep folder before Hydra wrote there
    problem = probe_output_dir(run_dir)
    if problem is not None:
        fail(problem)
    # LoRA state + Adam moments of a small adapter; generous so a full disk is caught before training
    need_mb = 64 * (1 + cfg.schedule.num_steps // max(1, cfg.schedule.save_every or cfg.schedule.num_steps))
    free_mb = shutil.disk_usage(run_dir).free / 2**20
    if backend_of(cfg).local_state and free_mb < need_mb:
        fail(f"not enough disk in {run_dir}: {free_mb:.0f} MiB free, the planned checkpoints need ~{need_mb} MiB")


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """The run_info.json of a folder being resumed (its arm, seed and precision are needed), or ResumeError."""
    path = run_dir / "run_info.json"
    try:
        info = read_json(path, "run info")
    except FileNotFoundError:
        raise ResumeError(f"{path} is missing, though {run_dir / 'checkpoint.json'} is there: the folder was "
                          "damaged; restore run_info.json from a copy, or start the run in a new folder") from None
    except ValueError as e:
        raise ResumeError(str(e)) from None
    if not isinstance(info, dict):
        raise ResumeError(f"{path} is not a JSON object")
    return info


def check_precision(info: dict[str, Any], now: dict[str, Any] | None) -> None:
    """ResumeError when the engine's resolved precision differs from the one the run started with: `auto`
    is measured per machine, so a resume on another CPU (or with PAIREDRL_AUTO_PRECISION set) would run
    its remaining steps at another precision under the same config hash."""
    from trainer.run_info import resolved_precision

    was = resolved_precision(info)
    if not isinstance(was, dict) or not isinstance(now, dict):  # a service that decides (backend=tinker)
        return
    keys = ("sampler_dtype", "train_dtype")
    a, b = ({k: d.get(k) for k in keys} for d in (was, now))
    if a != b:
        def fmt(d: dict[str, Any]) -> str:
            return f"sampler {d['sampler_dtype']}, training {d['train_dtype']}"
        differs = next(k for k in keys if a[k] != b[k])
        raise ResumeError(f"the run started at {fmt(a)} (run_info.json), but the engine now resolves to {fmt(b)}; "
                          "refusing to resume at another precision. Resume where `auto` resolves as it did (or "
                          f"with PAIREDRL_AUTO_PRECISION={a[differs]}), or start the run in a new folder")


def sweep_record(sweep_dir: Path | None) -> dict[str, Any] | None:
    """This job's sweep membership (trainer.hydra_callbacks.SweepRecord's file) with its job number, for
    run_info.json; None for a single run, or a sweep launched without the callback."""
    if sweep_dir is None or not (sweep_dir / SWEEP_RECORD).is_file():
        return None
    try:
        record = read_json(sweep_dir / SWEEP_RECORD, "sweep record")
    except (FileNotFoundError, ValueError) as e:
        log.warning("sweep membership not recorded: %s", e)
        return None
    return {**record, "job": HydraConfig.get().job.num} if isinstance(record, dict) else None


def record_arm(sweep_dir: Path, job_num: int, info: dict[str, Any]) -> None:
    """Add this job to <sweep>/arms.json (job number -> arm), safe under parallel launchers."""
    path = sweep_dir / "arms.json"
    lock = open(sweep_dir / ".arms.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        arms = json.loads(path.read_text()) if path.exists() else {}
        arms[str(job_num)] = info
        atomic_write_json(path, arms)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def record_load(run_dir: Path, load: dict[str, Any]) -> None:
    """run_info.json's `load` completed at the end of a run: the whole run's record (`LoadMonitor.end`). A
    resumed run keeps what the earlier sessions recorded under `earlier_sessions`."""
    path = run_dir / "run_info.json"
    try:
        info = read_json(path, "run info")
    except (FileNotFoundError, ValueError) as e:
        log.warning("load record not written: %s", e)
        return
    before = info.get("load") or {}
    earlier = list(before.get("earlier_sessions") or [])
    if before and before.get("start") != load["start"]:  # written by an earlier session of this folder
        earlier.append({k: v for k, v in before.items() if k != "earlier_sessions"})
    info["load"] = {**load, **({"earlier_sessions": earlier} if earlier else {})}
    atomic_write_json(path, info)


def run_training(composed: DictConfig) -> float | None:
    """train.py's task: `composed` is the config Hydra composed, validated here into the typed Config that
    everything below takes."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    t_setup = time.time()
    run_dir, sweep_dir = hydra_dirs()
    # first: Hydra has just written the overrides as given (a key among them) into .hydra/
    redact_hydra_record(run_dir, sweep_dir, config_secrets(composed_dict(composed)))
    # the config's own secrets, and Hydra's log handlers (console, train.log), now exist: route them too
    install_redaction(config_secrets(composed_dict(composed)))
    try:
        cfg = validate(composed)
    except ConfigError as e:
        fail(f"config: {e}")
    check_output_dir(run_dir, cfg)
    # the machine's load beside this run's timings: a short window now, each step, the whole run at the end
    # (a contended start is said at the first step, so a run refused before it leaves train.log untouched)
    load = LoadMonitor()
    try:  # a missing key or an unreachable service fails before any other work
        backend = backend_of(cfg)
        backend.check(cfg.backend)
    except BackendConfigError as e:
        fail(str(e))
    if not cfg.preflight.skip:
        try:
            require_passed(cfg)
        except RuntimeError as e:
            fail(str(e))

    try:
        tokenizer, renderer, task = build_components(cfg)
        etask = eval_task(cfg, renderer, task)
        if etask is not None:  # an eval that cannot run must fail now, not after training
            etask.test_problems(cfg.eval.n_examples)
        if len(task.train_problems()) == 0:
            raise ValueError(f"env {cfg.env.name}: the train set is empty ({cfg.env.data_source()})")
    except (FileNotFoundError, ValueError, KeyError) as e:
        fail(f"data/env: {e}")

    config_dict = resolved_config_dict(cfg)
    batch = batch_arithmetic(cfg)
    try:
        resuming = check_resumable(run_dir, config_hash(config_dict), cfg.logger.rollouts_per_step) is not None
        info = read_run_info(run_dir) if resuming else None
    except ResumeError as e:
        fail(f"resume: {e}")
    if cfg.resume and not resuming:  # resuming is automatic; resume=true asks for it to be guaranteed
        fail(f"resume=true but {run_dir} holds no checkpoint.json to resume from; pass the run's folder "
             "as hydra.run.dir=<folder> (or drop resume=true to start a new run)")
    # the backend last: loading a model takes seconds, and a bad data path or run folder should fail
    # before that
    try:
        service_client = build_service_client(cfg, run_dir)
    except BackendConfigError as e:
        fail(str(e))
    if resuming:  # the folder's config.yaml / run_info.json stay as the run first wrote them
        try:
            check_precision(info, backend.precision(service_client))
        except ResumeError as e:
            fail(f"resume: {e}")
        print(f"resuming the run in {run_dir}", flush=True)
        # code is not part of the config hash (a fix may be why the run is resumed), but it is said
        was, now = (info.get("git") or {}), git_revision()
        if (was.get("rev"), was.get("dirty")) != (now.get("rev"), now.get("dirty")):
            log.warning("resuming with different code: the run started at git %s%s, this is %s%s",
                        was.get("rev"), " (dirty)" if was.get("dirty") else "", now.get("rev"),
                        " (dirty)" if now.get("dirty") else "")
    else:
        # every implementation choice of the local engine, made once for this model and logged (a service
        # decides its own); a resumed run's engine says it when it restores the checkpoint
        info = write_run_files(run_dir, cfg, {"batch": batch, "run_dir": str(run_dir),
                                              "sweep": sweep_record(sweep_dir),
                                              "load": {"start": load.start_rec},
                                              "engine": backend.engine_record(service_client,
                                                                              cfg.model.base_model)})
    if sweep_dir is not None:
        record_arm(sweep_dir, HydraConfig.get().job.num,
                   {"arm": info["arm"], "loss": info["loss"], "seed": info["seed"], "run_dir": str(run_dir)})
    print(format_batch_arithmetic(batch), flush=True)

    wandb_run = None
    if cfg.logger.name == "wandb":
        wandb_run = WandbRun(run_dir, cfg.logger, arm_name(cfg), config_dict, sweep_dir, resuming,
                             cfg.schedule.updates_per_batch)
    try:
        out = _train_and_evaluate(cfg, run_dir, sweep_dir, service_client, task, etask, config_dict, t_setup,
                                  wandb_run, load, info)
    except BaseException:
        if wandb_run is not None:  # marked failed in wandb, with what it logged so far
            wandb_run.finish(exit_code=1)
        raise
    if wandb_run is not None:
        wandb_run.finish()
    return out


def _eval_or_fail(what: str, run: Any) -> Any:
    """`run()` (an eval outside the loop, which recovers only its own steps), ending the run with one line
    when the backend fails it for good: a lost client (a server that died or restarted), a refused request,
    retries spent. The steps are saved, so a rerun in the folder resumes at the checkpoint and redoes it."""
    import tinker

    try:
        return run()
    except Exception as e:  # noqa: BLE001 - only the backend's failures are turned into one line
        if not (is_lost(e) or isinstance(e, (BackendRequestError, tinker.TinkerError, _ClientFailure))):
            raise
        fail(f"backend: {what}: {type(e).__name__}: {e}; the run resumes from its last checkpoint and redoes it "
             "when started again")


def _train_and_evaluate(cfg: Config, run_dir: Path, sweep_dir: Path | None, service_client: Any, task: Any,
                        etask: Any, config_dict: dict, t_setup: float, wandb_run: Any,
                        load: LoadMonitor, info: dict[str, Any]) -> float | None:
    loop = None
    # the session ends with the run however it ends; the loop's client replaces the first after a recovery
    with session_finished(lambda: loop.sc if loop is not None else service_client,
                          float(cfg.backend.connect_timeout_s)):
        questions = ({p.index: p.question for p in etask.test_problems(cfg.eval.n_examples)}
                     if etask is not None else None)

        def to_wandb() -> None:  # every eval finished so far (and not yet logged) into the wandb run
            if wandb_run is not None and etask is not None:
                wandb_run.sync_evals(run_dir / "eval", cfg.eval.name, questions)

        def on_step_end(step: int) -> None:
            load.check(step)
            if etask is not None and cfg.eval.every:
                periodic_eval(cfg, loop, etask, run_dir, step)
                to_wandb()

        loss_path = make_loss(cfg, service_client)
        # a tqdm bar on a terminal; one log line per step (stdout and train.log) without one
        bar = sys.stderr.isatty() or bool(os.environ.get("PAIREDRL_PROGRESS"))
        # a recovery on backend=tinker starts a new session: a restarted server knows neither the old one nor
        # its ids
        renew = (lambda: build_service_client(cfg, run_dir)) if backend_of(cfg).renews_session else None
        loop = RLLoop(cfg, run_dir, service_client, task, loss_path, config_dict, sweep_dir,
                      progress=True if bar else "lines", on_step_end=on_step_end, wandb_run=wandb_run,
                      new_service_client=renew)
        setup_s = time.time() - t_setup
        start_eval, start_eval_s, start_rec = None, 0.0, None
        if etask is not None and cfg.eval.at_start:
            t0 = time.time()
            # a sweep evaluates the initial weights once per model, eval set and engine, and reuses it
            share = (sweep_dir / "initial_eval", start_eval_key(config_dict, info)) if sweep_dir else None
            start_eval, start_rec = _eval_or_fail("the initial-weights eval", lambda: run_start_eval(
                cfg, service_client, etask, run_dir, loop.retry, loop.cfg_hash, share))
            start_eval_s = time.time() - t0
            to_wandb()
        t_train = time.time()
        try:
            result = loop.run()
        except ResumeError as e:
            fail(f"resume: {e}")
        except (TrainingClientLost, BackendRequestError) as e:  # the run folder keeps every finished step
            fail(f"backend: {e}; the run resumes from its last checkpoint when started again")
        # setup: config, data, model load; the loop's total includes creating/restoring the training client,
        # checkpoints and periodic evals
        result["time/setup"] = setup_s
        result["time/start_eval"] = start_eval_s
        if start_rec is not None:
            result["start_eval"] = start_rec
        result["time/train_total"] = time.time() - t_train

        final_acc = None
        if etask is not None:
            final_acc = _eval_or_fail("the final eval", lambda: run_final_eval(cfg, loop, etask, run_dir, result))
            if start_eval is not None:
                result["eval_vs_start"] = compare_with_start(start_eval, run_dir / "eval" / f"{cfg.eval.name}.jsonl")
            to_wandb()
            if wandb_run is not None and "eval_vs_start" in result:
                wandb_run.set_paired_result(result["eval_vs_start"])
        record_load(run_dir, load.end())
        atomic_write_json(run_dir / "result.json", result)
        report = None
        if cfg.report.enabled:
            try:
                report = write_run_report(run_dir)
            except Exception as e:  # noqa: BLE001 - the run is done and saved; a report failure must not hide that
                log.warning("run report not written: %s: %s", type(e).__name__, e)
        print(f"\nrun folder: {run_dir}\n  metrics:  {run_dir / 'metrics.jsonl'}\n  rollouts: "
              f"{run_dir / 'rollouts.jsonl'}\n  checkpoint: {result.get('checkpoint')}")
        if final_acc is not None:
            print(f"  eval:     {run_dir / 'eval' / (cfg.eval.name + '.jsonl')}  accuracy={final_acc:.4f}")
        if "eval_vs_start" in result:
            c = result["eval_vs_start"]
            print(f"  eval vs initial weights ({c['n']} paired items): {c['acc_baseline']:.4f} -> "
                  f"{c['acc_treatment']:.4f}, diff {c['diff']:+.4f}, bootstrap 95% CI [{c['bootstrap_low']:+.4f}, {c['bootstrap_high']:+.4f}], "
                  f"McNemar p={c['mcnemar_p']:.3g} (fixed {c['b']}, broke {c['c']})")
        if report is not None:
            print(f"  report:   {report}")
        return final_acc
