"""The experiment's gates: restoration, activation, feasibility, design (correctness lives in correctness.py).

Each gate returns a GateReport (measured value, bound, pass/fail per check) that is written to
`<preflight dir>/preflight/<gate>.json`. A sweep with `preflight.skip=false` refuses to start unless
every gate's json says passed for this experiment's config (`require_passed`).
"""

from __future__ import annotations

import dataclasses
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
from trainer.config.schema import Config, composed_dict, config_dict, eval_items
from trainer.preflight.common import Check, GateReport
from trainer.setup import build_components, eval_task, make_loss
from trainer.tinker_params import adam_params, create_lora_training_client, served_model

# design runs second: it costs seconds and can stop a plan that cannot answer its question before the pilot
GATES = ("correctness", "design", "restoration", "activation", "feasibility")
# Keys that do not change what the gates measured (beside resume's and compare's lists, with the reasons)
_PLAN_IGNORED = PLAN_IGNORED_KEYS
ARMS = ("grpo", "dppo")


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


def arm_losses(cfg: Config) -> dict[str, dict]:
    """The resolved loss config of each arm as the gates ran them (recorded in every gate's meta)."""
    return {name: config_dict(arm_config(cfg, name))["loss"] for name in ARMS}


def _meta(cfg: Config, **extra: Any) -> dict[str, Any]:
    return {"plan_hash": plan_hash(cfg), "losses": arm_losses(cfg), **extra}


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


def arm_config_diff(overrides: list[str], conf_dir: Path | None = None) -> list[str]:
    """Top-level config keys in which the arms differ when each is composed on its own from the
    preflight's overrides (loss-group overrides left out) plus `loss=<arm>`: `["loss"]` unless a loss
    option leaks into another group."""
    from trainer.config.compose import compose_config

    base = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] != "loss"]
    arms = {name: composed_dict(compose_config(base + [f"loss={name}"], conf_dir)) for name in ARMS}
    a, b = arms[ARMS[0]], arms[ARMS[1]]
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def restoration(cfg: Config, out_dir: Path, overrides: list[str] | None = None) -> GateReport:
    """Both arms' fresh clients start identical; each reports the planned model and optimizer.
    `overrides`: the command line the preflight was composed from (each arm is composed from it)."""
    from trainer.backends import build_service_client

    report = GateReport("restoration")
    sc = build_service_client(cfg, out_dir / "engine")
    _, _, task = build_components(cfg)
    data = _fixed_batch(cfg, task)
    arms = {name: arm_config(cfg, name) for name in ARMS}
    if overrides is None:
        report.checks.append(Check("arm configs differ only in loss", None, ["loss"], "unverified",
                                   "the preflight's overrides were not given"))
    else:
        diff_keys = arm_config_diff(overrides)
        report.checks.append(Check("arm configs differ only in loss", diff_keys, ["loss"],
                                   _status(diff_keys == ["loss"]), "each arm composed on its own"))
    clients = {name: create_lora_training_client(sc, a.model, a.seed) for name, a in arms.items()}
    lp = {name: _logprobs(tc, data) for name, tc in clients.items()}
    # the backend's own bound: the embedded engine is deterministic to 1e-6; a bf16 GPU service serving
    # two clients (or a restored one) on other hardware paths is not (backend.restore_tolerance)
    tol = float(cfg.backend.restore_tolerance)
    d0 = float(np.max(np.abs(lp["grpo"] - lp["dppo"])))
    report.checks.append(Check("fresh-client logprobs max |diff|", d0, f"<= {tol:g}", _status(d0 <= tol),
                               f"{lp['grpo'].size} tokens of {len(data)} GSM8K-style sequences"))
    # one identical SFT step on both: exposes different LoRA initialisations (B=0 hides them at step 0)
    o = cfg.optimizer
    adam = adam_params(o, o.lr)
    for tc in clients.values():
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
    lp1 = {name: _logprobs(tc, data) for name, tc in clients.items()}
    d1 = float(np.max(np.abs(lp1["grpo"] - lp1["dppo"])))
    moved = float(np.max(np.abs(lp1["grpo"] - lp["grpo"])))
    report.checks.append(Check("logprobs after one identical step max |diff|", d1, f"<= {tol:g}",
                               _status(d1 <= tol), f"the step moved logprobs by up to {moved:.2e}"))
    # save -> restore with optimizer -> identical logprobs
    path = clients["grpo"].save_state("preflight_restoration").result().path
    restored = sc.create_training_client_from_state_with_optimizer(path).result()
    d2 = float(np.max(np.abs(_logprobs(restored, data) - lp1["grpo"])))
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
    report.meta = _meta(cfg, tokens=int(lp["grpo"].size))
    return report


