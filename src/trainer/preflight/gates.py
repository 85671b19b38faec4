"""The experiment's gates: restoration, activation, feasibility, design (correctness lives in correctness.py).

Each gate returns a GateReport (measured value, bound, pass/fail per check) that is written to
`<preflight dir>/preflight/<gate>.json`. A sweep with `preflight.skip=false` refuses to start unless
every gate's json says passed for this experiment's config (`require_passed`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker

from eval.greedy import greedy_eval_budgets, run_greedy_eval
from trainer.config.compose import arm_config
from trainer.config.digest import config_hash
from trainer.config.ignored_keys import PLAN_IGNORED_KEYS
from trainer.config.losses import own_rule, rule_label
from trainer.config.schema import Config, composed_dict, config_dict, eval_items
from trainer.preflight.common import Check, GateReport
from trainer.setup import build_components, eval_task, make_loss
from trainer.tinker_params import adam_params, create_lora_training_client, served_model

# design runs second: it costs seconds and can stop a plan that cannot answer its question before the pilot
GATES = ("correctness", "design", "restoration", "activation", "feasibility")
# Keys that do not change what the gates measured (beside resume's and compare's lists, with the reasons)
_PLAN_IGNORED = PLAN_IGNORED_KEYS


class PlanError(ValueError):
    """The plan names no arms the gates can compare (a bad `loss=` axis or decision.baseline)."""


@dataclasses.dataclass(frozen=True)
class Arms:
    """The plan's arms: `decision.baseline` and the sweep's other losses (the treatments), in sweep order."""

    baseline: str
    treatments: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.baseline, *self.treatments)

    def label(self, treatment: str, text: str) -> str:
        """A per-treatment check's name: `text` as it reads in a two-arm plan, `<treatment>: text` beside
        other treatments (one report holds them all)."""
        return text if len(self.treatments) == 1 else f"{treatment}: {text}"


def plan_arms(cfg: Config, overrides: list[str] | None = None) -> Arms:
    """The arms of the plan `cfg` was composed from: the `loss` values of the sweep's jobs (the command
    line's `loss=a,b,c`, else the experiment's `hydra.sweeper.params.loss`), the baseline
    `decision.baseline`. `overrides`: the preflight's command line; None reads the axis of the experiment
    `cfg.experiment` names (conf/experiment/<name>.yaml), as eval.compare pairs each treatment with the
    baseline. With no loss axis the plan's arms are the baseline and the config's own loss if it differs."""
    from eval.design import job_values, plan_jobs
    from trainer.config.compose import CONF_DIR

    if overrides is None:
        overrides = ([f"+experiment={cfg.experiment}"]
                     if (CONF_DIR / "experiment" / f"{cfg.experiment}.yaml").is_file() else [])
    losses = [v for v in job_values(plan_jobs(overrides)[1], "loss") if v is not None]
    baseline = cfg.decision.baseline
    if not losses:
        losses = [baseline] + ([cfg.loss.name] if cfg.loss.name != baseline else [])
    if baseline not in losses:
        raise PlanError(f"decision.baseline={baseline} is not one of the sweep's losses "
                        f"(loss={','.join(losses)})")
    return Arms(baseline, tuple(v for v in losses if v != baseline))


def require_treatments(arms: Arms) -> tuple[str, ...]:
    """The plan's treatments; PlanError when it has none (a gate that compares arms cannot run)."""
    if not arms.treatments:
        raise PlanError(f"the plan has no treatment arm beside the baseline {arms.baseline}: give the "
                        f"sweep's losses (loss={arms.baseline},<treatment>) or an experiment with a loss "
                        "axis")
    return arms.treatments


def preflight_dir(cfg: Config) -> Path:
    return Path(cfg.preflight.dir or f"preflight_runs/{cfg.experiment}")


def plan_hash(cfg: Config) -> str:
    return plan_hash_of(config_dict(cfg))


def plan_hash_of(cfg_dict: dict) -> str:
    """The plan hash of a config in its written form (config.yaml's dict)."""
    return config_hash(cfg_dict, ("hydra",) + _PLAN_IGNORED)


def plan_hash_without_decision(cfg_dict: dict) -> str:
    """The plan hash with the `decision` block left out: eval.compare matches a sweep's recorded config.yaml to
    this design record by it, so that a record of the same plan whose runs carry an edited rule is found."""
    return config_hash(cfg_dict, ("hydra", "decision") + _PLAN_IGNORED)


