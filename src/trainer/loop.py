"""The generic RL loop over a Tinker-style client (docs/architecture.md describes the data flow).

Per rollout step: a sampling client from the current weights; every group sampled concurrently;
rewards from the env; advantages; datums, to which `loss_path.fetch_inputs` adds the optional inputs the
loss declares (the loop does not know which); `updates_per_batch` minibatches, each one
`forward_backward_custom` on what `loss_path.prepare(minibatch)` gives, then `optim_step`.
Checkpoints are taken at step boundaries; resume (or recovery from a poisoned or lost client) reloads the
last one, drops the log rows of the steps after it and redoes them, so no optimizer step is ever skipped or
applied twice. Every backend call, sampling included, goes through one wrapper (`_backend_call`): a
transient or ambiguous failure, a lost client (`errors.is_lost`: a 404 on an object the run created, or no
successful reply within `backend.call_deadline_s`) redoes the step from the checkpoint; on `backend=tinker`
with a new service client, since a restarted server knows neither the old session nor its ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import numpy as np
import tinker

from trainer.advantages import compute_advantages
from trainer.backends import backend_of
from trainer.backends.errors import (
    RECOVER,
    RESEND,
    USER,
    BackendRequestError,
    classify,
    is_lost,
    is_not_applied,
    is_retryable,
)
from trainer.checkpoint import (
    CheckpointInfo,
    ResumeError,
    check_resumable,
    config_hash,
    rng_state,
    save_checkpoint,
    truncate_log,
)
from trainer.config.losses import own_rule
from trainer.config.schema import Config, arm_name
from trainer.datums import Rollout, rollout_to_datum, split_minibatches
from trainer.losses.paths import CustomLossCall, InputClients, LossPath
from trainer.lr_schedule import lr_at
from trainer.metrics_sink import MetricsSink
from trainer.retry import RetryPolicy
from trainer.rollouts import sample_batch
from trainer.tinker_params import adam_params, create_lora_training_client, sampling_params, served_model

log = logging.getLogger(__name__)


class ProgressLines:
    """Progress without a terminal (nohup, SLURM, CI): one INFO line per rollout step, which Hydra's
    logging sends to stdout and the run folder's train.log. The ETA uses the mean wall time of the
    steps done by this process, including checkpoints and periodic evals.

    Every line shows DPPO's mask as `masked` and GRPO's clip as `clip` (the rules every arm logs, own or
    counterfactual); an arm whose own rule (RULE_TABLE: the first its loss owns) is neither adds it under
    its rule name (`cppo_masked 0.012`)."""

    # the rules every line shows, under their short labels
    SHOWN = (("masked", "dppo_masked"), ("clip", "grpo_clip"))

    def __init__(self, total: int, start_step: int, loss: str | None = None) -> None:
        self.total = total
        self.start_step = start_step
        self.t0 = time.time()
        own = own_rule(loss) if loss else None
        self.rules = self.SHOWN + (((own, own),) if own and own not in dict(self.SHOWN).values() else ())

    def step_done(self, step: int, rows: list[dict[str, Any]]) -> str:
        per_step = (time.time() - self.t0) / max(1, step - self.start_step)
        first = rows[0] if rows else {}
        parts = [f"step {step}/{self.total}", f"reward {_fmt(first.get('env/reward_mean'))}"]
        for label, rule in self.rules:
            key = f"loss/{rule}_frac"
            vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            if vals:
                parts.append(f"{label} {_fmt(float(np.mean(vals)))}")
        parts.append(f"{_fmt(first.get('time/step'), '.1f')} s/step")
        parts.append(f"ETA {_duration(per_step * (self.total - step))}")
        line = " | ".join(parts)
        log.info("%s", line)
        return line


def _fmt(v: Any, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _duration(s: float) -> str:
    s = int(round(s))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s"


class TrainingClientLost(RuntimeError):
    """A training-client call failed for good (e.g. a poisoned Tinker client)."""


@dataclass
class LoopState:
    step: int = 0
    optim_steps: int = 0
    data_cursor: int = 0
    last_checkpoint: CheckpointInfo | None = None


class RLLoop:
    # the run's WandbRun when train.py opened one (it logs the evals and finishes it); None: the sink
    # opens its own if logger=wandb
    wandb_run: Any = None
    # one sample request per rollout (sampling.requests; set from the config in __init__)
    per_sample_requests: bool = False
    # recoveries in a row without progress, and the (step, optim_steps) they happened at
    _stuck: int = 0
    _stuck_at: tuple[int, int] | None = None

    def __init__(self, cfg: Config, run_dir: Path, service_client: Any, task: Any, loss_path: LossPath,
                 config_dict: dict, sweep_dir: Path | None = None,
                 progress: bool | str = True, on_step_end: Callable[[int], None] | None = None,
                 wandb_run: Any = None, new_service_client: Callable[[], Any] | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.sc = service_client
        self.task = task
        self.loss_path = loss_path  # the loss plugin, what forward_backward_custom receives, its metrics
        self.config_dict = config_dict
        self.sweep_dir = sweep_dir
        # True / "bar": a tqdm bar (terminals); "lines": one log line per step (no terminal); False: none
        self.progress = "bar" if progress is True else (progress or None)
        self.wandb_run = wandb_run
        self.on_step_end = on_step_end
        # a fresh service client for a recovery (backend=tinker; None: recoveries reuse `service_client`)
        self.new_service_client = new_service_client
        self.retry = RetryPolicy.from_config(cfg.retry, cfg.backend.call_deadline_s)
        self.train_problems = task.train_problems()
        if len(self.train_problems) == 0:
            raise ValueError(f"env {cfg.env.name}: empty train set")
        self.cfg_hash = config_hash(config_dict)
        self.tc: Any = None
        self.info: dict[str, Any] = {}
        self.recoveries = 0
        self._warned: set[str] = set()
        self._ref_sampler: Any = None  # a sampler of the initial weights (`_reference_sampler`)
        mode = cfg.sampling.requests
        if mode == "auto":
            mode = backend_of(cfg).auto_requests
        self.per_sample_requests = mode == "per_sample"
        self.last_rows: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ clients
    def _new_training_client(self) -> Any:
        return self.retry.call("create_training_client", lambda: create_lora_training_client(
            self.sc, self.cfg.model, self.cfg.seed))

    def _restore_training_client(self, path: str) -> Any:
        return self.retry.call("load_state", lambda: self.sc.create_training_client_from_state_with_optimizer(
            path).result())

    def _record_info(self) -> None:
        try:
            info = self.tc.get_info()
            self.info = {"served_model": served_model(info), "lora_rank": getattr(info, "lora_rank", None)}
        except Exception as e:  # noqa: BLE001 - informational only
            self.info = {"served_model": None, "error": str(e)}

    # ------------------------------------------------------------------ resume
    def _renew_service_client(self) -> None:
        """Replace the service client (and what hangs off its session: the registered loss, the reference
        sampler) before a recovery, closing the old one's connections so that its pending retries end
        instead of reaching a restarted server. A service that does not answer is a failed attempt."""
        from trainer.backends import BackendConfigError, close_service_client

        close_service_client(self.sc)
        self._ref_sampler = None
        try:
            self.sc = self.new_service_client()
        except BackendConfigError as e:
            raise _ClientFailure(f"new service client: {e}") from e
        sc = self.sc
        self._train_call("create_custom_loss", lambda: self.loss_path.rebind(sc))

    def _start(self, renew: bool = False) -> LoopState:
        ckpt = check_resumable(self.run_dir, self.cfg_hash, self.cfg.logger.rollouts_per_step)
        if renew and self.new_service_client is not None:
            self._renew_service_client()
        if ckpt is not None:
            try:
                self.tc = self._restore_training_client(ckpt.tinker_path)
            except Exception as e:  # noqa: BLE001 - a checkpoint the backend cannot load, or a failed request
                refused = isinstance(e, tinker.RequestFailedError) and str(getattr(e, "category", "")).lower(
                ).endswith("user")
                if classify(e) == RECOVER and not refused and not isinstance(e, FileNotFoundError):
                    raise _ClientFailure(f"load_state: {type(e).__name__}: {e}") from e
                if classify(e) is None:
                    raise
                raise ResumeError(f"cannot restore {ckpt.tinker_path} named in "
                                  f"{self.run_dir / 'checkpoint.json'}: {e}") from None
            state = LoopState(ckpt.step, ckpt.optim_steps, ckpt.data_cursor, ckpt)
            log.info("resuming from %s at step %d", ckpt.tinker_path, ckpt.step)
        else:
            try:
                self.tc = self._new_training_client()
            except Exception as e:  # noqa: BLE001
                if classify(e) != RECOVER:
                    raise
                raise _ClientFailure(f"create_training_client: {type(e).__name__}: {e}") from e
            state = LoopState()
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            kept, dropped = truncate_log(self.run_dir / name, state.step)
            if dropped:
                log.info("%s: dropped %d rows after step %d (redone on resume)", name, dropped, state.step)
        self._record_info()
        return state

    def _recover(self, state: LoopState, exc: BaseException) -> LoopState:
        """Recreate the training client from the last checkpoint and redo the steps after it.

        Bounded by `retry.max_attempts` recoveries in a row that make no progress (the same step failing
        again), so a long run survives many unrelated faults while a persistent one still ends it."""
        self.recoveries += 1
        at = (state.step, state.optim_steps)
        self._stuck = self._stuck + 1 if self._stuck_at == at else 1
        self._stuck_at = at
        if self._stuck > self.cfg.retry.max_attempts:
            raise TrainingClientLost(f"giving up after {self._stuck - 1} recoveries at step {state.step}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        log.warning("training client failed (%s: %s); recovering from the last checkpoint",
                    type(exc).__name__, exc)
        tries = 0
        while True:
            try:
                return self._start(renew=True)
            except _ClientFailure as again:  # creating the new client failed too: counts as another try
                self._stuck += 1
                if self._stuck > self.cfg.retry.max_attempts:
                    raise TrainingClientLost(f"giving up: no training client after {self._stuck - 1} tries: "
                                             f"{again}") from again
                log.warning("recreating the training client failed (%s); trying again", again)
                time.sleep(self.retry.delay(tries))  # a restarting server needs a moment to listen again
                tries += 1

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, Any]:
        s = self.cfg.schedule
        state = self._start_with_retries()
        sink = MetricsSink(self.run_dir, self.cfg.logger, arm_name(self.cfg), self.config_dict, self.sweep_dir,
                           resume=state.step > 0, wandb_run=self.wandb_run,
                           updates_per_batch=s.updates_per_batch)
        bar = None
        lines = (ProgressLines(s.num_steps, state.step, self.cfg.loss.name) if self.progress == "lines"
                 else None)
        if self.progress == "bar":
            from tqdm import tqdm

            bar = tqdm(total=s.num_steps, initial=state.step, desc=arm_name(self.cfg), unit="step",
                       dynamic_ncols=True)
        last_reward = None
        # a run killed after its checkpoint but during that step's end-of-step work (a periodic eval)
        # redoes it, as does a recovery to that checkpoint; the hook skips what already finished
        hook_pending = state.step > 0
        try:
            while hook_pending or state.step < s.num_steps or (state.last_checkpoint is None
                                                               or state.last_checkpoint.step != state.step):
                try:
                    if hook_pending:
                        hook_pending = False
                        self._step_end(state.step)
                        continue
                    if state.step == s.num_steps:  # the final save, recovered like any step if it fails
                        self._save(state, final=True)
                        continue
                    last_reward = self._do_step(state, sink)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(reward=f"{last_reward:.3f}")
                    if lines is not None:
                        lines.step_done(state.step, self.last_rows)
                    self._step_end(state.step)
                except TrainingClientLost:
                    raise
                except Exception as exc:  # noqa: BLE001
                    if not _is_client_failure(exc):
                        raise
                    state = self._recover(state, exc)
                    hook_pending = state.step > 0
                    sink.reopen()  # the logs were rewritten by the truncation
                    if bar is not None:
                        bar.n = state.step
                        bar.refresh()
                    continue
        finally:
            if bar is not None:
                bar.close()
            sink.close()
        return {"steps": state.step, "optim_steps": state.optim_steps, "last_reward": last_reward,
                "checkpoint": state.last_checkpoint.tinker_path if state.last_checkpoint else None,
                "retries": self.retry.total, "recoveries": self.recoveries, **self.info}

    def _step_end(self, step: int) -> None:
        """The step-end hook (a periodic eval), its backend failures recovered like a step's."""
        if self.on_step_end is None:
            return
        try:
            self.on_step_end(step)
        except _ClientFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - the eval's sampling calls, not wrapped by the loop
            self._raise_backend_failure(f"step-end eval at step {step}", exc)

    def _start_with_retries(self) -> LoopState:
        for attempt in range(self.cfg.retry.max_attempts):
            try:
                return self._start()
            except _ClientFailure as exc:
                if attempt == self.cfg.retry.max_attempts - 1:
                    raise TrainingClientLost(f"no training client after {attempt + 1} tries: {exc}") from exc
                log.warning("creating the training client failed (%s); trying again", exc)
        raise AssertionError("unreachable")

    def sampling_client(self) -> Any:
        """A sampler on the current weights (idempotent: a failed attempt is simply made again)."""
        return self._train_call("save_weights_and_get_sampling_client",
                                lambda: self.tc.save_weights_and_get_sampling_client().result())

    def _do_step(self, state: LoopState, sink: MetricsSink) -> float:
        cfg, s = self.cfg, self.cfg.schedule
        step = state.step
        t_step = time.time()
        sampling_client = self.sampling_client()
        n = len(self.train_problems)
        problems = [self.train_problems[(state.data_cursor + g) % n] for g in range(s.groups_per_batch)]
        t0 = time.time()
        try:
            groups = asyncio.run(sample_batch(
                self.task, problems, sampling_client, sampling_params(cfg.sampling), seed=cfg.seed, step=step,
                group_size=s.group_size, max_seq_len=cfg.model.max_seq_len, concurrency=cfg.sampling.concurrency,
                retry=self.retry, per_sample=self.per_sample_requests))
        except Exception as exc:  # noqa: BLE001 - sampling retried in place already; now the loop's answer
            self._raise_backend_failure("sample", exc)
        t_sample = time.time() - t0

        rollouts: list[Rollout] = []
        mixed_G = []
        for group in groups:
            rewards_G = np.array([r.reward for r in group])
            adv_G = compute_advantages(rewards_G, cfg.advantage)
            mixed_G.append(bool(rewards_G.max() > rewards_G.min()))
            for r, a in zip(group, adv_G):
                r.advantage = float(a)
                rollouts.append(r)
        step_metrics = _rollout_metrics(rollouts, len(groups), sum(mixed_G))
        step_metrics["env/frac_duplicate_in_group"] = dup = frac_duplicate_in_group(groups)
        if dup > DUPLICATE_WARN and cfg.sampling.temperature >= 1.0:
            self._warn_once("duplicates", "step %d: %.0f%% of the completions repeat another of their group at "
                            "temperature %g: identical samples get zero advantage and teach nothing; check "
                            "that the backend draws a group's samples independently (sampling.requests="
                            "per_sample seeds each one)", step, 100 * dup, cfg.sampling.temperature)
        step_metrics["time/sample"] = t_sample
        rollouts_train = select_for_training(rollouts, mixed_G, s.drop_constant_groups, s.updates_per_batch)
        step_metrics["env/rollouts_trained"] = len(rollouts_train)
        # datum positions actually sent to training (the dropped groups' rollouts are not)
        step_metrics["tokens/trained"] = int(sum(len(r.prompt_tokens) + len(r.tokens) - 1
                                                 for r in rollouts_train))
        datums = [rollout_to_datum(r) for r in rollouts_train]

        t0 = time.time()
        datums, input_metrics = self.loss_path.fetch_inputs(datums, self._input_clients())
        step_metrics.update(input_metrics)
        minibatches = split_minibatches(datums, s.updates_per_batch)
        rows = []
        for u, mb in enumerate(minibatches):
            t_u = time.time()
            call = self.loss_path.prepare(mb)
            lr = lr_at(state.optim_steps, s.num_steps * s.updates_per_batch, cfg.optimizer.lr, s.lr_schedule,
                       s.warmup_steps, s.min_lr_ratio)
            params = adam_params(cfg.optimizer, lr)
            if cfg.backend.pipeline_optim_step:
                fb, opt = self._train_call(_PIPELINED, lambda call=call: self._fb_then_optim(call, params))
            else:
                fb = self._train_call("forward_backward", lambda call=call: self.tc.forward_backward_custom(
                    call.data, call.loss_fn).result())
                opt = self._train_call("optim_step", lambda: self.tc.optim_step(params).result())
            state.optim_steps += 1
            row = {"step": step, "update": u, "global_update": state.optim_steps - 1, "optim/lr": lr,
                   "loss/path": self.loss_path.name}
            row.update(self.loss_path.metrics(fb, call.data))
            for k, v in ((getattr(opt, "metrics", None) or {}).items()):
                row[f"optim/{k.split(':')[0]}"] = float(v)
            row["time/update"] = time.time() - t_u
            row.update(step_metrics)
            row["faults/retries"] = self.retry.total
            rows.append(row)
        t_train = time.time() - t0
        t_step_s = time.time() - t_step  # once, so every row of the step carries the same value
        mismatch = _first_update_mismatch(rows[0])
        for row in rows:
            row.update(mismatch)
            row["time/train"] = t_train
            row["time/step"] = t_step_s
            sink.log(row)
        self.last_rows = rows
        sink.log_rollouts(_rollout_samples(self.task, rollouts, problems, step, cfg.logger.rollouts_per_step),
                          step, state.optim_steps - 1)
        state.data_cursor += s.groups_per_batch
        state.step += 1
        if s.save_every and state.step % s.save_every == 0 and state.step < s.num_steps:
            self._save(state)
        return step_metrics["env/reward_mean"]

    def _input_clients(self) -> InputClients:
        """The clients the loss path fetches the loss's optional inputs through (`LossPath.fetch_inputs`),
        its calls wrapped like the loop's own: which inputs that is, is the loss's to say."""
        return InputClients(training=self.tc, reference_sampler=self._reference_sampler,
                            call=self._train_call)

    def _reference_sampler(self) -> Any:
        """A sampler of the initial weights, from the base model (LoRA starts with B = 0): made on first use
        and kept until a recovery replaces the service client whose session holds it."""
        if self._ref_sampler is None:
            self._ref_sampler = self._train_call("create_sampling_client", lambda: (
                self.sc.create_sampling_client(base_model=self.cfg.model.base_model)))
        return self._ref_sampler

    def _fb_then_optim(self, call: CustomLossCall, params: Any) -> tuple[Any, Any]:
        """forward_backward and optim_step submitted back to back, then both awaited: requests of one
        client run in submission order (tinker 0.38 reserves the custom loss's two passes' request ids
        up front, `training_client.py::forward_backward_custom`), so the step lands in the same server
        cycle instead of one round trip later, as the cookbook's RL loop does."""
        fb = self.tc.forward_backward_custom(call.data, call.loss_fn)
        opt = self.tc.optim_step(params)
        return fb.result(), opt.result()

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _train_call(self, what: str, fn: Callable[[], Any]) -> Any:
        # forward_backward / optim_step are not idempotent (gradients accumulate, updates apply): resent
        # in place only after errors that guarantee the server applied nothing; any other failure
        # (timeout, 5xx: maybe applied) redoes the step from the last checkpoint instead
        # the pipelined pair is never resent in place: the optim_step may have applied whatever gradient
        # had accumulated when its forward_backward failed
        retryable = ((lambda exc: False) if what == _PIPELINED else
                     is_not_applied if what in _NOT_IDEMPOTENT else is_retryable)
        try:
            return self.retry.call(what, fn, retryable)
        except Exception as exc:  # noqa: BLE001 - classified: recover, the user's fault, or a bug
            self._raise_backend_failure(what, exc)

    def _raise_backend_failure(self, what: str, exc: Exception) -> NoReturn:
        """Raise `_backend_failure(what, exc)`, chained to `exc` (or `exc` itself, with its traceback)."""
        failure = self._backend_failure(what, exc)
        if failure is exc:
            raise exc
        raise failure from exc

    def _backend_failure(self, what: str, exc: Exception) -> Exception:
        """What a failed call on the run's own clients (training, sampling, the evals' samplers) ends in,
        once its retries in place are spent: `_ClientFailure` (the step is redone from the last checkpoint)
        for a failure at the backend that may have been applied, or a lost client (`is_lost`: a 404 here is
        about a model, sampler or future this run created); `BackendRequestError` (the run ends with one
        line) for a request the backend refused; else the error itself, with its traceback: our own
        ValueError (bad input, a failing loss) or an error no backend raises. A RuntimeError (also torch's,
        inside the local engine) is RECOVER."""
        kind = classify(exc)
        if kind in (RESEND, RECOVER) or is_lost(exc):
            return _ClientFailure(f"{what}: {type(exc).__name__}: {exc}")
        if kind == USER and isinstance(exc, tinker.APIStatusError):
            return BackendRequestError(f"{what}: the backend refused the request: {exc}")
        return exc

    def _save(self, state: LoopState, final: bool = False) -> None:
        name = f"step{state.step:06d}" + ("_final" if final else "")
        # overwrite=True makes a resend idempotent: a save that landed but whose reply was lost would
        # otherwise be refused as a duplicate name (409, retried by the SDK for 5 minutes)
        path = self._train_call("save_state", lambda: self.tc.save_state(name, overwrite=True).result().path)
        history = (state.last_checkpoint.history if state.last_checkpoint else []) + [
            {"step": state.step, "tinker_path": path, "time": time.time()}]
        info = CheckpointInfo(tinker_path=path, step=state.step, optim_steps=state.optim_steps,
                              data_cursor=state.data_cursor, config_hash=self.cfg_hash, rng=rng_state(),
                              history=history)
        save_checkpoint(self.run_dir, info)
        state.last_checkpoint = info


