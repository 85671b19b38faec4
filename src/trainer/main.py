"""`python train.py ...`: validate, set up the run folder, build the pieces, train, evaluate."""

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

from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import ConfigError, validate
from trainer.run_info import batch_arithmetic, format_batch_arithmetic, resolved_config_dict, write_run_files

log = logging.getLogger("pairedrl")


def fail(msg: str) -> None:
    """Stop before any compute with a message naming the problem (exit code 2)."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def hydra_dirs() -> tuple[Path, Path | None]:
    """(run folder, sweep folder or None) of the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    return run_dir, sweep_dir


def check_output_dir(run_dir: Path, cfg: DictConfig) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        fail(f"output folder {run_dir} is not writable ({e.strerror})")
    # LoRA state + Adam moments of a small adapter; generous so a full disk is caught before training
    need_mb = 64 * (1 + cfg.schedule.num_steps // max(1, cfg.schedule.save_every or cfg.schedule.num_steps))
    free_mb = shutil.disk_usage(run_dir).free / 2**20
    if cfg.backend.name == "local" and free_mb < need_mb:
        fail(f"not enough disk in {run_dir}: {free_mb:.0f} MiB free, the planned checkpoints need ~{need_mb} MiB")


def record_arm(sweep_dir: Path, job_num: int, info: dict[str, Any]) -> None:
    """Add this job to <sweep>/arms.json (job number -> arm), safe under parallel launchers."""
    path = sweep_dir / "arms.json"
    lock = open(sweep_dir / ".arms.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        arms = json.loads(path.read_text()) if path.exists() else {}
        arms[str(job_num)] = info
        from trainer.utils.io import atomic_write_json

        atomic_write_json(path, arms)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def build_components(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """(tokenizer, renderer, task) for the configured model and env."""
    from envs import build_task
    from envs.renderers import get_renderer
    from envs.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(cfg.model)
    renderer = get_renderer(cfg.model, tokenizer)
    task = build_task(cfg.env, renderer)
    return tokenizer, renderer, task


def eval_task(cfg: DictConfig, renderer: Any, train_task: Any) -> Any:
    if cfg.eval.task is None or cfg.eval.name == "none":
        return None
    if cfg.eval.task == cfg.env.name:
        return train_task
    from envs import build_task
    from trainer.config.schema import GROUP_SCHEMAS

    schema = GROUP_SCHEMAS["env"][f"{cfg.eval.task}_schema"]
    return build_task(OmegaConf.structured(schema()), renderer)


def make_loss(cfg: DictConfig, service_client: Any) -> tuple[Any, Any]:
    """(loss plugin, what forward_backward_custom receives), by `backend.loss_path`: `two_pass` the
    client-side callable; `one_pass` a handle registered with `create_custom_loss` (the per-datum form,
    which needs `aggregation=sum`), failing the run when that is impossible; `auto` the handle where the
    loss and backend allow it, else the callable, with a warning when registering failed (the arms of a
    sweep would otherwise run different paths unnoticed; `eval.compare` refuses such a sweep)."""
    from trainer.losses import build_loss
    from trainer.losses.adapter import make_custom_loss_fn

    loss = build_loss(cfg.loss)
    want = cfg.backend.get("loss_path", "auto")
    if want == "two_pass":
        return loss, make_custom_loss_fn(loss)
    if cfg.loss.aggregation != "sum" or not hasattr(service_client, "create_custom_loss"):
        if want == "one_pass":
            fail(f"backend.loss_path=one_pass needs loss.aggregation=sum (got {cfg.loss.aggregation}) and a "
                 "backend with create_custom_loss; use backend.loss_path=auto or two_pass")
        return loss, make_custom_loss_fn(loss)
    from trainer.losses.adapter import make_loss_handle

    try:
        handle = make_loss_handle(loss, service_client)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails or falls back by loss_path
        if want == "one_pass":
            fail(f"backend.loss_path=one_pass: registering the loss with create_custom_loss failed: "
                 f"{type(e).__name__}: {e}")
        log.warning("backend.loss_path=auto: registering the loss failed (%s: %s); this run computes its loss on "
                    "the two-pass path (same gradients, other cost and metric rounding); pin "
                    "backend.loss_path so that every arm of a sweep runs the same path", type(e).__name__, e)
        return loss, make_custom_loss_fn(loss)
    if cfg.backend.name == "tinker" and getattr(handle, "loss_id", None) is None:
        log.info("the service runs registered losses client-side (custom_loss_server_side=false): one-pass "
                 "semantics, two model passes per update")
    return loss, handle


def run_training(cfg: DictConfig) -> float | None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    t_setup = time.time()
    try:
        validate(cfg)
    except ConfigError as e:
        fail(f"config: {e}")
    run_dir, sweep_dir = hydra_dirs()
    check_output_dir(run_dir, cfg)
    if cfg.backend.name == "tinker":  # a missing key or an unreachable service fails before any other work
        from trainer.backends import BackendConfigError, check_tinker

        try:
            check_tinker(cfg.backend)
        except BackendConfigError as e:
            fail(str(e))
    if not cfg.preflight.skip:
        from trainer.preflight.gates import require_passed

        try:
            require_passed(cfg)
        except RuntimeError as e:
            fail(str(e))

    try:
        tokenizer, renderer, task = build_components(cfg)
        etask = eval_task(cfg, renderer, task)
        if etask is not None:  # an eval that cannot run must fail now, not after training
            etask.test_problems(cfg.eval.n_examples)
    except (FileNotFoundError, ValueError, KeyError) as e:
        fail(f"data/env: {e}")

    from trainer.checkpoint import ResumeError, check_resumable, config_hash

    config_dict = resolved_config_dict(cfg)
    batch = batch_arithmetic(cfg)
    try:
        resuming = check_resumable(run_dir, config_hash(config_dict)) is not None
    except ResumeError as e:
        fail(f"resume: {e}")
    if cfg.resume and not resuming:  # resuming is automatic; resume=true asks for it to be guaranteed
        fail(f"resume=true but {run_dir} holds no checkpoint.json to resume from; pass the run's folder "
             "as hydra.run.dir=<folder> (or drop resume=true to start a new run)")
    # the backend last: loading a model takes seconds, and a bad data path or run folder should fail
    # before that
    from trainer.backends import BackendConfigError, build_service_client

    try:
        service_client = build_service_client(cfg, run_dir)
    except BackendConfigError as e:
        fail(str(e))
    if resuming:  # the folder's config.yaml / run_info.json stay as the run first wrote them
        from trainer.utils.io import read_json

        info = read_json(run_dir / "run_info.json", "run info")
        print(f"resuming the run in {run_dir}", flush=True)
        from trainer.run_info import git_revision

        # code is not part of the config hash (a fix may be why the run is resumed), but it is said
        was, now = (info.get("git") or {}), git_revision()
        if (was.get("rev"), was.get("dirty")) != (now.get("rev"), now.get("dirty")):
            log.warning("resuming with different code: the run started at git %s%s, this is %s%s",
                        was.get("rev"), " (dirty)" if was.get("dirty") else "", now.get("rev"),
                        " (dirty)" if now.get("dirty") else "")
    else:
        info = write_run_files(run_dir, cfg, {"batch": batch, "run_dir": str(run_dir),
                                              # the engine's resolved precision (None: the service decides)
                                              "precision": getattr(service_client, "precision", None)})
    if sweep_dir is not None:
        from hydra.core.hydra_config import HydraConfig

        record_arm(sweep_dir, HydraConfig.get().job.num,
                   {"arm": info["arm"], "loss": info["loss"], "seed": info["seed"], "run_dir": str(run_dir)})
    print(format_batch_arithmetic(batch), flush=True)

    wandb_run = None
    if cfg.logger.name == "wandb":
        from trainer.config.schema import arm_name
        from trainer.wandb_run import WandbRun

        wandb_run = WandbRun(run_dir, cfg.logger, arm_name(cfg), config_dict, sweep_dir, resuming,
                             cfg.schedule.updates_per_batch)
    try:
        out = _train_and_evaluate(cfg, run_dir, sweep_dir, service_client, task, etask, config_dict, t_setup,
                                  wandb_run)
    except BaseException:
        if wandb_run is not None:  # marked failed in wandb, with what it logged so far
            wandb_run.finish(exit_code=1)
        raise
    if wandb_run is not None:
        wandb_run.finish()
    return out


def _train_and_evaluate(cfg: DictConfig, run_dir: Path, sweep_dir: Path | None, service_client: Any, task: Any,
                        etask: Any, config_dict: dict, t_setup: float, wandb_run: Any) -> float | None:
    from trainer.checkpoint import ResumeError
    from trainer.loop import RLLoop

    questions = ({p.index: p.question for p in etask.test_problems(cfg.eval.n_examples)}
                 if etask is not None else None)

    def to_wandb() -> None:  # every eval finished so far (and not yet logged) into the wandb run
        if wandb_run is not None and etask is not None:
            wandb_run.sync_evals(run_dir / "eval", cfg.eval.name, questions)

    def on_step_end(step: int) -> None:
        periodic_eval(cfg, loop, etask, run_dir, step)
        to_wandb()

    loss, custom = make_loss(cfg, service_client)
    # a tqdm bar on a terminal; one log line per step (stdout and train.log) without one
    bar = sys.stderr.isatty() or bool(os.environ.get("PAIREDRL_PROGRESS"))
    loop = RLLoop(cfg, run_dir, service_client, task, loss, custom, config_dict, sweep_dir,
                  progress=True if bar else "lines", wandb_run=wandb_run)
    if etask is not None and cfg.eval.every:
        loop.on_step_end = on_step_end
    setup_s = time.time() - t_setup
    start_eval, start_eval_s = None, 0.0
    if etask is not None and cfg.eval.at_start:
        t0 = time.time()
        start_eval = run_start_eval(cfg, service_client, etask, run_dir, loop.retry, loop.cfg_hash)
        start_eval_s = time.time() - t0
        to_wandb()
    t_train = time.time()
    from trainer.backends.errors import BackendRequestError
    from trainer.loop import TrainingClientLost

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
    result["time/train_total"] = time.time() - t_train

    final_acc = None
    if etask is not None:
        final_acc = run_final_eval(cfg, loop, etask, run_dir, result)
        if start_eval is not None:
            result["eval_vs_start"] = compare_with_start(start_eval, run_dir / "eval" / f"{cfg.eval.name}.jsonl")
        to_wandb()
        if wandb_run is not None and "eval_vs_start" in result:
            wandb_run.set_paired_result(result["eval_vs_start"])
    from trainer.utils.io import atomic_write_json

    atomic_write_json(run_dir / "result.json", result)
    report = None
    if cfg.report.enabled:
        from eval.run_report import write_run_report

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


def _greedy_eval(cfg: DictConfig, etask: Any, sampling_client: Any, retry: Any, out_path: Path, extra: dict,
                 check_determinism: bool) -> dict:
    """The configured eval (`eval.n_examples` test items, budgets and concurrency) on one sampler."""
    from eval.greedy import run_greedy_eval

    return run_greedy_eval(
        etask, etask.test_problems(cfg.eval.n_examples), sampling_client, max_tokens=cfg.eval.max_tokens,
        max_seq_len=cfg.model.max_seq_len, concurrency=cfg.eval.concurrency, retry=retry, out_path=out_path,
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
    from trainer.utils.io import read_json

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


def compare_with_start(start_path: Path, final_path: Path) -> dict:
    """Paired statistics (same items) of the final eval against the initial-weights eval."""
    from eval.records import read_item_records
    from eval.stats import paired_compare

    start = {r["index"]: r["correct"] for r in read_item_records(start_path)}
    final = {r["index"]: r["correct"] for r in read_item_records(final_path)}
    if set(start) != set(final):
        raise ValueError(f"{start_path} and {final_path} hold different items; cannot pair them")
    idx = sorted(start)
    return paired_compare([final[i] for i in idx], [start[i] for i in idx])


def run_final_eval(cfg: DictConfig, loop: Any, etask: Any, run_dir: Path, result: dict) -> float:
    t0 = time.time()
    summary = _greedy_eval(cfg, etask, loop.sampling_client(), loop.retry, run_dir / "eval" / f"{cfg.eval.name}.jsonl",
                           {"step": result["steps"], "checkpoint": result.get("checkpoint")}, True)
    result["time/eval"] = time.time() - t0
    result["eval"] = summary
    log.info("eval %s: accuracy %.4f [%.4f, %.4f] on %d items", cfg.eval.name, summary["accuracy"],
             summary["wilson_low"], summary["wilson_high"], summary["n"])
    return float(summary["accuracy"])