def arm_losses(cfg: Config, arms: Arms | None = None) -> dict[str, dict]:
    """The resolved loss config of each arm as the gates ran them (recorded in every gate's meta)."""
    return {name: config_dict(arm_config(cfg, name))["loss"] for name in (arms or plan_arms(cfg)).names}


def _meta(cfg: Config, arms: Arms | None = None, **extra: Any) -> dict[str, Any]:
    return {"plan_hash": plan_hash(cfg), "losses": arm_losses(cfg, arms), **extra}


def planned_models(cfg: Config) -> list[str]:
    pm = cfg.preflight.planned_models
    return list(pm) if pm else [cfg.model.base_model]


def served_ok(served: Any, cfg: Config) -> bool:
    """The service serves the model this config asks for, and the plan allows it (a stand-in listed in
    planned_models for offline rehearsal passes only when the config itself runs that stand-in)."""
    return served == cfg.model.base_model and served in planned_models(cfg)


def _status(ok: bool) -> str:
    return "pass" if ok else "fail"


# ----------------------------------------------------------------------------- restoration
def _fixed_batch(cfg: Config, task: Any, n: int = 4) -> list[tinker.Datum]:
    """Prompt + gold answer of the first n train problems, tokenized with the run's renderer."""
    import asyncio

    data = []
    for p in task.train_problems()[:n]:
        env = task.make_env(p)
        prompt, _ = asyncio.run(env.initial_observation())
        ans = env.renderer.tokenizer.encode(f"The answer is \\boxed{{{p.answer}}}.", add_special_tokens=False)
        toks = prompt.to_ints() + list(ans)
        toks = toks[: cfg.model.max_seq_len]
        T = len(toks) - 1
        data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(np.asarray(toks[1:], dtype=np.int64)),
            "weights": tinker.TensorData.from_numpy(np.ones(T, dtype=np.float32))}))
    return data


def _logprobs(tc: Any, data: list[tinker.Datum]) -> np.ndarray:
    out = tc.forward(data, "cross_entropy").result()
    return np.concatenate([np.asarray(o["logprobs"].to_numpy(), dtype=np.float64).ravel()
                           for o in out.loss_fn_outputs])


def arm_config_diff(overrides: list[str], conf_dir: Path | None = None,
                    arms: Arms | None = None) -> list[str]:
    """Top-level config keys in which a treatment differs from the baseline when each arm is composed on
    its own from the preflight's overrides (loss-group overrides left out) plus `loss=<arm>`: `["loss"]`
    unless a loss option leaks into another group. `arms`: the plan's (default: read from `overrides`)."""
    from trainer.config.compose import compose_config, run_config

    base = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] != "loss"]
    if arms is None:
        arms = plan_arms(run_config(base, conf_dir), overrides)
    composed = {name: composed_dict(compose_config(base + [f"loss={name}"], conf_dir)) for name in arms.names}
    a = composed[arms.baseline]
    return sorted({k for t in require_treatments(arms) for b in (composed[t],) for k in set(a) | set(b)
                   if a.get(k) != b.get(k)})