def select_for_training(rollouts: list[Rollout], mixed_G: list[bool], drop_constant_groups: bool,
                        updates: int) -> list[Rollout]:
    """The rollouts a step trains on: all of them, or with `drop_constant_groups` those of groups with
    mixed rewards (the others have advantage 0 under group-mean baselines). At least `updates` are kept so
    every batch still takes its optimizer steps: the mixed-group rollouts first, topped up with others."""
    if not drop_constant_groups:
        return rollouts
    kept = [r for r in rollouts if mixed_G[r.group]]
    if len(kept) >= updates:
        return kept
    return (kept + [r for r in rollouts if not mixed_G[r.group]])[:updates]


class _ClientFailure(RuntimeError):
    pass


_NOT_IDEMPOTENT = ("forward_backward", "optim_step")
_PIPELINED = "forward_backward+optim_step"


def _is_client_failure(exc: BaseException) -> bool:
    return isinstance(exc, _ClientFailure)


# The drift of the first update of a step is the sampler/trainer mismatch: no update has moved the weights
_MISMATCH_KEYS = {"drift/abs_p_q50": "mismatch/abs_p_q50", "drift/abs_p_q90": "mismatch/abs_p_q90",
                  "drift/abs_p_q99": "mismatch/abs_p_q99", "drift/abs_p_max": "mismatch/abs_p_max",
                  "drift/kl_sampler_current": "mismatch/kl_k3"}