# ----------------------------------------------------------------------------- pilot (activation, feasibility)
def run_pilot(cfg: Config, out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """A short run of the treatment arm (dppo) with the experiment's batch shape; returns its folder."""
    from trainer.backends import backend_of, build_service_client
    from trainer.loop import RLLoop
    from trainer.run_info import resolved_config_dict

    arm = arm_config(cfg, "dppo")
    schedule = dataclasses.replace(arm.schedule, num_steps=cfg.preflight.pilot_steps, save_every=0)
    pilot = dataclasses.replace(arm, schedule=schedule)
    run_dir = out_dir / f"pilot_{time.strftime('%Y%m%d-%H%M%S')}"
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


def pilot_failed(gate: str, cfg: Config, err: Exception) -> GateReport:
    """The gate's report when the pilot itself could not run: one failed check that says why."""
    report = GateReport(gate)
    report.checks.append(Check("pilot run (the treatment arm's first steps)", "failed", "completes", "fail",
                               " ".join(str(err).split())))
    report.meta = _meta(cfg)
    return report


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def activation(cfg: Config, out_dir: Path, pilot: tuple[Path, dict] | None = None) -> GateReport:
    """Does the DPPO mask actually fire at the last update of a batch (the one whose weights moved most since
    the rollouts were sampled; the second of two in the default schedule)?"""
    run_dir, result = pilot or run_pilot(cfg, out_dir)
    rows = _metrics(run_dir)
    report = GateReport("activation")
    n_updates = int(cfg.schedule.updates_per_batch)
    at_last = f"update {n_updates} of {n_updates}"
    last_rows = [r for r in rows if n_updates >= 2 and r["update"] == n_updates - 1]
    steps = sorted({r["step"] for r in rows})
    per_step = [sum(1 for r in rows if r["step"] == s) for s in steps]

    def mean_key(key: str, of: list[dict] = last_rows) -> float | None:
        vals = [r[key] for r in of if key in r]
        return float(np.mean(vals)) if vals else None

    masked = mean_key("loss/dppo_masked_frac")
    q90 = mean_key("drift/abs_p_q90")
    # The first update of a batch is on-policy: whatever drift and masking it shows is the
    # sampler-vs-trainer numeric noise of the precision that ran (fp32 ~1e-6 at q90; bf16 ~0.02, as large
    # as the drift the gate looks for). The last update's drift and mask must clear that floor, so a
    # pass means the weights moved, not that the arithmetic is coarse.
    first = [r for r in rows if r["update"] == 0]
    noise = mean_key("drift/abs_p_q90", first)
    masked_noise = mean_key("loss/dppo_masked_frac", first)
    clip = mean_key("loss/grpo_clip_frac")
    precision = result.get("precision") or {}
    ran = (f"{precision.get('sampler_dtype')} sampler / {precision.get('train_dtype')} trainer"
           + (f" (auto: {precision['auto']})" if precision.get("auto") else "")) if precision else \
        "precision chosen by the service (not reported)"
    report.checks += [
        Check("masked-token fraction at a batch's last update (mean over steps)", masked, "[0.001, 0.3]",
              _status(masked is not None and 0.001 <= masked <= 0.3),
              "no later update: updates_per_batch < 2" if not last_rows else
              # a comparison in this regime would read `inert` (the arms train alike): say where the rule acts
              ("the mask (almost) never fires here, so DPPO and GRPO would train alike; the regime where it "
               "acts on the local engine: +experiment=local_testbed (more updates per batch, a higher lr)"
               if masked is not None and masked < 0.001 else at_last)),
        Check("masked-token fraction at update 1 (noise floor)", masked_noise, "last update >= 2x this",
              _status(masked is not None and masked_noise is not None and masked >= 2 * masked_noise),
              f"on-policy: masking by numeric noise alone; {ran}"),
        Check("drift |p - p_sampler| q90 at a batch's last update", q90, ">= 0.005",
              _status(q90 is not None and q90 >= 0.005), at_last),
        Check("drift q90 at update 1 (noise floor)", noise, "last update >= 2x this",
              _status(q90 is not None and noise is not None and q90 >= 2 * noise),
              f"on-policy: the sampler-vs-trainer numeric noise; {ran}"),
        Check("counterfactual GRPO clip fraction at a batch's last update", clip, ">= 0.0005",
              _status(clip is not None and clip >= 0.0005), at_last),
        Check("executed optim steps per batch", per_step, f"== {n_updates} for every step (schedule.updates_per_batch)",
              _status(bool(per_step) and all(n == n_updates for n in per_step))),
        Check("served model", result.get("served_model"), cfg.model.base_model,
              _status(served_ok(result.get("served_model"), cfg))),
    ]
    report.meta = _meta(cfg, pilot_dir=str(run_dir), steps=len(steps), precision=precision or None,
                        noise_floor={"drift_q90": noise, "masked_frac": masked_noise})
    return report


def feasibility(cfg: Config, out_dir: Path, pilot: tuple[Path, dict] | None = None,
                n_seeds: int = 1) -> GateReport:
    """Project the full plan's wall time and tokens (2 arms x `n_seeds` runs) from the pilot's per-unit
    timings."""
    run_dir, result = pilot or run_pilot(cfg, out_dir)
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
    t_other = sum(max(0.0, r["time/step"] - r["time/sample"] - r["time/train"]) for r in st) / max(1, len(st))
    s = cfg.schedule
    rollouts_full = s.groups_per_batch * s.group_size
    rollouts_pilot = max(1, len(st) * rollouts_full)  # the pilot keeps the plan's batch shape
    per_rollout_sampled = sampled / rollouts_pilot
    per_rollout_trained = trained / rollouts_pilot
    sample_s_per_tok = t_sample / max(1, sampled)
    train_s_per_tok = t_train / max(1, trained)
    full_sampled = s.num_steps * rollouts_full * per_rollout_sampled
    full_trained = s.num_steps * rollouts_full * per_rollout_trained
    n_eval = eval_items(cfg)
    runs = 2 * n_seeds
    # each run's final eval, and the initial weights' once (a sweep shares it between its runs)
    eval_s = result.get("time/eval_per_item", 0.0) * n_eval * (runs + bool(cfg.eval.at_start))
    per_run = (result["time/setup"] + full_sampled * sample_s_per_tok + full_trained * train_s_per_tok
               + s.num_steps * t_other)
    # the runs go one after the other unless a parallel launcher is used; project the serial case
    total_min = (runs * per_run + eval_s) / 60
    budget = float(cfg.preflight.budget_minutes)
    report = GateReport("feasibility")
    report.checks += [
        Check("setup time (s)", round(result["time/setup"], 2), "measured", "pass"),
        Check("sampling time per sampled token (ms)", round(1e3 * sample_s_per_tok, 4), "measured", "pass"),
        Check("training time per trained token (ms)", round(1e3 * train_s_per_tok, 4), "measured", "pass"),
        Check("eval time per item (s)", round(result.get("time/eval_per_item", 0.0), 3), "measured", "pass"),
        Check("other time per step (s)", round(t_other, 3), "measured", "pass"),
        Check(f"projected sampled tokens (2 arms x {n_seeds} seed(s))", int(runs * full_sampled), "info", "pass"),
        Check(f"projected trained tokens (2 arms x {n_seeds} seed(s))", int(runs * full_trained), "info", "pass"),
        Check(f"projected wall time, {runs} runs serial + evals (min)", round(total_min, 1), f"<= {budget}",
              _status(total_min <= budget), "preflight.budget_minutes; joblib's parallel workers finish sooner "
              "(bench/README.md, \"Sweeps\")"),
    ]
    report.meta = _meta(cfg, pilot_dir=str(run_dir), pilot_steps=len(st), seeds_per_arm=n_seeds,
                        mean_completion_tokens=per_rollout_sampled)
    return report


# ----------------------------------------------------------------------------- design
def design(cfg: Config, out_dir: Path, n_seeds: int = 1, n_sims: int = 400) -> GateReport:
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
    report.meta = _meta(cfg, design=summary, decision=d["decision"],
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
        elif gate != "correctness" and (rep["meta"].get("losses") or {}).get(cfg.loss.name) != loss:
            ran = (rep["meta"].get("losses") or {}).get(cfg.loss.name) or {}
            keys = sorted(k for k in set(ran) | set(loss) if ran.get(k) != loss.get(k)) or ["(not recorded)"]
            problems.append(f"{gate}: passed with another {cfg.loss.name} loss config (differs in "
                            f"{', '.join('loss.' + k for k in keys)}); rerun it with this one")
    if problems:
        raise RuntimeError("preflight gates have not all passed for this config:\n  " + "\n  ".join(problems)
                           + f"\nRun: python -m trainer.preflight all +experiment={cfg.experiment} ..."
                           " (or set preflight.skip=true)")