def restoration(cfg: Config, out_dir: Path, overrides: list[str] | None = None,
                arms: Arms | None = None) -> GateReport:
    """Every treatment's fresh client starts identical to the baseline's; each arm reports the planned
    model and optimizer. `overrides`: the command line the preflight was composed from (each arm is
    composed from it); `arms`: the plan's (default: `plan_arms`)."""
    from trainer.backends import build_service_client

    arms = arms or plan_arms(cfg, overrides)
    base, treatments = arms.baseline, require_treatments(arms)
    report = GateReport("restoration")
    sc = build_service_client(cfg, out_dir / "engine")
    _, _, task = build_components(cfg)
    data = _fixed_batch(cfg, task)
    arm_cfgs = {name: arm_config(cfg, name) for name in arms.names}
    for t in treatments:
        name = arms.label(t, "arm configs differ only in loss")
        if overrides is None:
            report.checks.append(Check(name, None, ["loss"], "unverified",
                                       "the preflight's overrides were not given"))
        else:
            diff_keys = arm_config_diff(overrides, arms=Arms(base, (t,)))
            report.checks.append(Check(name, diff_keys, ["loss"], _status(diff_keys == ["loss"]),
                                       "each arm composed on its own"))
    clients = {name: create_lora_training_client(sc, a.model, a.seed) for name, a in arm_cfgs.items()}
    lp = {name: _logprobs(tc, data) for name, tc in clients.items()}
    # the backend's own bound: the embedded engine is deterministic to 1e-6; a bf16 GPU service serving
    # two clients (or a restored one) on other hardware paths is not (backend.restore_tolerance)
    tol = float(cfg.backend.restore_tolerance)
    for t in treatments:
        d0 = float(np.max(np.abs(lp[base] - lp[t])))
        report.checks.append(Check(arms.label(t, "fresh-client logprobs max |diff|"), d0, f"<= {tol:g}",
                                   _status(d0 <= tol),
                                   f"{lp[base].size} tokens of {len(data)} GSM8K-style sequences"))
    # one identical SFT step on every arm: exposes different LoRA initialisations (B=0 hides them at step 0)
    o = cfg.optimizer
    adam = adam_params(o, o.lr)
    for tc in clients.values():
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
    lp1 = {name: _logprobs(tc, data) for name, tc in clients.items()}
    moved = float(np.max(np.abs(lp1[base] - lp[base])))
    for t in treatments:
        d1 = float(np.max(np.abs(lp1[base] - lp1[t])))
        report.checks.append(Check(arms.label(t, "logprobs after one identical step max |diff|"), d1,
                                   f"<= {tol:g}", _status(d1 <= tol),
                                   f"the step moved logprobs by up to {moved:.2e}"))
    # save -> restore with optimizer -> identical logprobs
    path = clients[base].save_state("preflight_restoration").result().path
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    d2 = float(np.max(np.abs(_logprobs(restored, data) - lp1[base])))
    report.checks.append(Check("save_state -> restore logprobs max |diff|", d2, f"<= {tol:g}", _status(d2 <= tol)))
    for name, tc in clients.items():
        info = tc.get_info()
        served = served_model(info)
        report.checks.append(Check(f"{name}: served model", served, cfg.model.base_model,
                                   _status(served_ok(served, cfg))))
        rank = getattr(info, "lora_rank", None)
        report.checks.append(Check(f"{name}: LoRA rank", rank, cfg.model.lora_rank,
                                   _status(rank == cfg.model.lora_rank) if rank is not None else "unverified"))
        opt = getattr(info, "optimizer_config", None)
        opt_type = getattr(opt, "type", None) if opt is not None else None
        report.checks.append(Check(f"{name}: optimizer family", opt_type, "adamw",
                                   _status(opt_type == "adamw") if opt_type else "unverified",
                                   "" if opt_type else "the client does not report its optimizer"))
        # Adam hyper-parameters travel with every optim_step request; the server does not echo them back
        report.checks.append(Check(f"{name}: Adam lr/betas/eps on the server",
                                   None, {"lr": o.lr, "beta1": o.beta1, "beta2": o.beta2, "eps": o.eps},
                                   "unverified", "not introspectable through the client API; sent per step"))
    report.meta = _meta(cfg, arms, tokens=int(lp[base].size))
    return report


# ----------------------------------------------------------------------------- pilot (activation, feasibility)
Pilot = tuple[Path, dict[str, Any]]


def run_pilot(cfg: Config, out_dir: Path, treatment: str | None = None) -> Pilot:
    """A short run of a treatment arm (default: the plan's only one) with the experiment's batch shape;
    returns its folder and result."""
    from trainer.backends import backend_of, build_service_client
    from trainer.loop import RLLoop
    from trainer.run_info import resolved_config_dict

    if treatment is None:
        treatments = require_treatments(plan_arms(cfg))
        if len(treatments) != 1:
            raise PlanError(f"the plan has treatments {', '.join(treatments)}: name the one to pilot")
        treatment = treatments[0]
    arm = arm_config(cfg, treatment)
    schedule = dataclasses.replace(arm.schedule, num_steps=cfg.preflight.pilot_steps, save_every=0)
    pilot = dataclasses.replace(arm, schedule=schedule)
    # the arm in the name: the pilots of one plan start within the same second
    run_dir = out_dir / f"pilot_{treatment}_{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    sc = build_service_client(pilot, run_dir)
    _, renderer, task = build_components(pilot)
    loop = RLLoop(pilot, run_dir, sc, task, make_loss(pilot, sc), resolved_config_dict(pilot), progress=False)
    setup_s = time.time() - t0
    t1 = time.time()
    result = loop.run()
    result["time/setup"] = setup_s
    result["time/pilot"] = time.time() - t1
    result["served_model"] = loop.info.get("served_model")
    result["precision"] = backend_of(pilot).precision(sc)
    # eval timing on a few items (per item, projected to the full eval)
    etask = eval_task(pilot, renderer, task)
    if etask is not None:
        n = int(cfg.preflight.pilot_eval_items)
        t2 = time.time()
        summ = run_greedy_eval(etask, etask.test_problems(n), loop.sampling_client(), **greedy_eval_budgets(pilot),
                               retry=loop.retry, check_determinism=False)
        result["time/eval_per_item"] = (time.time() - t2) / max(1, summ["n"])
    from trainer.utils.io import atomic_write_json

    atomic_write_json(run_dir / "result.json", result)
    return run_dir, result