def _first_update_mismatch(first_row: dict[str, Any]) -> dict[str, float]:
    """`mismatch/*` of a step: |p_trainer - p_sampler| quantiles and the k3 KL(sampler || trainer) at its first
    update (minibatch 0, before any optim_step of the step), logged on every row of the step."""
    return {new: first_row[old] for old, new in _MISMATCH_KEYS.items() if old in first_row}


# share of duplicated completions above which a step at temperature >= 1 warns (a healthy policy at T=1
# repeats itself only on very short answers)
DUPLICATE_WARN = 0.5


def frac_duplicate_in_group(groups: list[list[Rollout]]) -> float:
    """Share of rollouts whose completion tokens equal an earlier rollout of the same group."""
    n = sum(len(g) for g in groups)
    dup = sum(len(g) - len({tuple(r.tokens) for r in g}) for g in groups)
    return dup / max(1, n)


def _rollout_metrics(rollouts: list[Rollout], n_groups: int, mixed: int) -> dict[str, float]:
    rewards = np.array([r.reward for r in rollouts])
    lengths = np.array([len(r.tokens) for r in rollouts])
    out = {
        "env/reward_mean": float(rewards.mean()),
        "env/reward_std": float(rewards.std()),
        "env/frac_mixed_groups": mixed / max(1, n_groups),
        "env/completion_len_mean": float(lengths.mean()),
        "env/frac_truncated": float(np.mean([r.stop_reason == "length" for r in rollouts])),
        "tokens/sampled": int(lengths.sum()),
    }
    for key in ("format", "correct"):
        vals = [r.metrics[key] for r in rollouts if key in r.metrics]
        if vals:
            out[f"env/{key}_rate"] = float(np.mean(vals))
    return out


def _rollout_samples(task: Any, rollouts: list[Rollout], problems: list[Any], step: int, k: int) -> list[dict]:
    out = []
    # one sample from each of the first k groups: a spread of prompts rather than k copies of one
    seen = set()
    for r in rollouts:
        if len(out) >= k:
            break
        if r.group in seen:
            continue
        seen.add(r.group)
        completion = task.decode(r.tokens)
        correct = r.metrics.get("correct")
        out.append({"step": step, "group": r.group, "prompt": task.renderer.tokenizer.decode(r.prompt_tokens),
                    "completion": completion, "parsed": task.parse_answer(completion),
                    "gold": str(problems[r.group].answer), "correct": None if correct is None else correct >= 0.5,
                    "reward": r.reward, "advantage": r.advantage, "stop_reason": r.stop_reason})
    return out
