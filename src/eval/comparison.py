"""The comparison itself: the decision rule (the runs' pre-registered `decision` block, with any override),
the methods table of each treatment, Holm's step-down and the sequential looks, equivalence, the departures
from the pre-registered comparison that are refused (quiet paths), the A/A noise floor, the eval curve, and
writing compare.json / compare.md / the plots. Two layers: `decide(arms, rule, request)` turns any source's
Arms into one TreatmentResult per treatment (every method, Holm, the looks' level; eval.items' per-item files
come here too), and the training-runs source, `compare_runs(runs, out_dir, request)`, checks the runs (the
configs, the switch's activity, the looks ledger), builds their Arms, decides, and writes the Comparison
(eval/result.py) on runs already loaded (eval.runs.Run objects, their records read or not);
`eval.compare.compare_paths` finds and loads them first."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eval.activity import switch_activity
from eval.endpoints import (
    EndpointError,
    accuracy_by_step,
    auc_scores,
    common_steps,
    endpoint_scores,
    load_curve,
    steps_to_threshold,
)
from eval.methods import (
    METHOD_SCOPE,
    METHODS,
    McNemarExact,
    PairedBootstrap,
    PairedHoeffding,
    SeedT,
    SignFlip,
    descriptive_bootstraps,
    distribution_free_seeds,
    equivalent,
    method_table,
    min_sign_flip_p,
    resolve_method,
    rules_out_target,
    seed_t_power,
)
from eval.records import summarize, wilson_interval
from eval.result import (
    DEFAULT_BOOTSTRAP,
    DEFAULT_BOOTSTRAP_SEED,
    RUN_RULE_KEYS,
    Arms,
    CompareRequest,
    Comparison,
    Decision,
    Rule,
    TreatmentResult,
)
from eval.runs import (
    CompareError,
    Run,
    arm_named,
    check_configs,
    check_item_sets,
    check_precision,
    config_differences,
    discover_runs,
    final_step,
    find_switch,
    flatten,
    load_records,
    load_run,
    mixed_loss_paths,
    pair_by_seed,
    run_notes,
    sweep_subsets,
    value_text,
)
from eval.sequential import (
    LEDGER_DIR,
    RUN_RECORD,
    ledger_key,
    ledger_root,
    look_levels,
    read_ledger,
    read_run_records,
    record_in_run,
    record_look,
    same_decision,
    seed_set,
    setting_sha256,
)
from eval.stats import holm_adjust, paired_compare, seed_t_interval, t_quantile
from trainer.config.digest import decision_hash
from trainer.config.ignored_keys import IGNORED_CONFIG_KEYS
from trainer.utils.io import atomic_write_json, atomic_write_text

PLOTS_DIR = "compare_plots"


def resolve_rule(runs: list[Run], cli: dict[str, Any], override: bool, n_seeds: int = 1,
                 binary: bool | None = None) -> Rule:
    """The runs' pre-registered `decision` config, and the command line's changes to it (only with
    --override-decision). `auto` resolves by the seeds per arm (and, with one, by whether the scores are
    binary: `binary`, else the runs' config says so) on both sides before they are compared, so
    `--method seed_t` on a 3-seed sweep whose config says auto is not an override."""
    from trainer.config.schema import ConfigError, DecisionConfig

    raw = runs[0].config.get("decision")
    source = "config"
    if raw is None:
        raw, source = {}, "default (the runs' config has no `decision` group: made before it existed)"
    known = {f for f in DecisionConfig.__dataclass_fields__}
    if binary is None:
        binary = binary_scores(runs[0].config, cli.get("endpoint") or raw.get("endpoint") or "final")
    try:
        cfg = DecisionConfig(**{k: v for k, v in raw.items() if k in known})
    except (ConfigError, TypeError) as e:
        raise CompareError(f"run {runs[0].path}: decision config: decision.{e}") from None
    changed = []
    for key, value in cli.items():
        # the threshold only sets a secondary (reported) endpoint: changing it decides nothing
        if value is None or value == getattr(cfg, key) or key == "threshold":
            continue
        if key == "method" and (resolve_method(value, n_seeds, binary, cfg.margin)[0]
                                == resolve_method(cfg.method, n_seeds, binary, cfg.margin)[0]):
            continue
        changed.append(f"{key}: {getattr(cfg, key)!r} -> {value!r}")
    if changed and not override:
        raise CompareError("the command line asks for another decision rule than the pre-registered one ("
                           + "; ".join(changed) + "); pass --override-decision to decide with it anyway (the "
                           "report then says so), or drop those options")
    merged = {**{k: getattr(cfg, k) for k in known}, **{k: v for k, v in cli.items() if v is not None}}
    try:
        cfg = DecisionConfig(**merged)
    except ConfigError as e:
        raise CompareError(f"decision rule: {e}") from None
    method, resolution = resolve_method(cfg.method, n_seeds, binary, cfg.margin)
    return Rule(method=method, alpha=cfg.alpha, margin=cfg.margin, endpoint=cfg.endpoint, step=cfg.step,
                threshold=cfg.threshold, baseline=cfg.baseline, source=source, overridden=changed,
                requested=cfg.method, resolution=resolution, equivalence_margin=cfg.equivalence_margin,
                looks=list(cfg.looks) if cfg.looks else None, target_effect=cfg.target_effect)


def binary_scores(config: dict[str, Any], endpoint: str) -> bool:
    """Whether a run's endpoint scores are right / wrong per item: one sample per item (eval.samples_per_item
    1) and an endpoint at one eval (the area under the curve is a fraction)."""
    k = (config.get("eval") or {}).get("samples_per_item") or 1
    return k == 1 and endpoint != "auc"


def decide_all(methods_K: list[dict[str, dict[str, Any]]], samples: list[Any], names: list[tuple[str, str]],
               rule: Rule, level: float | None = None, final_look: bool = True) -> list[Decision]:
    """Holm's step-down over the treatments (`methods_K[k]`: treatment k's methods table, `samples[k]` the
    Sample it was computed on, `names[k]` its (treatment, baseline)): the j-th smallest rule p is decided at
    level L / (K - j), with the rule's own interval at that level (at K = 1 this is the plain rule); the
    first failure stops. L is alpha, or this look's share of it under decision.looks (eval.sequential).
    Where the rule neither validates nor finds the treatment worse, its interval inside
    +-decision.equivalence_margin reads `equivalent` (TOST at the same level), and its upper bound below
    decision.target_effect `not_supported`; at a look before the last, anything else reads `inconclusive`
    (the next look decides). Returns one Decision per treatment, in the order given."""
    method = METHODS[rule.method]
    L = rule.alpha if level is None else level
    K = len(methods_K)
    ps = [m[rule.method]["p"] for m in methods_K]
    adj = holm_adjust(ps)
    still = True
    out: list[Decision | None] = [None] * K
    for j, i in enumerate(sorted(range(K), key=lambda i: ps[i])):
        lev = L / (K - j)
        m = methods_K[i][rule.method]
        iv = method.interval(samples[i], lev)
        verdict = method.verdict_at(samples[i], m, lev)
        if verdict == "validated" and not still:
            verdict = "inconclusive"  # Holm stops at the first treatment that fails
        still = still and verdict == "validated"
        reason = None
        if verdict == "inconclusive" and equivalent(iv, rule.equivalence_margin):
            verdict = "equivalent"
        elif verdict == "inconclusive" and rules_out_target(iv, rule.target_effect):
            verdict = "not_supported"
        elif verdict == "inconclusive" and not final_look:
            # whatever the estimate's sign: an early look only stops for a decision
            verdict, reason = "inconclusive", "a look before the plan's last; the next look decides"
        # the top-level numbers of a comparison are the rule's: its estimate, its interval at this
        # treatment's Holm level (None for the exact tests) and its Holm-adjusted p (the rule's p when K = 1)
        d = Decision(method=rule.method, estimate=m["estimate"], p_rule=m["p"], p_holm=adj[i], holm_level=lev,
                     rule_ci=list(iv) if iv else None, p_adjusted="holm" if K > 1 else None)
        set_verdict(d, verdict, rule.scope, *names[i], reason, margin=rule.margin)
        # not what `auto` means at >= 2 seeds: said in the headline
        if rule.requested == "auto" and rule.method == McNemarExact.name:
            d.headline += (" (decision.method auto, one run per arm on right / wrong scores: exact "
                           "McNemar)")
        out[i] = d
    return [d for d in out if d is not None]


def decide(arms: Arms, rule: Rule, request: CompareRequest,
           look: dict[str, Any] | None = None) -> list[TreatmentResult]:
    """One TreatmentResult per treatment of `arms` (paired by seed and item): every method, each seed
    pair's row, the effect sizes and the Holm step-down over the treatments at this look's level (`look`:
    look_of's dict, None for one look). Training runs (compare_runs) and per-item files (eval.items) both
    come here, so both give one verdict on the same scores."""
    b_SN = arms.scores_SN[arms.baseline]
    n_bootstrap, seed = request.resamples, request.seed
    # a bootstrap that decides nothing runs only when asked for (request.n_bootstrap given)
    skip = descriptive_bootstraps(rule.method) if request.n_bootstrap is None and n_bootstrap else frozenset()
    out = []
    for loss in arms.treatments:
        t_SN = arms.scores_SN[loss]
        item, methods, sample = method_table(t_SN, b_SN, rule.alpha, rule.margin, n_bootstrap, seed, skip)
        per_seed = []
        for i, s in enumerate(arms.seeds):
            r = per_seed_row(t_SN[i], b_SN[i], rule, n_bootstrap, seed, skip)
            r.update(seed=s, treatment_arm=arms.labels[loss][i], baseline_arm=arms.labels[arms.baseline][i])
            per_seed.append(r)
        out.append(TreatmentResult(treatment=loss, baseline=arms.baseline, item=item_level(item),
                                   per_seed=per_seed, methods=methods,
                                   effect_sizes=effect_sizes(t_SN, b_SN, rule.alpha),
                                   decision=None,  # type: ignore[arg-type] - decided below, over all of them
                                   bootstrap_resamples=int(n_bootstrap), bootstrap_seed=int(seed),
                                   sample=sample,
                                   bootstrap_skipped=[k for k in METHODS if k in skip
                                                      and t_SN.shape[0] >= METHODS[k].min_seeds]))
    decisions = decide_all([r.methods for r in out], [r.sample for r in out],
                           [(r.treatment, r.baseline) for r in out], rule,
                           level=look["level"] if look else None, final_look=look is None or look["final"])
    for r, d in zip(out, decisions):
        r.decision = d
    return out


def set_verdict(d: Decision, verdict: str, scope: str, treatment: str, baseline: str,
                reason: str | None = None, margin: float = 0.0) -> None:
    """The verdict with its scope, in every form compare shows it (the token, the scope and the headline
    sentence, which says so when the rule's interval shows a gain below the margin)."""
    from eval.report import headline

    d.verdict, d.verdict_scope = verdict, scope
    d.headline = headline(verdict, scope, treatment, baseline, method=d.method, reason=reason,
                          interval=d.rule_ci, margin=margin)


# the item-level Hoeffding numbers every comparison carries, under names that say so: the top-level
# ci_low / ci_high / p / verdict of a comparison are the decision rule's
_ITEM_RENAMES = {"ci_low": "hoeffding_ci_low", "ci_high": "hoeffding_ci_high", "half_width": "hoeffding_half_width",
                 "verdict": "hoeffding_verdict"}


def item_level(pc: dict[str, Any]) -> dict[str, Any]:
    """paired_compare's dict with its Hoeffding interval and verdict renamed (see _ITEM_RENAMES)."""
    return {_ITEM_RENAMES.get(k, k): v for k, v in pc.items() if k != "method"}


def per_seed_row(t_N: np.ndarray, b_N: np.ndarray, rule: Rule, n_bootstrap: int, seed: int,
                 skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One seed pair's item-level numbers and, when the rule is item-level, the rule's own interval, p and
    verdict on that pair (about these two checkpoints). A seed-level rule has no verdict on one seed pair:
    `method` and `verdict` are None there."""
    item, methods, _ = method_table(t_N[None, :], b_N[None, :], rule.alpha, rule.margin, n_bootstrap, seed,
                                    skip)
    row = item_level(item)
    row.pop("seed_level", None)
    m = methods.get(rule.method) if METHOD_SCOPE[rule.method] == "fixed_checkpoints" else None
    row.update(method=rule.method if m else None, estimate=m["estimate"] if m else None,
               ci_low=m["ci_low"] if m else None, ci_high=m["ci_high"] if m else None, p=m["p"] if m else None,
               verdict=m["verdict"] if m else None, verdict_scope="fixed_checkpoints" if m else None)
    return row


def aa_spread(endpoint_by_seed: dict[int, np.ndarray], alpha: float) -> dict[str, Any]:
    """Between-seed spread of one arm: per-seed mean endpoint, its sd, and every seed pair's item-level test
    (what an A/B report would have said had the two seeds been the two arms)."""
    seeds = sorted(endpoint_by_seed)
    acc = {s: float(np.mean(endpoint_by_seed[s])) for s in seeds}
    pairs = []
    for i, a in enumerate(seeds):
        for b in seeds[i + 1:]:
            r = paired_compare(endpoint_by_seed[a], endpoint_by_seed[b], alpha=alpha, n_bootstrap=0)
            pairs.append({"seed_a": a, "seed_b": b, "diff": r["diff"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                          "mcnemar_p": r["mcnemar_p"], "discordance": (r["b"] + r["c"]) / r["n"],
                          "item_level_significant": bool(r["ci_low"] > 0 or r["ci_high"] < 0 or r["mcnemar_p"] < alpha)})
    values = np.array([acc[s] for s in seeds])
    return {"seeds": seeds, "accuracy_by_seed": {str(s): acc[s] for s in seeds}, "mean": float(values.mean()),
            "between_seed_sd": float(values.std(ddof=1)) if len(seeds) > 1 else None,
            "max_abs_pair_diff": max((abs(p["diff"]) for p in pairs), default=None),
            "mean_discordance": float(np.mean([p["discordance"] for p in pairs])) if pairs else None,
            "pairs": pairs, "pairs_item_level_significant": sum(p["item_level_significant"] for p in pairs)}


def aa_calibration(aa: dict[str, Any], gap_S: list[float], alpha: float) -> dict[str, Any]:
    """Is the A/B gap beyond the A/A noise floor? Two runs of the same arm at different seeds differ by
    sqrt(2) x the A/A between-seed sd; the mean of S seed-pair gaps by that / sqrt(S). The interval
    gap +- t_{K-1} x that (K = A/A seeds, whose sd is itself estimated) must exclude 0."""
    K, S = len(aa["seeds"]), len(gap_S)
    gap = float(np.mean(gap_S))
    sd = aa["between_seed_sd"]
    se = math.sqrt(2.0) * sd / math.sqrt(S)
    t_crit = t_quantile(1 - alpha / 2, K - 1)
    return {"observed_gap": gap, "aa_between_seed_sd": sd, "noise_sd_of_one_gap": math.sqrt(2.0) * sd,
            "noise_se_of_mean_gap": se, "df": K - 1, "t_crit": t_crit, "low": gap - t_crit * se,
            "high": gap + t_crit * se, "aa_max_abs_pair_diff": aa["max_abs_pair_diff"],
            "exceeds_aa_noise": bool(abs(gap) > t_crit * se),
            "exceeds_every_aa_pair": bool(abs(gap) > (aa["max_abs_pair_diff"] or 0.0))}


def quiet_paths(runs_all: list[Run], used: list[Run], paths: list[Path], losses: list[str], base: str,
                treatments: list[str], rule: Rule, n_bootstrap: int, seed: int,
                n_seeds: int) -> tuple[list[str], list[str]]:
    """(departures from the pre-registered comparison, notes). Each departure can turn a verdict into
    `validated` without changing a rule key: fewer treatments shrink Holm's family, two run folders of a
    larger sweep pick one seed pair, the bootstrap's RNG and resamples move a borderline interval, a runs'
    `decision` block edited after the preflight record (or differing between runs), fewer seeds than the
    plan. They are refused unless --override-decision, which records them like any other rule change."""
    found: list[str] = []
    notes: list[str] = []
    all_treatments = [x for x in losses if x != base]
    if sorted(treatments) != sorted(all_treatments):
        found.append(f"treatments: the runs hold {all_treatments}, --treatment keeps {treatments} (Holm's family "
                     f"shrinks from {len(all_treatments)} to {len(treatments)})")
    found += sweep_subsets(runs_all, paths)
    moved = (n_bootstrap, seed) != (DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED)
    if rule.method == PairedBootstrap.name and moved:
        found.append(f"bootstrap: {DEFAULT_BOOTSTRAP} resamples, seed {DEFAULT_BOOTSTRAP_SEED} -> {n_bootstrap} "
                     f"resamples, seed {seed} (the bootstrap decides)")
    decisions = {json.dumps(r.config.get("decision"), sort_keys=True, default=str): r for r in used}
    if len(decisions) > 1:
        arms = [f"{r.arm} ({r.path})" for r in decisions.values()]
        found.append(f"decision: the runs' `decision` blocks differ ({', '.join(arms)})")
    edited = [r for r in used
              if r.info.get("decision_sha256") not in (None, decision_hash(r.config.get("decision")))]
    if edited:
        names = ", ".join(r.arm for r in edited[:4]) + (", ..." if len(edited) > 4 else "")
        found.append(f"decision: the `decision` block in config.yaml of {names} is not the one the run "
                     "trained under (run_info.json decision_sha256): the rule was changed after training")
    # a build that records the digest always writes it (run_info_version 2, or run_dir, written with it since
    # both began): a run that lacks it had it removed, and the rule it trained under cannot be checked
    removed = [r for r in used if r.info.get("decision_sha256") is None
               and (r.info.get("run_info_version") is not None or "run_dir" in r.info)]
    lacking = [r for r in used if r.info.get("decision_sha256") is None]
    if removed or (lacking and len(lacking) < len(used)):
        names = ", ".join(r.arm for r in (removed or lacking)[:4])
        found.append(f"decision: run_info.json of {names} has no decision_sha256, though the build that "
                     "wrote it records one (or the other runs have it): the digest of the rule the run "
                     "trained under was removed, so an edit of the `decision` block cannot be ruled out")
    stripped = [r for r in used if isinstance(r.info.get("run_info_version"), int)
                and r.info["run_info_version"] >= 2 and "sweep" not in r.info]
    if stripped:
        found.append(f"inputs: run_info.json of {', '.join(r.arm for r in stripped[:4])} has no `sweep` "
                     "membership record, though the build that wrote it always writes one: it was "
                     "removed, so a subset of its sweep cannot be ruled out")
    if lacking and not removed and len(lacking) == len(used):
        notes.append(f"the rule of {', '.join(r.arm for r in lacking[:4])} was not checked against the "
                     "one it trained under: run_info.json has no decision_sha256 (a build before it was "
                     "recorded)")
    planned_look = bool(rule.looks) and n_seeds in rule.looks
    if rule.looks and not planned_look:
        found.append(f"looks: decision.looks plans decisions at {rule.looks} seeds per arm, this comparison "
                     f"has {n_seeds}")
    rec, where = preflight_record(used[0])
    other_plan = rec is not None and rec.get("plan_hash_without_decision") not in (None, _plan_key(used[0]))
    if other_plan:
        notes.append(f"the preflight design record {where} is for another plan (its config differs from the runs' "
                     "outside the decision rule): the rule was not checked against it")
        rec = None
    if rec is not None:
        planned = rec.get("decision")
        have = used[0].config.get("decision") or {}
        if planned is not None:
            diff = [f"{k}: {planned.get(k)!r} -> {have.get(k)!r}" for k in sorted(set(planned) | set(have))
                    if planned.get(k) != have.get(k)]
            if diff:
                found.append(f"decision: the runs' config differs from the preflight record {where} ("
                             + ", ".join(diff) + ")")
        n_plan = (rec.get("design") or {}).get("n_seeds")
        # a look the plan names is a planned stop, not seeds dropped (its alpha is that look's share)
        if isinstance(n_plan, int) and n_seeds < n_plan and not planned_look:
            found.append(f"seeds: the plan ({where}) has {n_plan} seeds per arm, this comparison {n_seeds}")
    elif where and not other_plan:
        notes.append(f"no preflight design record at {where}: the decision rule was not checked against a plan")
    return found, notes


def _plan_key(run: Run) -> str:
    """The run's plan hash without its decision block, as the design gate records it
    (trainer.preflight.gates.plan_hash_without_decision), from the same torch-free digest."""
    from trainer.config.digest import config_hash
    from trainer.config.ignored_keys import PLAN_IGNORED_KEYS

    return config_hash(run.config, ("hydra", "decision") + PLAN_IGNORED_KEYS)


def preflight_record(run: Run) -> tuple[dict[str, Any] | None, str | None]:
    """(the design gate's meta, its path) for the run's experiment, when the run required the gates or the
    record exists. The folder is the run's preflight.dir (default preflight_runs/<experiment>), relative to the
    folder training ran from: the current directory, else the folder above the sweep's multirun/ tree."""
    pre = run.config.get("preflight") or {}
    rel = pre.get("dir") or (f"preflight_runs/{run.config.get('experiment')}" if run.config.get("experiment") else None)
    if not rel:
        return None, None
    cands = [Path(rel)] if Path(rel).is_absolute() else [Path.cwd() / rel] + [
        a / rel for a in run.path.parents if (a / "multirun").is_dir() or (a / "conf").is_dir()]
    for c in cands:
        f = c / "preflight" / "design.json"
        if f.is_file():
            try:
                return (json.loads(f.read_text()).get("meta") or {}), str(f)
            except (OSError, ValueError):
                raise CompareError(f"run {run.path}: the preflight record {f} is not valid JSON") from None
    return None, (str(cands[0] / "preflight" / "design.json") if pre.get("skip") is False else None)


def look_of(rule: Rule, n_seeds: int) -> dict[str, Any] | None:
    """This comparison's place among decision.looks: its index, the level it decides at (its share of
    alpha, eval.sequential), whether it is the last, and the next look's seeds per arm; None without looks
    (or at a seed count no look plans, which quiet_paths refuses unless overridden)."""
    if not rule.looks or n_seeds not in rule.looks:
        return None
    k = rule.looks.index(n_seeds)
    levels = look_levels(rule.looks, rule.alpha)
    final = k == len(rule.looks) - 1
    return {"index": k + 1, "of": len(rule.looks), "looks": rule.looks, "level": levels[k],
            "levels": levels, "final": final, "next_seeds": None if final else rule.looks[k + 1]}


def _home(run: Run) -> Path:
    """Where the run was written (run_info.json run_dir) while that folder exists, else its present folder
    with links resolved (a moved or renamed training tree: the ledger moved with it)."""
    rd = run.info.get("run_dir")
    if isinstance(rd, str) and rd and Path(rd).is_dir():
        return Path(rd)
    return run.path.resolve()


def _ledger(runs: list[Run], c: Comparison,
            override: bool) -> tuple[Path, dict[str, Any], dict[str, Any], list[Path]] | None:
    """The earlier decisions of this comparison (eval.sequential: the ledger beside the runs, each run's own
    record, an earlier compare.json in the output folder), into c.looks with a note; a planned look already
    decided on another seed set is refused (recorded as an override with --override-decision). Returns
    what write_comparison records: (ledger path, this decision, the key's fields, the run folders)."""
    rule = c.rule
    folders = [r.path for r in runs if r.path.is_dir()]
    base_run = next((r for r in runs if r.key == c.baseline), runs[0])
    key_fields = {"experiment": runs[0].config.get("experiment"), "baseline": c.baseline,
                  "treatments": sorted(c.treatments), "item_set_sha256": c.arms.item_sha256,
                  "endpoint": rule.endpoint,
                  "setting_sha256": setting_sha256(flatten(base_run.config),
                                                   (*IGNORED_CONFIG_KEYS, c.switch or "loss"))}
    key = ledger_key(*key_fields.values())
    if not folders:  # runs built in memory (no run folder): no record beside them
        earlier_looks(c, None)
        return None
    path = ledger_root([_home(r) for r in runs if r.path.is_dir()]) / LEDGER_DIR / f"{key}.json"
    records = []
    for f in folders:
        try:
            records += [(x, f"{f / RUN_RECORD}") for x in read_run_records(f, key)]
        except ValueError as e:
            raise CompareError(str(e)) from None
    clash = earlier_looks(c, path, records=records)
    if clash and rule.looks:
        x, where = clash[0]
        said = x.get("verdicts") or {}
        text = (f"decision.looks: the look at {c.n_seeds} seeds per arm was already decided on seeds "
                f"{x.get('seeds')} ({', '.join(f'{k}: {v}' for k, v in said.items()) or 'verdicts unknown'}; "
                f"recorded in {where}), this comparison has seeds {c.seeds}: a look is decided once "
                "(deciding it again on other seeds re-rolls it and spends alpha the plan does not have)")
        if not override:
            raise CompareError(text + "; continue to the next look with these seeds added, or pass "
                               "--override-decision to decide anyway (the report then says so)")
        rule.overridden.append(text)
    entry = {"key": key, **key_fields, "n_seeds": c.n_seeds, "seeds": sorted(c.seeds),
             "verdicts": {r.treatment: r.verdict for r in c.rows},
             "level": (c.look or {}).get("level", rule.alpha), "planned_looks": rule.looks,
             "overridden": bool(rule.overridden), "output_dir": str(c.output_dir)}
    return path, entry, key_fields, folders


def earlier_looks(c: Comparison, path: Path | None, plannable: bool = True,
                  records: list[tuple[dict[str, Any], str]] = ()) -> list[tuple[dict[str, Any], str]]:
    """The earlier decisions of this comparison on other seed sets, from the ledger at `path` (None: no
    ledger), the runs' own `records` ((decision, where) pairs) and an earlier compare.json of the same
    comparison in the output folder, into c.looks and c.decisions (how many decisions this one makes and
    the family-wise alpha they reach), with a note when decision.looks did not plan them (`plannable`:
    whether it could have). Returns the earlier decisions at this comparison's seed count."""
    found: list[tuple[dict[str, Any], str]] = [(x, str(path)) for x in read_ledger(path)] if path else []
    found += list(records)
    prev_file = Path(c.output_dir) / "compare.json"
    if prev_file.is_file():  # a report written before the ledger existed still counts as a decision
        try:
            prev = json.loads(prev_file.read_text())
        except (OSError, ValueError):
            prev = {}
        same = (prev.get("mode") == "ab" and prev.get("item_set_sha256") == c.arms.item_sha256
                and prev.get("baseline") == c.baseline and prev.get("treatments") == c.treatments
                and (prev.get("decision") or {}).get("endpoint") == c.rule.endpoint)
        if same:
            for x in (prev.get("looks") or []) + [prev]:
                if isinstance(x, dict) and isinstance(x.get("n_seeds"), int):
                    found.append(({"n_seeds": x["n_seeds"], "seeds": x.get("seeds"),
                                   "verdicts": x.get("verdicts")}, str(prev_file)))
    this = {"n_seeds": c.n_seeds, "seeds": c.seeds}
    others: list[tuple[dict[str, Any], str]] = []
    for x, where in found:
        if not same_decision(x, this) and not any(same_decision(x, y) for y, _ in others):
            verdicts = x.get("verdicts")
            if isinstance(verdicts, list):  # compare.json's own verdict list
                verdicts = {v["treatment"]: v["verdict"] for v in verdicts if isinstance(v, dict)}
            others.append(({"n_seeds": x["n_seeds"], "seeds": x.get("seeds"), "verdicts": verdicts}, where))
    others.sort(key=lambda e: (e[0]["n_seeds"], seed_set(e[0]) or ()))
    looks = [x for x, _ in others]
    c.looks = looks
    k, a = len(looks) + 1, c.rule.alpha
    c.decisions = {"count": k, "alpha": a, "family_wise_alpha": 1 - (1 - a) ** k,
                   "planned_looks": c.rule.looks}
    wheres = sorted({w for _, w in others})
    if looks and not c.rule.looks:
        c.notes.append(
            f"decision {k} of this comparison: earlier decisions on other seeds at "
            + ", ".join(f"{x['n_seeds']} seed(s) {x['seeds']} ({x['verdicts']})" for x in looks)
            + f" (recorded in {', '.join(wheres)}); each decided at alpha = {a:g}, so the chance of a false "
            f"`validated` among these {k} decisions is up to 1 - (1 - {a:g})^{k} = {1 - (1 - a) ** k:.3g}, "
            f"not {a:g}" + (" (plan the looks: decision.looks)" if plannable else ""))
    elif looks:
        c.notes.append(f"earlier looks at this comparison: {[x['n_seeds'] for x in looks]} seeds per "
                       f"arm (recorded in {', '.join(wheres)}); decision.looks = {c.rule.looks} spends "
                       "alpha over them")
    return [(x, w) for x, w in others if x["n_seeds"] == c.n_seeds]


def prob_improvement_unpaired(x_N: np.ndarray, y_M: np.ndarray) -> float:
    """rliable's P(X > Y) (google-research/rliable @ 72fc16c3, rliable/metrics.py,
    `probability_of_improvement`, one task): scipy's Mann-Whitney U of X over Y (alternative 'greater')
    divided by N x M, i.e. the share of all N x M run pairs with x > y, a tie counting one half."""
    x = np.asarray(x_N, dtype=np.float64)[:, None]
    y = np.asarray(y_M, dtype=np.float64)[None, :]
    return float(np.mean((x > y) + 0.5 * (x == y)))


def variance_split(d_SN: np.ndarray) -> tuple[float, float, float]:
    """(var_S(D_s), item part, unbiased training part) of the per-seed mean gaps D_s = mean_i d_si. Given
    seed s's checkpoints, D_s varies with the item sample by var_i(d_si) / n (the ddof-1 sample variance is
    unbiased for it), so E[var_S(D_s)] = training variance + E[item part], and var_S(D_s) - item part is
    unbiased for the training variance; it is below 0 in many sweeps when training noise is small."""
    n = d_SN.shape[1]
    var_gap = float(np.var(d_SN.mean(axis=1), ddof=1))
    item_var = float(np.mean(d_SN.var(axis=1, ddof=1))) / n if n > 1 else 0.0
    return var_gap, item_var, var_gap - item_var


def effect_sizes(t_SN: np.ndarray, b_SN: np.ndarray, alpha: float) -> dict[str, Any]:
    """Effects people read beside the verdict (descriptive; none of them decides):
    - the paired probability of improvement (`prob_improvement`, the report's "paired probability of
      improvement"): the share of seed pairs whose treatment run scored higher than its own baseline run
      (ties count one half), with a Wilson interval over the S pairs;
    - beside it the unpaired one (`prob_improvement_unpaired`), rliable's P(X > Y) (Agarwal et al. 2021;
      google-research/rliable @ 72fc16c3, rliable/metrics.py, `probability_of_improvement`: the Mann-Whitney U
      over all N x M run pairs, every treatment seed against every baseline seed, ties one half), which
      ignores the pairing; on the first answer's gaps the two read 0.375 and 0.281;
    - the gap in between-seed sd units: the mean gap over the sd of one arm's accuracy across seeds (both
      arms' per-seed accuracies pooled), the standardised effect of Bouthillier et al. 2021;
    - the variance of a seed pair's gap split into item sampling (mean over seeds of var_i(d_si) / n, what a
      new item sample would move; unbiased for the item part) and training, the rest of the gaps' variance
      across seeds. `training_var_unbiased` = var_S(D_s) - item part is unbiased (it can be negative);
      `training_var` floors it at 0 and, with the share, is biased up when training noise is small
      (true 4 pts^2: mean 8.5 pts^2 at 3 seeds, 6.1 at 8: docs/calibration.md, `python -m eval.calibrate
      variance_split`)."""
    S = t_SN.shape[0]
    D_S = (t_SN.astype(np.float64) - b_SN.astype(np.float64)).mean(axis=1)
    out: dict[str, Any] = {"n_seed_pairs": S}
    if S < 2:
        return out
    wins = float((D_S > 0).sum() + 0.5 * (D_S == 0).sum())
    # a half win (a tied pair) widens the interval: the low end counts it as a loss, the high end as a win
    lo, hi = wilson_interval(math.floor(wins), S, alpha)[0], wilson_interval(math.ceil(wins), S, alpha)[1]
    acc_T, acc_B = t_SN.mean(axis=1), b_SN.mean(axis=1)
    pooled = math.sqrt((float(np.var(acc_T, ddof=1)) + float(np.var(acc_B, ddof=1))) / 2)
    var_gap, item_var, train_unbiased = variance_split(t_SN.astype(np.float64) - b_SN.astype(np.float64))
    train_var = max(0.0, train_unbiased)
    total = item_var + train_var
    out.update(prob_improvement=wins / S, prob_improvement_low=lo, prob_improvement_high=hi,
               prob_improvement_unpaired=prob_improvement_unpaired(acc_T, acc_B),
               between_seed_sd=pooled, gap_in_seed_sd=float(D_S.mean()) / pooled if pooled > 0 else None,
               gap_sd=math.sqrt(var_gap), item_sampling_var=item_var, training_var=train_var,
               training_var_unbiased=train_unbiased,
               item_sampling_share=item_var / total if total > 0 else None)
    return out


#: the settings a procedure-level verdict holds at: it is a claim at these values, not beyond them
SCOPE_SETTINGS = ("model.base_model", "optimizer.lr", "schedule.updates_per_batch", "schedule.num_steps",
                  "schedule.group_size", "schedule.groups_per_batch")


def scope_settings(run: Run) -> dict[str, Any]:
    flat = flatten(run.config)
    return {k: flat[k] for k in SCOPE_SETTINGS if k in flat}


def inert_reason(row: TreatmentResult) -> str:
    """Which condition made the comparison inert, and what the rule's interval says beside it."""
    per = row.activity["per_seed"]
    ident = sum(bool(x["identical_training_rows"]) for x in per)
    why = (f"identical training rows at every seed pair ({ident} of {len(per)})" if ident == len(per) else
           f"no rule of either loss fired at any update ({len(per) - ident} of {len(per)} seed pairs"
           + (f"; {ident} with identical training rows" if ident else "")
           + "), and these two losses compute the same unclipped gradient")
    iv = row.decision.rule_ci
    if iv and (iv[0] > 0 or iv[1] < 0):
        why += (f"; yet the rule's interval [{100 * iv[0]:+.2f}, {100 * iv[1]:+.2f}] pts excludes 0: the "
                "arms' scores differ although the switch never acted (look at what else differs between the "
                "arms)")
    return why


def rule_notes(rows: list[TreatmentResult], rule: Rule, n_seeds: int,
                look: dict[str, Any] | None) -> list[str]:
    """What the verdict line alone would leave unsaid: a seed-t interval of width 0, a verdict only seed t's
    normal model makes significant, too few seeds to ever decide, the next look."""
    notes = []
    for r in rows:
        m = r.methods.get(rule.method) or {}
        who = f"{r.treatment} vs {r.baseline}"
        sf = r.methods.get(SignFlip.name)
        if rule.method == SeedT.name and r.verdict == "validated" and sf and sf["p"] >= r.decision.holm_level:
            notes.append(f"{who}: only seed t's normal model makes this significant: the exact sign-flip "
                         f"test over the {n_seeds} seed pairs gives p = {sf['p']:.4g} (its smallest possible p "
                         f"is {sf['p_min']:.4g}; a distribution-free claim at alpha = {rule.alpha:g} needs "
                         f"{distribution_free_seeds(rule.alpha)} seeds per arm)")
        sl = r.seed_level or {}
        if rule.method == SeedT.name and sl.get("sd") and r.verdict == "inconclusive":
            # the design's target when the plan states one, else a gap as large as the observed one
            shift = rule.target_effect or (abs(sl["mean"]) if sl["mean"] else sl["sd"])
            what = "decision.target_effect" if rule.target_effect else "a gap as large as this one"
            pw = seed_t_power(shift, sl["sd"], n_seeds, rule.alpha)
            if pw < 0.5:
                notes.append(f"{who}: at {n_seeds} seeds per arm seed t (df {n_seeds - 1}, t crit "
                             f"{sl['t_crit']:.3g}) detects {what} "
                             f"({100 * shift:.2f} pts, "
                             f"gap sd {100 * sl['sd']:.2f} pts) with power {pw:.2f} only: below 0.5, so "
                             "`inconclusive` says little; plan the seeds with python -m eval.design --from "
                             "<this sweep>")
        if m.get("note") and r.verdict != "inert":
            notes.append(f"{who}: {m['note']}")
        if look and not look["final"] and r.verdict == "inconclusive":
            notes.append(f"{who}: look {look['index']} of {look['of']} ({n_seeds} seeds per arm, decided at "
                         f"alpha {look['level']:.3g}): no decision yet: continue to {look['next_seeds']} "
                         "seeds per arm")
    if rule.method == SignFlip.name and n_seeds < distribution_free_seeds(rule.alpha):
        notes.append(f"{SignFlip.name} cannot reach p < {rule.alpha:g} with {n_seeds} seeds per arm (its "
                     f"smallest p is {min_sign_flip_p(n_seeds):.4g}): it needs {distribution_free_seeds(rule.alpha)}")
    return notes

def _curves_and_scores(runs: list[Run], rule: Rule, order: list[int]) -> tuple[dict, list[int], dict, list[str]]:
    """Each run's eval curve, the steps all runs share, each run's endpoint scores, notes."""
    finals = {final_step(r) for r in runs}
    if len(finals) != 1:
        raise CompareError(f"the runs have different schedule.num_steps: {sorted(finals)}")
    last = finals.pop()
    try:
        curves = {r.arm: load_curve(f"{r.arm} ({r.path})", r.path / "eval", r.eval_name, last, r.records)
                  for r in runs}
        steps, notes = common_steps(curves)
        if rule.endpoint != "final" and notes:
            raise CompareError("endpoint=" + rule.endpoint + " needs the same eval steps in every run: "
                               + "; ".join(notes))
        scores = {r.arm: endpoint_scores(curves[r.arm], rule.endpoint, rule.step, steps, order, last,
                                         f"{r.arm} ({r.path})") for r in runs}
    except EndpointError as e:
        raise CompareError(str(e)) from None
    return curves, steps, scores, notes


def _stack(scores: dict[str, np.ndarray], runs: list[Run]) -> np.ndarray:
    return np.stack([scores[r.arm] for r in runs])


def _curve_table(curves: dict, steps: list[int], pairs: dict[int, dict[str, Run]], baseline: str,
                 treatments: list[str], alpha: float, threshold: float | None) -> dict[str, Any] | None:
    """Accuracy vs step per arm (mean over seeds, interval), the paired per-step difference, the
    per-item area under the curve (paired) and steps to threshold; None with fewer than 2 shared steps."""
    if len(steps) < 2:
        return None
    seeds = list(pairs)
    S = len(seeds)
    arms: dict[str, Any] = {}
    acc_SK: dict[str, np.ndarray] = {}
    for loss in [baseline] + treatments:
        a = np.array([accuracy_by_step(curves[pairs[s][loss].arm], steps) for s in seeds])
        acc_SK[loss] = a
        n_items = len(next(iter(curves[pairs[seeds[0]][loss].arm].values())))
        lows, highs = [], []
        for k in range(len(steps)):
            if S >= 2:
                st = seed_t_interval(a[:, k], alpha)
                lows.append(st["ci_low"])
                highs.append(st["ci_high"])
            else:
                lo, hi = wilson_interval(round(a[0, k] * n_items), n_items, alpha)
                lows.append(lo)
                highs.append(hi)
        arms[loss] = {"accuracy": a.mean(axis=0).tolist(), "low": [max(0.0, x) for x in lows],
                      "high": [min(1.0, x) for x in highs],
                      "interval": "t over seeds" if S >= 2 else "Wilson"}
    if threshold is None:
        threshold = float(acc_SK[baseline][:, -1].mean())
    reach = {loss: {str(s): steps_to_threshold(acc_SK[loss][i].tolist(), steps, threshold)
                    for i, s in enumerate(seeds)} for loss in acc_SK}
    per_treatment = {}
    for loss in treatments:
        rows = []
        for k, step in enumerate(steps):
            order = sorted(curves[pairs[seeds[0]][baseline].arm][step])
            t = np.stack([[curves[pairs[s][loss].arm][step][i] for i in order] for s in seeds])
            b = np.stack([[curves[pairs[s][baseline].arm][step][i] for i in order] for s in seeds])
            r = paired_compare(t, b, alpha=alpha, n_bootstrap=0)
            row = {"step": step, "diff": r["diff"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                   "mcnemar_p": r["mcnemar_p"]}
            if S >= 2:
                st = seed_t_interval((t.astype(float) - b).mean(axis=1), alpha)
                row.update(seed_t_low=st["ci_low"], seed_t_high=st["ci_high"])
            rows.append(row)
        order = sorted(curves[pairs[seeds[0]][baseline].arm][steps[-1]])
        auc_t = np.stack([auc_scores(curves[pairs[s][loss].arm], steps, order) for s in seeds])
        auc_b = np.stack([auc_scores(curves[pairs[s][baseline].arm], steps, order) for s in seeds])
        r = paired_compare(auc_t, auc_b, alpha=alpha, n_bootstrap=0)
        auc = {"treatment": r["acc_treatment"], "baseline": r["acc_baseline"], "diff": r["diff"],
               "ci_low": r["ci_low"], "ci_high": r["ci_high"], "sign_test_p": r["mcnemar_p"],
               "items_higher": r["b_items"], "items_lower": r["c_items"]}
        if S >= 2:
            st = seed_t_interval((auc_t - auc_b).mean(axis=1), alpha)
            auc.update(seed_t_low=st["ci_low"], seed_t_high=st["ci_high"])
        gaps = [reach[loss][str(s)] - reach[baseline][str(s)] for s in seeds
                if reach[loss][str(s)] is not None and reach[baseline][str(s)] is not None]
        per_treatment[loss] = {"by_step": rows, "auc": auc,
                               "steps_to_threshold_diff": gaps,
                               "steps_to_threshold_mean_diff": float(np.mean(gaps)) if gaps else None}
    return {"steps": steps, "arms": arms, "threshold": threshold, "steps_to_threshold": reach,
            "treatments": per_treatment, "per_step_tests": PER_STEP_NOTE}


# the curve's per-step intervals and p-values are many looks at one comparison: none of them is adjusted
PER_STEP_NOTE = ("unadjusted, exploratory: one interval and one p per eval step and for the area under the "
                 "curve, with no correction for the number of steps; they decide nothing (the verdict is the "
                 "decision rule's on its pre-registered endpoint)")


def _load_aa(aa: str | Path, eval_name: str, item_sha: str, ref: Run, rule: Rule, order: list[int],
             allow_config_diff: bool, switch: str = "loss", arms: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """The A/A sweep's between-seed spread on the same endpoint and items; refuses a sweep that is not an
    A/A of this experiment: several arms, or one arm whose switch value is none of the A/B arms'."""
    path = Path(aa).resolve()
    runs = [load_run(p, eval_name, job) for job, p in discover_runs(path)]
    losses = sorted({r.loss for r in runs})
    try:
        aa_switch = find_switch(runs)
    except CompareError as e:
        raise CompareError(f"--aa {path}: not an A/A sweep: {e}") from None
    if len(losses) != 1 or aa_switch is not None:
        raise CompareError(f"--aa {path}: not an A/A sweep: its runs differ in {aa_switch} (an A/A sweep runs one "
                           "arm at several seeds: python train.py --multirun loss=grpo seed=0,1,2)")
    value = losses[0] if switch == "loss" else f"{switch}={value_text(flatten(runs[0].config).get(switch))}"
    if arms and arm_named(value, switch, list(arms)) is None:
        raise CompareError(f"--aa {path}: its runs ({', '.join(r.path.name for r in runs)}) are the arm "
                           f"'{value}', none of this comparison's arms {list(arms)}")
    seeds = sorted(r.seed for r in runs)
    if len(set(seeds)) != len(seeds):
        raise CompareError(f"--aa {path}: two runs share a seed ({seeds})")
    if len(seeds) < 2:
        raise CompareError(f"--aa {path}: an A/A sweep needs >= 2 seeds, it has {seeds}")
    # the decision group only says how to read the runs, and preflight.skip only whether train.py asked for the
    # gates' records first (the A/A that measures the seed sd runs before the gates that use it): an A/A made
    # under another rule or ungated still measures the same training noise
    skip = IGNORED_CONFIG_KEYS + ("decision", "preflight.skip") + (() if switch == "loss" else (switch,))
    diffs = [f"{k}: {va!r} (A/B {ref.arm}) vs {vb!r} (A/A {r.arm})" for r in runs
             for k, va, vb in config_differences(ref.config, r.config, skip)]
    if diffs and not allow_config_diff:
        raise CompareError(f"--aa {path}: the A/A runs' configs differ from the A/B runs' outside the loss group "
                           "(another experiment or setting?); pass --allow-config-diff to use it anyway: "
                           + "; ".join(diffs[:20]))
    for r in runs:
        load_records(r)
    sha = check_item_sets(runs)
    if sha != item_sha:
        raise CompareError(f"--aa {path}: the A/A runs evaluated other items than the A/B runs (item set sha256 "
                           f"{sha[:12]} vs {item_sha[:12]})")
    _, _, scores, notes = _curves_and_scores(runs, rule, order)
    spread = aa_spread({r.seed: scores[r.arm] for r in runs}, rule.alpha)
    spread.update(sweep=str(path), loss=losses[0])
    return spread, [f"A/A: {n}" for n in notes] + [f"A/A config differs (allowed): {d}" for d in diffs]




def check_decider(rule: Rule, n_seeds: int, n_bootstrap: int, too_few: str,
                  error: type[ValueError] = CompareError) -> None:
    """Can the rule's method decide on these inputs: enough seeds per arm (`too_few` says what the inputs hold
    and what to do instead), and the bootstrap on where the method needs it."""
    decider = METHODS[rule.method]
    if n_seeds < decider.min_seeds:
        raise error(f"the decision rule is {rule.method} (over seeds), but {too_few}")
    if decider.needs_bootstrap and n_bootstrap == 0:
        raise error(f"the decision rule is {rule.method}, but --bootstrap 0 turns the bootstrap off")


def check_options(alpha: float | None, n_bootstrap: int | None,
                  error: type[ValueError] = CompareError) -> None:
    """The command line's numbers every comparison takes, checked before any input is read."""
    if alpha is not None and not 0 < alpha < 1:
        raise error(f"--alpha must be in (0, 1), got {alpha}")
    if n_bootstrap is not None and n_bootstrap < 0:
        raise error(f"--bootstrap must be >= 0, got {n_bootstrap}")


@dataclass
class RunSource:
    """The training runs of an A/B comparison as runs_source leaves them: paired by seed
    (`pairs[seed][arm]`), checked, read into Arms (whose notes collect what the checks found), with what only runs have: each
    run's eval curve, the configs' allowed differences, the A/A sweep's spread (--aa)."""

    arms: Arms
    switch: str
    pairs: dict[int, dict[str, Run]]
    ordered: list[Run]  # per seed, the baseline's run first: the reference of every check
    roles: dict[str, str]
    config_diff: list[str]
    curves: dict[str, Any]
    steps: list[int]
    scores: dict[str, np.ndarray]  # each run's endpoint scores over the item order, by run label
    aa: dict[str, Any] | None


def runs_source(runs: list[Run], rule: Rule, switch: str, req: CompareRequest,
                paths: list[Path]) -> RunSource:
    """The training-runs source: the baseline and treatments named, the runs paired by seed, their configs,
    precision and loss paths checked, their eval files read (one item set), the quiet departures from the
    pre-registered comparison refused unless overridden (then added to rule.overridden), and the --aa
    sweep read; raises CompareError on anything that does not make one paired experiment."""
    eval_name = runs[0].eval_name
    losses = sorted({r.key for r in runs})
    treatments_given = req.treatments()
    n_boot = req.resamples
    notes: list[str] = []
    base = arm_named(rule.baseline, switch, losses)
    if base is None:
        how = ("" if switch == "loss" else f"; the arms differ in {switch}, so name the baseline as "
               f"decision.baseline='{switch}=<value>' (or --baseline {losses[0]} --override-decision)")
        raise CompareError(f"the baseline '{rule.baseline}' (decision.baseline / --baseline) names no arm; the runs' "
                           f"arms are {losses} ({', '.join(str(r.path) for r in runs[:4])}"
                           f"{', ...' if len(runs) > 4 else ''}){how}")
    named = []
    for t in treatments_given:
        arm = arm_named(t, switch, losses)
        if arm is None:
            raise CompareError(f"no run has the treatment arm '{t}': the runs' arms are {losses} (set "
                               "--treatment/--baseline)")
        if arm == base:
            raise CompareError(f"--treatment and --baseline are both '{t}'")
        named.append(arm)
    treatments = named or [x for x in losses if x != base]
    runs_all = list(runs)
    left_out = [r for r in runs if r.key not in treatments and r.key != base]
    if left_out:
        notes.append("runs left out by --treatment: " + ", ".join(r.arm for r in left_out))
        runs = [r for r in runs if r not in left_out]
    pairs = pair_by_seed(runs, [base] + treatments)
    roles = {base: "baseline", **{t: "treatment" for t in treatments}}
    ordered = [pairs[s][loss] for s in pairs for loss in [base] + treatments]  # baseline first: the reference
    config_diff = check_configs(ordered, roles, switch)
    if config_diff and not req.allow_config_diff:
        # one line, naming each key with both values and runs: a second switch beside the arms' own is refused
        shown = "; ".join(config_diff[:20]) + ("; ..." if len(config_diff) > 20 else "")
        where = "the `loss` group" if switch == "loss" else f"the arms' switch `{switch}`"
        raise CompareError(f"configs differ outside {where} (a second switch, or a different experiment?); "
                           f"pass --allow-config-diff to compare anyway: {shown}")
    check_precision(ordered, req.allow_config_diff)
    mixed = mixed_loss_paths(ordered)
    if mixed and not (req.allow_mixed_loss_paths or req.allow_config_diff):
        raise CompareError(f"the runs computed their loss on different paths {mixed} (backend.loss_path=auto fell "
                           "back in some of them): rerun with a pinned backend.loss_path, or pass "
                           "--allow-mixed-loss-paths (same gradients; diagnostics are rounded differently)")
    for r in ordered:
        load_records(r)
    item_sha = check_item_sets(ordered)
    order = sorted(r["index"] for r in ordered[0].records)
    curves, steps, scores, curve_notes = _curves_and_scores(ordered, rule, order)
    notes += curve_notes
    seeds = list(pairs)
    check_decider(rule, len(seeds), n_boot,
                  f"this comparison has {len(seeds)} seed per arm ({seeds}); run >= 2 seeds (seed=0,1,2) or "
                  f"decide with an item-level method (--method {PairedHoeffding.name} --override-decision)")
    quiet, quiet_notes = quiet_paths(runs_all, ordered, paths, losses, base, treatments, rule, n_boot,
                                     req.seed, len(seeds))
    notes += quiet_notes
    if quiet and not req.override_decision:
        raise CompareError("this comparison departs from the pre-registered one (" + "; ".join(quiet) + "); pass "
                           "--override-decision to decide anyway (the report then says so), or compare the whole "
                           "sweep under its own rule")
    rule.overridden += quiet
    aa_spread_ = None
    if req.aa is not None:
        aa_spread_, aa_notes = _load_aa(req.aa, eval_name, item_sha, ordered[0], rule, order,
                                        req.allow_config_diff, switch, tuple([base] + treatments))
        notes += aa_notes

    arms = Arms(baseline=base, treatments=treatments,
                scores_SN={loss: _stack(scores, [pairs[s][loss] for s in seeds])
                           for loss in [base] + treatments},
                labels={loss: [pairs[s][loss].arm for s in seeds] for loss in [base] + treatments},
                seeds=seeds, item_order=[str(i) for i in order], item_sha256=item_sha, notes=notes)
    return RunSource(arms=arms, switch=switch, pairs=pairs, ordered=ordered, roles=roles,
                     config_diff=config_diff, curves=curves, steps=steps, scores=scores, aa=aa_spread_)


def compare_runs(runs: list[Run], out_dir: str | Path, request: CompareRequest | None = None,
                 paths: list[Path] | None = None) -> Comparison:
    """The comparison of runs already loaded (eval.runs.load_run, or Run objects built in memory with their
    `records` set: load_records keeps records it finds): every check, the statistics, and compare.json /
    compare.md / plots written into out_dir. `paths` are the folders the runs were given as (they enter the
    report and the check for a sweep's subset); the run folders by default.

    The decision rule comes from the runs' `decision` config; the request's method/alpha/margin/endpoint/
    step/threshold/baseline/equivalence_margin must equal it unless override_decision (then the report says
    what changed)."""
    req = request or CompareRequest()
    check_options(req.alpha, req.n_bootstrap)
    if not runs:
        raise CompareError("no runs to compare")
    treatments_given = req.treatments()
    if req.baseline is not None and req.baseline in treatments_given:
        raise CompareError(f"--treatment and --baseline are both '{req.baseline}'")
    out_dir = Path(out_dir)
    paths = list(paths) if paths is not None else [r.path for r in runs]
    eval_name = runs[0].eval_name
    if any(r.eval_name != eval_name for r in runs):
        raise CompareError("runs have different eval names: "
                           + ", ".join(f"{r.path.name}={r.eval_name}" for r in runs) + " (pass --eval-name)")
    rule = resolve_rule(runs, req.rule_options(*RUN_RULE_KEYS), req.override_decision,
                        n_seeds=len({r.seed for r in runs}))
    switch = find_switch(runs)
    losses = sorted({r.key for r in runs})
    if switch is None:
        if treatments_given:
            raise CompareError(f"A/A sweep passed as A/B: every run has loss '{losses[0]}' (seeds "
                               f"{sorted(r.seed for r in runs)}), so there is no treatment arm to compare; "
                               "drop --treatment for the A/A report (between-seed spread), or pass this folder "
                               "as --aa to the comparison of an A/B sweep")
        if req.aa is not None:
            raise CompareError("--aa calibrates an A/B comparison, but the runs given are themselves an A/A "
                               f"sweep (loss '{losses[0]}' only)")
        return _compare_aa(runs, rule, eval_name, paths, out_dir, req)
    src = runs_source(runs, rule, switch, req, paths)
    arms, pairs, ordered, notes = src.arms, src.pairs, src.ordered, src.arms.notes
    base, treatments, seeds = arms.baseline, arms.treatments, arms.seeds
    look = look_of(rule, len(seeds))
    rows = decide(arms, rule, req, look)
    if src.aa is not None:
        for row in rows:
            D_S = row.sample.D_S
            gaps = list(D_S) if D_S is not None else [row.item["diff"]]
            row.aa_calibration = aa_calibration(src.aa, gaps, rule.alpha)
    for row, loss in zip(rows, treatments):
        row.activity, act_notes = switch_activity({s: (pairs[s][loss], pairs[s][base]) for s in seeds},
                                                  loss_switch=src.switch == "loss")
        notes += act_notes
        if row.inert:
            set_verdict(row.decision, "inert", rule.scope, row.treatment, row.baseline,
                        reason=inert_reason(row))
    notes += rule_notes(rows, rule, len(seeds), look)
    for row in rows:  # a verdict the A/A noise floor contradicts is said next to it, not pages below
        cal = row.aa_calibration
        if cal and row.verdict == "validated" and not cal["exceeds_aa_noise"]:
            notes.append(f"{row.treatment} vs {base}: validated ({row.decision.verdict_about}), but the gap "
                         f"{100 * cal['observed_gap']:+.2f} pts does NOT exceed the A/A noise floor (interval "
                         f"[{100 * cal['low']:+.2f}, {100 * cal['high']:+.2f}] pts): two seeds of one arm differ "
                         "by as much")
    curve = _curve_table(src.curves, src.steps, pairs, base, treatments, rule.alpha, rule.threshold)
    arm_rows = [_run_row(r, src.roles[r.key], src.scores, rule.alpha) for r in ordered]
    notes += run_notes(ordered)
    c = Comparison(mode="ab", source="runs", rule=rule, arms=arms, rows=rows, arm_rows=arm_rows, notes=notes,
                   inputs=[str(p) for p in paths], output_dir=out_dir, eval_name=eval_name, switch=src.switch,
                   look=look,
                   scope_settings=scope_settings(ordered[0]) if rule.scope == "across_seeds" else None,
                   curve=curve, aa=src.aa, config_diff=src.config_diff,
                   ignored_config_keys=list(IGNORED_CONFIG_KEYS))
    ledger = _ledger(ordered, c, req.override_decision)
    return write_comparison(c, ordered, src.roles, req.make_plots, f" ({', '.join(treatments)} vs {base})",
                            ledger=ledger)


def _run_row(r: Run, role: str, scores: dict[str, np.ndarray], alpha: float) -> dict[str, Any]:
    """compare.json's entry of one run: where it is, its accuracy and Wilson interval, its endpoint mean."""
    return {"arm": r.arm, "role": role, "loss": r.loss, "value": r.key, "seed": r.seed, "run": str(r.path),
            "job": r.job, "run_name": r.info.get("arm", r.config.get("run_name")),
            "eval_file": str(r.eval_file),
            "endpoint_mean": float(np.mean(scores[r.arm])), **summarize(r.records, alpha=alpha)}


def _compare_aa(runs: list[Run], rule: Rule, eval_name: str, paths: list[Path], out_dir: Path,
                req: CompareRequest) -> Comparison:
    """One loss at several seeds: the between-seed spread (the noise floor of an A/B gap)."""
    seeds = sorted(r.seed for r in runs)
    if len(set(seeds)) != len(seeds):
        raise CompareError(f"two runs of one arm share a seed: {[r.arm for r in runs]}")
    if len(seeds) < 2:
        raise CompareError(f"one run of loss '{runs[0].loss}' only: nothing to compare (an A/A sweep needs "
                           ">= 2 seeds, an A/B sweep two losses)")
    runs = sorted(runs, key=lambda r: r.seed)
    roles = {runs[0].loss: "baseline"}
    config_diff = check_configs(runs, {runs[0].loss: "A/A"})
    if config_diff and not req.allow_config_diff:
        raise CompareError("configs differ outside the `loss` group; pass --allow-config-diff to compare anyway: "
                           + "; ".join(config_diff[:20]))
    check_precision(runs, req.allow_config_diff)
    for r in runs:
        load_records(r)
    item_sha = check_item_sets(runs)
    order = sorted(r["index"] for r in runs[0].records)
    _, _, scores, notes = _curves_and_scores(runs, rule, order)
    spread = aa_spread({r.seed: scores[r.arm] for r in runs}, rule.alpha)
    spread.update(sweep=str(paths[0]), loss=runs[0].loss)
    arm_rows = []
    for r in runs:
        row = _run_row(r, "A/A", scores, rule.alpha)
        del row["value"]
        row["run_name"] = r.info.get("arm")
        arm_rows.append(row)
    base = runs[0].loss
    arms = Arms(baseline=base, treatments=[], scores_SN={base: _stack(scores, runs)},
                labels={base: [r.arm for r in runs]}, seeds=seeds, item_order=[str(i) for i in order],
                item_sha256=item_sha, notes=notes)
    c = Comparison(mode="aa", source="runs", rule=rule, arms=arms, rows=[], arm_rows=arm_rows,
                   notes=notes + run_notes(runs), inputs=[str(p) for p in paths], output_dir=out_dir,
                   eval_name=eval_name, aa=spread, config_diff=config_diff,
                   ignored_config_keys=list(IGNORED_CONFIG_KEYS))
    return write_comparison(c, runs, roles, req.make_plots, f" (A/A: {runs[0].loss})")


def write_comparison(c: Comparison, runs: list[Run], roles: dict[str, str], make_plots: bool,
                     title_suffix: str,
                     ledger: tuple[Path, dict[str, Any], dict[str, Any], list[Path]] | None = None,
                     ) -> Comparison:
    """Everything is checked: from here on we write (the looks ledger, plots, compare.md, then compare.json
    last)."""
    out_dir = Path(c.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = c.notes
    if ledger is not None:
        path, entry, key_fields, folders = ledger
        try:
            record_look(path, entry, key_fields)
            c.looks_ledger = str(path)
        except OSError as e:
            notes.append(f"this decision was not recorded in the ledger {path} ({e}); the run folders' "
                         f"{RUN_RECORD} still count it")
        unrecorded = []
        for f in folders:  # the record that travels with the data
            try:
                record_in_run(f, entry)
            except (OSError, ValueError) as e:
                unrecorded.append(f"{f} ({e})")
        if unrecorded:
            notes.append(f"this decision was not recorded in {RUN_RECORD} of " + "; ".join(unrecorded)
                         + ": copies of those runs will not count it")
    if make_plots:
        from eval.plots import PlotRun, load_metrics, plot_eval_curve
        from eval.plots import make_plots as _make_plots

        plot_runs = []
        for r, a in zip(runs, c.arm_rows):
            rows, metric_notes = load_metrics(r.path / "metrics.jsonl")
            notes += metric_notes
            plot_runs.append(PlotRun(label=r.arm, role=roles.get(r.key, "baseline"), seed=r.seed, metrics=rows,
                                     accuracy=a["accuracy"], wilson_low=a["wilson_low"],
                                     wilson_high=a["wilson_high"]))
        files, plot_notes = _make_plots(plot_runs, out_dir / PLOTS_DIR, title_suffix)
        notes += plot_notes
        if c.curve:
            files["eval_curve"] = plot_eval_curve(c.curve, out_dir / PLOTS_DIR / "eval_curve.png",
                                                  f"Eval accuracy vs step{title_suffix}")
        c.plots = {k: os.path.relpath(v, out_dir) for k, v in files.items()}

    from eval.report import render_markdown

    atomic_write_text(out_dir / "compare.md", render_markdown(c, out_dir))
    atomic_write_json(out_dir / "compare.json", c.to_json())  # last: its presence means a complete report
    for name in ("compare.md", "compare.json"):
        os.chmod(out_dir / name, 0o644)  # the atomic writer's temp file is 0600
    return c