def pilot_failed(gate: str, cfg: Config, err: Exception, arms: Arms | None = None,
                 treatment: str | None = None) -> GateReport:
    """The gate's report when a pilot itself could not run: one failed check that says why."""
    arms = arms or plan_arms(cfg)
    report = GateReport(gate)
    name = "pilot run (the treatment arm's first steps)"
    report.checks.append(Check(arms.label(treatment, name) if treatment else name, "failed", "completes",
                               "fail", " ".join(str(err).split())))
    report.meta = _meta(cfg, arms)
    return report


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _pilots(cfg: Config, out_dir: Path, arms: Arms,
            pilot: Pilot | dict[str, Pilot] | None) -> dict[str, Pilot]:
    """Each treatment's pilot: the given ones (a bare (folder, result) is the only treatment's), the rest
    run."""
    treatments = require_treatments(arms)
    if pilot is not None and not isinstance(pilot, dict):
        if len(treatments) != 1:
            raise PlanError(f"one pilot given for the treatments {', '.join(treatments)}")
        pilot = {treatments[0]: pilot}
    given = dict(pilot or {})
    return {t: given[t] if t in given else run_pilot(cfg, out_dir, t) for t in treatments}


def _flat(per: dict[str, dict]) -> dict[str, Any]:
    """Per-treatment meta: at the top level in a two-arm plan (as its records always read), else by arm."""
    return next(iter(per.values())) if len(per) == 1 else {"treatments": per}


def activation(cfg: Config, out_dir: Path, pilot: Pilot | dict[str, Pilot] | None = None,
               arms: Arms | None = None) -> GateReport:
    """Does each treatment's own rule (RULE_TABLE: the first rule the loss owns; DPPO's mask, CPPO's mask)
    actually fire at the last update of a batch (the one whose weights moved most since the rollouts were
    sampled; the second of two in the default schedule)? One pilot per treatment; the baseline's rule is
    read as its counterfactual in the treatment's run."""
    arms = arms or plan_arms(cfg)
    report = GateReport("activation")
    per = {}
    for t, (run_dir, result) in _pilots(cfg, out_dir, arms, pilot).items():
        per[t] = _activation_checks(cfg, arms, t, run_dir, result, report)
    report.meta = _meta(cfg, arms, **_flat(per))
    return report


def _activation_checks(cfg: Config, arms: Arms, treatment: str, run_dir: Path, result: dict,
                       report: GateReport) -> dict[str, Any]:
    """Append the activation checks of one treatment's pilot to `report`; return that pilot's meta."""
    rows = _metrics(run_dir)
    own, base_rule = own_rule(treatment), own_rule(arms.baseline)
    own_key = f"loss/{own}_frac" if own else None
    base_key = f"loss/{base_rule}_frac" if base_rule else None
    n_updates = int(cfg.schedule.updates_per_batch)
    at_last = f"update {n_updates} of {n_updates}"
    last_rows = [r for r in rows if n_updates >= 2 and r["update"] == n_updates - 1]
    steps = sorted({r["step"] for r in rows})
    per_step = [sum(1 for r in rows if r["step"] == s) for s in steps]

    def mean_key(key: str, of: list[dict] = last_rows) -> float | None:
        vals = [r[key] for r in of if key in r]
        return float(np.mean(vals)) if vals else None

    masked = mean_key(own_key) if own_key else None
    q90 = mean_key("drift/abs_p_q90")
    # The first update of a batch is on-policy: whatever drift and masking it shows is the
    # sampler-vs-trainer numeric noise of the precision that ran (fp32 ~1e-6 at q90; bf16 ~0.02, as large
    # as the drift the gate looks for). The last update's drift and mask must clear that floor, so a
    # pass means the weights moved, not that the arithmetic is coarse.
    first = [r for r in rows if r["update"] == 0]
    noise = mean_key("drift/abs_p_q90", first)
    masked_noise = mean_key(own_key, first) if own_key else None
    clip = mean_key(base_key) if base_key else None
    precision = result.get("precision") or {}
    ran = (f"{precision.get('sampler_dtype')} sampler / {precision.get('train_dtype')} trainer"
           + (f" (auto: {precision['auto']})" if precision.get("auto") else "")) if precision else \
        "precision chosen by the service (not reported)"
    T, B = treatment.upper(), arms.baseline.upper()
    if own_key is None:
        masked_detail = f"{treatment} owns no rule in the rule table: nothing to see fire"
    elif not last_rows:
        masked_detail = "no later update: updates_per_batch < 2"
    elif masked is not None and masked < 0.001:
        # a comparison in this regime would read `inert` (the arms train alike): say where the rule acts
        masked_detail = (f"the mask (almost) never fires here, so {T} and {B} would train alike; the regime "
                         "where it acts on the local engine: +experiment=local_testbed (more updates per "
                         "batch, a higher lr)")
    else:
        masked_detail = at_last
    counterfactual = f"counterfactual {rule_label(base_rule)}" if base_rule else f"counterfactual {B} rule"
    name = functools.partial(arms.label, treatment)
    report.checks += [
        Check(name("masked-token fraction at a batch's last update (mean over steps)"), masked,
              "[0.001, 0.3]", _status(masked is not None and 0.001 <= masked <= 0.3), masked_detail),
        Check(name("masked-token fraction at update 1 (noise floor)"), masked_noise, "last update >= 2x this",
              _status(masked is not None and masked_noise is not None and masked >= 2 * masked_noise),
              f"on-policy: masking by numeric noise alone; {ran}"),
        Check(name("drift |p - p_sampler| q90 at a batch's last update"), q90, ">= 0.005",
              _status(q90 is not None and q90 >= 0.005), at_last),
        Check(name("drift q90 at update 1 (noise floor)"), noise, "last update >= 2x this",
              _status(q90 is not None and noise is not None and q90 >= 2 * noise),
              f"on-policy: the sampler-vs-trainer numeric noise; {ran}"),
        Check(name(f"{counterfactual} fraction at a batch's last update"), clip, ">= 0.0005",
              _status(clip is not None and clip >= 0.0005), at_last if base_key else
              f"{arms.baseline} owns no rule in the rule table"),
        Check(name("executed optim steps per batch"), per_step,
              f"== {n_updates} for every step (schedule.updates_per_batch)",
              _status(bool(per_step) and all(n == n_updates for n in per_step))),
        Check(name("served model"), result.get("served_model"), cfg.model.base_model,
              _status(served_ok(result.get("served_model"), cfg))),
    ]
    return {"pilot_dir": str(run_dir), "steps": len(steps), "precision": precision or None,
            "noise_floor": {"drift_q90": noise, "masked_frac": masked_noise}, "rule": own_key}


def feasibility(cfg: Config, out_dir: Path, pilot: Pilot | dict[str, Pilot] | None = None,
                n_seeds: int = 1, arms: Arms | None = None) -> GateReport:
    """Project the full plan's wall time and tokens (every arm x `n_seeds` runs) from the pilots' per-unit
    timings: each treatment's runs from its own pilot, the baseline's (not piloted) from the costliest
    treatment's."""
    arms = arms or plan_arms(cfg)
    report = GateReport("feasibility")
    s = cfg.schedule
    rollouts_full = s.groups_per_batch * s.group_size
    per, runs_of = {}, {}
    for t, (run_dir, result) in _pilots(cfg, out_dir, arms, pilot).items():
        rows = _metrics(run_dir)
        step_rows = {}
        for r in rows:
            step_rows.setdefault(r["step"], r)  # step-level metrics repeat on every update row
        st = list(step_rows.values())
        sampled = sum(r["tokens/sampled"] for r in st)
        trained = sum(r["tokens/trained"] for r in st)
        t_sample = sum(r["time/sample"] for r in st)
        t_train = sum(r["time/train"] for r in st)
        # the rest of a step (the sampler weight save, datum building, logging), per step
        t_other = (sum(max(0.0, r["time/step"] - r["time/sample"] - r["time/train"]) for r in st)
                   / max(1, len(st)))
        rollouts_pilot = max(1, len(st) * rollouts_full)  # the pilot keeps the plan's batch shape
        per_rollout_sampled = sampled / rollouts_pilot
        per_rollout_trained = trained / rollouts_pilot
        sample_s_per_tok = t_sample / max(1, sampled)
        train_s_per_tok = t_train / max(1, trained)
        full_sampled = s.num_steps * rollouts_full * per_rollout_sampled
        full_trained = s.num_steps * rollouts_full * per_rollout_trained
        per_run = (result["time/setup"] + full_sampled * sample_s_per_tok + full_trained * train_s_per_tok
                   + s.num_steps * t_other)
        runs_of[t] = {"sampled": full_sampled, "trained": full_trained, "s": per_run,
                      "eval_per_item": result.get("time/eval_per_item", 0.0)}
        name = functools.partial(arms.label, t)
        report.checks += [
            Check(name("setup time (s)"), round(result["time/setup"], 2), "measured", "pass"),
            Check(name("sampling time per sampled token (ms)"), round(1e3 * sample_s_per_tok, 4), "measured",
                  "pass"),
            Check(name("training time per trained token (ms)"), round(1e3 * train_s_per_tok, 4), "measured",
                  "pass"),
            Check(name("eval time per item (s)"), round(result.get("time/eval_per_item", 0.0), 3), "measured",
                  "pass"),
            Check(name("other time per step (s)"), round(t_other, 3), "measured", "pass"),
        ]
        per[t] = {"pilot_dir": str(run_dir), "pilot_steps": len(st),
                  "mean_completion_tokens": per_rollout_sampled}
    costliest = max(runs_of.values(), key=lambda r: r["s"])
    arm_runs = [*runs_of.values(), costliest]  # one per arm: the treatments', then the baseline's
    n_eval = eval_items(cfg)
    runs = len(arm_runs) * n_seeds
    # each run's final eval, and the initial weights' once (a sweep shares it between its runs)
    eval_s = sum(r["eval_per_item"] * n_eval * n_seeds for r in arm_runs) \
        + costliest["eval_per_item"] * n_eval * bool(cfg.eval.at_start)
    # the runs go one after the other unless a parallel launcher is used; project the serial case
    total_min = (n_seeds * sum(r["s"] for r in arm_runs) + eval_s) / 60
    budget = float(cfg.preflight.budget_minutes)
    plan = f"{len(arm_runs)} arms x {n_seeds} seed(s)"
    report.checks += [
        Check(f"projected sampled tokens ({plan})", int(n_seeds * sum(r["sampled"] for r in arm_runs)),
              "info", "pass"),
        Check(f"projected trained tokens ({plan})", int(n_seeds * sum(r["trained"] for r in arm_runs)),
              "info", "pass"),
        Check(f"projected wall time, {runs} runs serial + evals (min)", round(total_min, 1), f"<= {budget}",
              _status(total_min <= budget), "preflight.budget_minutes; joblib's parallel workers finish sooner "
              "(bench/README.md, \"Sweeps\")"),
    ]
    report.meta = _meta(cfg, arms, seeds_per_arm=n_seeds, **_flat(per))
    return report


# ----------------------------------------------------------------------------- design
def design(cfg: Config, out_dir: Path, n_seeds: int = 1, n_sims: int = 400,
           arms: Arms | None = None) -> GateReport:
    """What the plan can detect (eval.design with the config's decision group and design assumptions).
    It reports every method's minimum detectable effect; it fails when decision.target_effect is set and the
    plan's own decision method cannot detect it at decision.power, and on eval.design's problems of the rule
    (plan_problems: false positives above alpha under the seed sd, an item-level method for a procedure-level
    target, the seed sd unstated on a multi-seed plan), unless decision.design_problems=warn."""
    from eval.design import METHODS, clipped_share, plan_from_config
    from eval.design import design as run_design

    plan = plan_from_config(cfg, n_seeds)
    res = run_design(plan, n_sims=n_sims, n_bootstrap=200, plot=Path(out_dir) / "preflight" / "design_power.png")
    report = GateReport("design")
    for k in METHODS:
        mde = res["mde"][k]
        report.checks.append(Check(f"MDE at power {plan.power:g}: {k}", mde, "info", "pass",
                                   "decision method" if k == plan.method else "secondary"))
    report.checks.append(Check("seeds per arm for a distribution-free claim (sign_flip)",
                               plan.n_seeds, f">= {res['distribution_free_min_seeds']}", "pass",
                               "info: below it only seed t's normal model can make a procedure-level verdict "
                               "significant"))
    mde = res["mde"][plan.method]
    if plan.target_effect is None:
        report.checks.append(Check("decision method detects the target effect", mde, "no target", "pass",
                                   "decision.target_effect is null: the design is reported, not enforced"))
    else:
        report.checks.append(Check("decision method detects the target effect", mde, f"<= {plan.target_effect}",
                                   _status(bool(res["detectable"])),
                                   f"{plan.method} at {plan.n_items} items x {plan.n_seeds} seed(s); items needed "
                                   f"{res['items_needed'][plan.method]}, seeds needed {res['seeds_needed'][plan.method]}"))
    # a rule that cannot hold its own error rate under the stated seed noise, or that answers another question
    # than the target asks, fails (decision.design_problems=warn: reported, not enforced)
    strict = cfg.decision.design_problems == "fail"
    for problem in res["problems"]:
        report.checks.append(Check("decision rule calibrated for the plan", plan.method,
                                   "false positives <= alpha, scope matches the target, seed sd stated",
                                   _status(not strict), problem if strict else f"WARNING (not enforced): {problem}"))
    for warning in res["warnings"]:
        # a warning, not a failure: the simulation's noise is a lower bound there, and the detail says so
        report.checks.append(Check("design assumptions consistent (share of simulated seed gaps clipped)",
                                   round(clipped_share(plan), 4), "<= 0.01 (above: a warning, not enforced)",
                                   "pass", f"WARNING: {warning}"))
    summary = {k: v for k, v in res.items() if k != "power_curve"}
    # the pre-registered rule as planned: eval.compare refuses (or records as an override) a sweep whose
    # `decision` block differs from it, or that has fewer seeds than planned
    d = config_dict(cfg)
    report.meta = _meta(cfg, arms, design=summary, decision=d["decision"],
                        plan_hash_without_decision=plan_hash_without_decision(d))
    return report


def require_passed(cfg: Config) -> None:
    """Raise unless every gate's json in the preflight folder passed for this plan."""
    d = preflight_dir(cfg) / "preflight"
    h = plan_hash(cfg)
    loss = config_dict(cfg)["loss"]
    from trainer.run_info import git_revision

    code = git_revision()
    problems = []
    for gate in GATES:
        p = d / f"{gate}.json"
        if not p.exists():
            problems.append(f"{gate}: not run ({p} missing)")
            continue
        rep = json.loads(p.read_text())
        if not rep.get("passed"):
            problems.append(f"{gate}: FAILED")
        elif gate == "correctness" and (rep.get("meta") or {}).get("git") != code:
            was = (rep.get("meta") or {}).get("git") or {}
            problems.append(f"correctness: passed for other code (git {was.get('rev')}, dirty {was.get('dirty')}; "
                            f"this is {code.get('rev')}, dirty {code.get('dirty')}); rerun it (seconds)")
        elif gate != "correctness" and rep.get("meta", {}).get("plan_hash") != h:
            problems.append(f"{gate}: passed for a different config (plan hash {rep.get('meta', {}).get('plan_hash')}"
                            f" != {h}); rerun it")
        elif gate != "correctness" and cfg.loss.name not in (rep["meta"].get("losses") or {}):
            ran = ", ".join(rep["meta"].get("losses") or {}) or "(not recorded)"
            problems.append(f"{gate}: ran the arms {ran}, not {cfg.loss.name}; rerun it with the sweep's "
                            "losses")
        elif gate != "correctness" and (rep["meta"].get("losses") or {}).get(cfg.loss.name) != loss:
            ran = (rep["meta"].get("losses") or {}).get(cfg.loss.name) or {}
            keys = sorted(k for k in set(ran) | set(loss) if ran.get(k) != loss.get(k)) or ["(not recorded)"]
            problems.append(f"{gate}: passed with another {cfg.loss.name} loss config (differs in "
                            f"{', '.join('loss.' + k for k in keys)}); rerun it with this one")
    if problems:
        raise RuntimeError("preflight gates have not all passed for this config:\n  " + "\n  ".join(problems)
                           + f"\nRun: python -m trainer.preflight all +experiment={cfg.experiment} ..."
                           " (or set preflight.skip=true)")
