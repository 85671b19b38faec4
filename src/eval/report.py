"""compare.md: the human-readable report of a paired comparison, rendered from the typed result
(eval.result.Comparison: its rule, its rows and their decisions; the methods, per-seed, effect-size and curve
tables inside them are the dicts compare.json holds).

Every number is labelled with its estimand: the item-level tests (Hoeffding, McNemar, item bootstrap)
are about *these fixed checkpoints*; the seed-level ones (t over seeds, two-level bootstrap) about
*this training procedure*."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from eval.methods import ESTIMANDS, LABELS, METHODS, McNemarExact, PairedHoeffding
from eval.result import Comparison, Rule, TreatmentResult

# what each verdict says, by scope: an item-level rule holds the trained checkpoints fixed (training noise is
# not counted), a seed-level rule is about the training procedure; `inert` says nothing about the switch
_VERDICT_TEXT = {
    ("validated", "fixed_checkpoints"): "the treatment's checkpoints scored higher than the baseline's: the rule's "
                                        "bound is above the margin; training noise is not counted, so this is "
                                        "not a finding about the training procedure",
    ("validated", "across_seeds"): "the treatment trains better: the rule's bound over seeds is above the margin",
    ("worse", "fixed_checkpoints"): ("the treatment's checkpoints scored lower than the baseline's: the "
                                     "rule's upper bound is below 0; training noise is not counted"),
    ("worse", "across_seeds"): "the treatment trains worse: the rule's upper bound over seeds is below 0",
    "inconclusive": ("no decision: the rule's interval neither clears the margin, nor lies below 0, nor "
                     "rules out the plan's target gain"),
    "not_supported": ("the rule's interval rules out the plan's target gain (decision.target_effect): its "
                      "upper bound is below it; a smaller gain, or none, is not ruled out"),
    "equivalent": ("the rule's interval (of non-zero width) lies inside +-the equivalence margin (two "
                   "one-sided tests at the rule's level): any difference is smaller than the margin"),
    "inert": "the switch never acted in these runs; nothing is said about it",
}
_SCOPE_TEXT = {"fixed_checkpoints": "these checkpoints", "across_seeds": "this training procedure"}


def verdict_text(verdict: str, scope: str) -> str:
    return _VERDICT_TEXT.get((verdict, scope)) or _VERDICT_TEXT[verdict]


def headline(verdict: str, scope: str, treatment: str, baseline: str, method: str | None = None,
             reason: str | None = None, interval: list[float] | tuple[float, float] | None = None,
             margin: float = 0.0) -> str:
    """`<verdict> (<scope>): <treatment> vs <baseline>: <what it means>`, the line a reader sees first. A
    method's own sentence replaces the generic one where that would not fit its numbers (the exact McNemar
    test's `worse` counts items, not points); `reason` says which condition fired (inert, an early look). A
    gain the rule's interval shows above 0 but not above the margin is said (`interval`, `margin`)."""
    own = getattr(METHODS.get(method or ""), "worse_text", None) if verdict == "worse" else None
    text = own or verdict_text(verdict, scope)
    if reason and verdict == "inconclusive":  # an early look: the generic sentence would describe the numbers
        text = f"no decision yet ({reason})"
    elif reason:
        text = text.replace("; nothing is said", f" ({reason}); nothing is said")
    if (interval is not None and margin > 0 and 0 < interval[0] <= margin
            and verdict in ("inconclusive", "not_supported", "equivalent")):
        text += (f"; the treatment did score higher (lower bound {100 * interval[0]:+.2f} pts > 0), by less "
                 f"than the margin {100 * margin:.2f} pts can show")
    return f"{verdict} ({_SCOPE_TEXT[scope]}): {treatment} vs {baseline}: {text}"


_PLOT_TITLES = {
    "reward": "Training reward (env/reward_mean) per rollout step",
    "masked_frac": "DPPO masked fraction (loss/dppo_masked_frac) per update",
    "clip_frac": "GRPO clip fraction (loss/grpo_clip_frac) per update",
    "drift_q90": "Drift |p - p_sampler| q90 (drift/abs_p_q90) per update",
    "accuracy": "Eval accuracy per arm with Wilson intervals",
    "eval_curve": "Eval accuracy vs step per arm (paired items)",
}
def _name(method: str) -> str:
    return LABELS[method]


def render_markdown(c: Comparison, out_dir: str | Path) -> str:
    """Markdown for the comparison `c`; plot links are relative to out_dir."""
    lines = _aa_report(c) if c.mode == "aa" else _ab_report(c)
    lines += _categories(c)
    lines += _tail(c)
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- A/B
def _ab_report(c: Comparison) -> list[str]:
    rule = c.rule
    conf = 100.0 * (1.0 - rule.alpha)
    rows = c.rows
    first = rows[0]
    lines = [(f"# Paired comparison: {', '.join(c.treatments)} (treatment{'s' if len(rows) > 1 else ''}) vs "
              f"{c.baseline} (baseline)"), "",
             (f"Eval: `{c.eval_name}`, {first.item['n_items']} items x {c.n_seeds} seed(s) "
              f"= {first.item['n']} paired (seed, item) results per arm; endpoint: {_endpoint(rule)}."), ""]
    if len(rows) == 1:
        lines += [f"## Verdict: **{first.verdict}** ({first.decision.verdict_about})", ""]
    else:
        lines += ["## Verdicts (Holm-adjusted over the treatments)", "",
                  "| treatment | diff | rule interval at its Holm level | rule p | Holm p | verdict |",
                  "|---|---:|---|---:|---:|---|"]
        for r in rows:
            d = r.decision
            lines.append(f"| {r.treatment} | {_pts(r.methods[rule.method]['estimate'])} | "
                         f"{_ci(d.rule_ci)} (alpha {d.holm_level:.4g}) | {_p(d.p_rule)} | "
                         f"{_p(d.p_holm)} | **{d.verdict}** ({d.verdict_about}) |")
        lines.append("")
    for r in rows:
        lines.append(f"- {verdict_line(r, rule)}")
    items = c.source == "items"
    lines += ["", _scope_sentence(c), ""]
    not_pre = ("the command line's options" if rule.source.startswith("the command line") else rule.source)
    lines += [("## Decision rule (pre-registered)" if rule.pre_registered else
               f"## Decision rule (not pre-registered: {not_pre})") if not rule.overridden else
              "## Decision rule (OVERRIDDEN on the command line with --override-decision)", "",
              f"> {rule.text()}. Estimand: {ESTIMANDS[rule.method]}.", ""]
    if rule.overridden:
        lines += ["The pre-registered rule was changed: " + "; ".join(rule.overridden)
                  + ". This verdict is not the pre-registered one.", ""]
    if rule.source != "config":
        lines += [f"Rule source: {rule.source}.", ""]
    lines += [("`validated` needs the rule's lower bound above the margin (exact McNemar, a test "
               "without an interval: more discordant items favour the treatment, b > c, and p < alpha); "
               "`worse`: the upper bound is below 0 (McNemar: c > b and p < alpha); `equivalent`: the "
               "interval, of non-zero width, lies inside +-decision.equivalence_margin; `not_supported`: the "
               "interval's upper bound is below decision.target_effect (the plan's target gain); `inert`: "
               "the switch never acted in these runs; otherwise `inconclusive`. The other methods below are "
               "secondary: they do not change the verdict."), ""]
    if rule.requested == "auto":
        lines += [(f"The rule's method was resolved from the {'files' if items else 'sweep'}: "
                   f"{rule.resolution}."), ""]
    if rule.method == PairedHoeffding.name and rule.endpoint != "auc":
        hw = first.item["hoeffding_half_width"]
        lines += [(f"At n = {first.item['n_items']} items and alpha = {rule.alpha:g} the Hoeffding "
                   f"half-width is {hw:.4f}, so `validated` needs a gap above {_pts(hw + rule.margin)}."), ""]
    for r in rows:
        if r.inert:
            lines += _inert_section(r)
    for r in rows:
        lines += _methods_section(r, rule, len(rows) > 1)
        lines += _seeds_section(r, c)
        lines += _effects_section(r)
        if r.aa_calibration:
            lines += _aa_calibration_section(r, c)
    if c.curve:
        lines += _curve_section(c)
    lines += _arms_section(c, conf)
    return lines


def verdict_line(r: TreatmentResult, rule: Rule) -> str:
    """The headline with the rule's estimate and its interval (or p), as compare.md and the terminal show it."""
    d = r.decision
    conf = 100.0 * (1.0 - d.holm_level)
    m = r.methods.get(rule.method) or {}
    p = _p(d.p, m.get("p_resolution"))
    p_text = f"Holm-adjusted p = {p}" if d.p_adjusted == "holm" else f"p = {p}"
    interval = (f"{conf:.4g}% interval [{_pts(d.ci_low)}, {_pts(d.ci_high)}]"
                if d.ci_low is not None else p_text)
    if rule.method == McNemarExact.name and m.get("b_items") is not None:
        interval += (f"; items favouring the treatment b = {m['b_items']}, the baseline c = {m['c_items']}, "
                     f"two-sided p = {_p(m['p_two_sided'])}")
    why = f" {m['note'][0].upper()}{m['note'][1:]}." if m.get("note") and d.verdict != "inert" else ""
    return f"{d.headline}: {_name(rule.method)} estimate {_pts(d.estimate)} ({interval}).{why}"


def _inert_section(r: TreatmentResult) -> list[str]:
    lines = [f"## The switch never acted: {r.treatment} vs {r.baseline}", "",
             ("Every seed pair trained identically (the objective value aside), or with both arms' rule fractions "
              "at 0 at every update (no token masked or clipped by either arm's own rule, nor by the other arm's "
              "rule computed counterfactually), so the arms computed the same updates: the numbers below measure "
              "nothing about the switch. Run the regime where the rule acts (the activation gate says where, e.g. "
              "`+experiment=local_dppo_mask`)."), "",
             "| seed | updates | identical training rows | largest rule fraction |", "|---:|---:|---|---|"]
    for x in r.activity["per_seed"]:
        fr = x["max_rule_fraction"] or {}
        top = max(fr.items(), key=lambda kv: kv[1]) if fr else None
        lines.append(f"| {x['seed']} | {x['updates']} | {x['identical_training_rows']} | "
                     f"{'-' if top is None else f'{top[1]:g} ({top[0]})'} |")
    return lines + [""]


def _scope_sentence(c: Comparison) -> str:
    S = c.n_seeds
    if S == 1 and c.source == "items":
        return ("**Scope: these fixed checkpoints.** One file per arm: the verdict concerns the two trained "
                "checkpoints and cannot separate the training procedure from training noise (two trainings "
                "at different seeds can differ by as much). Give each arm one file per training seed (>= 2, "
                "`NAME=FILE,FILE,...`) to learn about the procedure; one arm's files alone give the "
                "between-seed spread.")
    if S == 1:
        return ("**Scope: these fixed checkpoints.** One seed per arm: the verdict concerns the two trained "
                "checkpoints and cannot separate the loss from training noise (two runs of the same loss at "
                "different seeds can differ by as much). Run >= 2 seeds per arm, and an A/A sweep "
                "(`--multirun loss=<baseline> seed=0,1,2`, passed as `--aa`), to learn about the loss.")
    if c.verdict_scope == "across_seeds":
        at = ", ".join(f"{k} = {v}" for k, v in (c.scope_settings or {}).items())
        return (f"**Scope: this training procedure.** The rule's unit is the seed ({S} seed pairs): the verdict "
                "is about the loss, with training noise counted, at the settings the arms share"
                + (f" ({at}): a claim at these values, not beyond them." if at else "."))
    return (f"**Scope: these fixed checkpoints.** The rule is item-level: it treats the {2 * S} trained "
            f"checkpoints as fixed, so it does not count training noise; the seed-level numbers below ({S} "
            "seed pairs) are the ones about the training procedure.")


def _methods_section(r: TreatmentResult, rule: Rule, several: bool) -> list[str]:
    conf = 100.0 * (1.0 - rule.alpha)
    title = f"## All methods: {r.treatment} vs {r.baseline}" if several else "## All methods"
    lines = [title, "", f"| method | estimand | estimate | {conf:g}% interval | p (gain > margin) | verdict | role |",
             "|---|---|---:|---|---:|---|---|"]
    for name, m in r.methods.items():
        iv = "-" if m["ci_low"] is None else f"[{_pts(m['ci_low'])}, {_pts(m['ci_high'])}]"
        role = ("**decision**" if name == rule.method else "descriptive" if m["verdict"] is None
                else "secondary")
        lines.append(f"| {_name(name)} | {m['estimand']} | {_pts(m['estimate'])} | {iv} | "
                     f"{'-' if m['p'] is None else _p(m['p'], m.get('p_resolution'))} | {m['verdict'] or '-'} "
                     f"| {role} |")
    notes = [f"{_name(name)}: {m['note']}" for name, m in r.methods.items() if m.get("note")]
    if notes:
        lines += [""] + [f"- {x}" for x in notes]
    item_rule = r.per_seed and r.per_seed[0].get("method")
    lines += ["", "## Results per seed" if not several else f"### Per seed: {r.treatment}", "",
              "| scope | n | acc " + r.treatment + " | acc " + r.baseline + " | diff | Hoeffding CI | b | c "
              "| McNemar p | bootstrap CI | rule's verdict on this pair |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|"]
    whole = r.to_json()  # the item-level numbers over all seeds, with the rule's verdict
    rows = [(f"seed {s['seed']}", s) for s in r.per_seed]
    rows = rows + [("**combined**", whole)] if len(rows) != 1 else [(f"seed {r.per_seed[0]['seed']}", whole)]
    for label, x in rows:
        boot = ("-" if x.get("bootstrap_low") is None
                else f"[{_pts(x['bootstrap_low'])}, {_pts(x['bootstrap_high'])}]")
        lines.append(f"| {label} | {x['n']} | {x['acc_treatment']:.4f} | {x['acc_baseline']:.4f} | {_pts(x['diff'])} "
                     f"| [{_pts(x['hoeffding_ci_low'])}, {_pts(x['hoeffding_ci_high'])}] | {x['b_items']} "
                     f"| {x['c_items']} | {_p(x['mcnemar_p'])} | {boot} | {x.get('verdict') or '-'} |")
    lines += ["", (f"Per seed pair, the rule's verdict is {_name(item_rule)}'s on that pair alone (these "
                   "two checkpoints)." if item_rule else
                   "The rule is seed-level: one seed pair has no verdict of its own.")]
    lines += ["", ("b = items the treatment got right and the baseline wrong; c = the reverse. "
                   + _bootstrap_sentence(r))]
    if r.item["n_seeds"] > 1:
        lines += ["", ("The combined row averages each item over its seeds, because one item's results across "
                       "seeds are correlated: n counts (seed, item) results, while the Hoeffding CI uses the "
                       f"{r.item['n_items']} items as the independent unit, b / c count items whose "
                       "seed-mean difference is positive / negative, and the bootstrap resamples whole items. Discordant "
                       f"(seed, item) pairs: {r.item['b']} / {r.item['c']}.")]
    return lines + [""]


def _bootstrap_sentence(r: TreatmentResult) -> str:
    """How many resamples the bootstrap drew, and which descriptive bootstraps were skipped (they run only
    where they decide, or when --bootstrap asks for them)."""
    if not r.bootstrap_skipped:
        return f"Bootstrap: {r.bootstrap_resamples} percentile resamples of items (seed {r.bootstrap_seed})."
    skipped = ", ".join(_name(k) for k in r.bootstrap_skipped)
    if any(METHODS[k].needs_bootstrap for k in r.methods):
        return (f"Bootstrap: {r.bootstrap_resamples} percentile resamples of items (seed "
                f"{r.bootstrap_seed}), for the rule; skipped where it decides nothing ({skipped}): "
                "`--bootstrap N` runs those too.")
    return (f"Bootstrap: skipped ({skipped}): under this rule it decides nothing; `--bootstrap N` runs it "
            "(N resamples).")


def _effects_section(r: TreatmentResult) -> list[str]:
    es = r.effect_sizes or {}
    if "prob_improvement" not in es:
        return []
    z = es["gap_in_seed_sd"]
    share = es["item_sampling_share"]
    return [f"### Effect sizes ({r.treatment} - {r.baseline}; descriptive, none decides)", "",
            (f"Paired probability of improvement (paired_prob_improvement; compare.json `prob_improvement`) "
             f"over the {es['n_seed_pairs']} seed pairs (treatment run above its own baseline run; ties count "
             f"half): {es['prob_improvement']:.2f} [{es['prob_improvement_low']:.2f}, "
             f"{es['prob_improvement_high']:.2f}] (Wilson)"
             + ("" if es.get("prob_improvement_unpaired") is None else
                f"; unpaired, rliable's P(X > Y) over all seed x seed pairs: "
                f"{es['prob_improvement_unpaired']:.2f}")
             + ". Gap in between-seed sd units: "
             f"{'-' if z is None else f'{z:+.2f}'} (between-seed sd of one arm {_size(es['between_seed_sd'])})."),
            (f"Variance of a seed pair's gap (sd {_size(es['gap_sd'])}): item sampling "
             f"{'-' if share is None else f'{100 * share:.0f}%'}, training (seed) noise "
             f"{'-' if share is None else f'{100 * (1 - share):.0f}%'}: more items narrow only the first part, "
             "more seeds both. The training part is floored at 0, so the split overstates it when training "
             "noise is small"
             + ("" if es.get("training_var_unbiased") is None else
                f"; the unbiased (unfloored) training variance is {_var(es['training_var_unbiased'])}")
             + "."), ""]


def _seeds_section(r: TreatmentResult, c: Comparison) -> list[str]:
    sl = r.seed_level
    if not sl:
        return []
    conf = 100.0 * (1.0 - c.rule.alpha)
    per = ", ".join(f"seed {s}: {_pts(d)}" for s, d in zip(c.seeds, sl["per_seed_diff"]))
    lines = [f"### Seed level ({r.treatment} - {r.baseline}): this training procedure", "",
             f"Per-seed paired differences: {per}.",
             (f"Mean {_pts(sl['mean'])}, sd over seeds {_size(sl['sd'])}; Student t {conf:g}% interval (df "
              f"{sl['df']}, t = {sl['t_crit']:.3f}) [{_pts(sl['t_ci_low'])}, {_pts(sl['t_ci_high'])}], p = "
              f"{_p(sl['t_p'])}.")]
    if sl.get("two_level_low") is not None:
        lines.append(f"Two-level bootstrap (seeds, then items within each seed) {conf:g}% interval "
                     f"[{_pts(sl['two_level_low'])}, {_pts(sl['two_level_high'])}]; with few seeds it is too "
                     "narrow (a resample of S seeds sees at most S distinct values), so read the t interval.")
    return lines + [""]


def _aa_calibration_section(r: TreatmentResult, comparison: Comparison) -> list[str]:
    c, aa = r.aa_calibration, comparison.aa
    yes = "exceeds" if c["exceeds_aa_noise"] else "does NOT exceed"
    return [f"### A/A calibration ({r.treatment} vs {r.baseline})", "",
            (f"A/A sweep `{aa['sweep']}` ({aa['loss']}, seeds {aa['seeds']}): between-seed sd of the endpoint "
             f"{_size(c['aa_between_seed_sd'])}; two runs of the same loss differ by sd "
             f"{_size(c['noise_sd_of_one_gap'])}, the mean of {comparison.n_seeds} seed-pair gap(s) by "
             f"{_size(c['noise_se_of_mean_gap'])}. Observed gap {_pts(c['observed_gap'])}, noise interval "
             f"(t, df {c['df']}) [{_pts(c['low'])}, {_pts(c['high'])}]: the gap **{yes}** the A/A noise floor. "
             f"Largest A/A seed-pair gap {_size(c['aa_max_abs_pair_diff'])} "
             f"({'exceeded' if c['exceeds_every_aa_pair'] else 'not exceeded'})."), ""]


def _curve_section(c: Comparison) -> list[str]:
    cv = c.curve
    steps = cv["steps"]
    lines = ["## Eval curve (efficiency endpoints)", "",
             "| step | " + " | ".join(f"acc {k} [{v['interval']}]" for k, v in cv["arms"].items()) + " |",
             "|---:|" + "---|" * len(cv["arms"])]
    for k, s in enumerate(steps):
        lines.append(f"| {s} | " + " | ".join(f"{v['accuracy'][k]:.4f} [{v['low'][k]:.3f}, {v['high'][k]:.3f}]"
                                               for v in cv["arms"].values()) + " |")
    lines += ["", f"Steps to reach accuracy {cv['threshold']:.4f} (first eval at or above it; None = never): "
              + "; ".join(f"{loss}: " + ", ".join(f"seed {s} {'never' if v is None else f'step {v}'}"
                                                  for s, v in d.items())
                          for loss, d in cv["steps_to_threshold"].items()) + "."]
    for loss, t in cv["treatments"].items():
        a = t["auc"]
        seed_iv = (f", t over seeds [{_pts(a['seed_t_low'])}, {_pts(a['seed_t_high'])}]"
                   if "seed_t_low" in a else "")
        lines += ["", (f"### {loss} vs {c.baseline} per step (paired on the same items; unadjusted, "
                       "exploratory)"), "",
                  f"Per-step tests: {cv.get('per_step_tests', 'unadjusted, exploratory')}.", "",
                  ("| step | diff | Hoeffding CI (fixed checkpoints, unadjusted) | McNemar p (unadjusted) "
                   "| t over seeds (unadjusted) |"),
                  "|---:|---:|---|---:|---|"]
        for row in t["by_step"]:
            st = (f"[{_pts(row['seed_t_low'])}, {_pts(row['seed_t_high'])}]" if "seed_t_low" in row else "-")
            lines.append(f"| {row['step']} | {_pts(row['diff'])} | [{_pts(row['ci_low'])}, {_pts(row['ci_high'])}] "
                         f"| {_p(row['mcnemar_p'])} | {st} |")
        lines += ["", (f"Area under the eval curve per item (normalised to [0, 1], trapezoid over steps {steps}): "
                       f"{a['treatment']:.4f} vs {a['baseline']:.4f}, paired diff {_pts(a['diff'])}, Hoeffding "
                       f"[{_pts(a['ci_low'])}, {_pts(a['ci_high'])}]{seed_iv}; items higher / lower "
                       f"{a['items_higher']} / {a['items_lower']} (sign test p = {_p(a['sign_test_p'])}). "
                       f"Steps-to-threshold gap per seed (treatment - baseline): {t['steps_to_threshold_diff']}.")]
    return lines + [""]


# ----------------------------------------------------------------------------- A/A
def _aa_report(c: Comparison) -> list[str]:
    aa = c.aa
    rule = c.rule
    lines = [f"# A/A comparison: {aa['loss']} at seeds {aa['seeds']} (no treatment)", "",
             (f"Eval: `{c.eval_name}`, {c.n_items} items; endpoint: {_endpoint(rule)}. "
              + ("Every file is one arm's, at another seed: any difference between them is training noise "
                 "(seed), as far as the files say. This is the noise floor an A/B gap must clear; with each A/B "
                 "arm's files at several seeds, the seed-level rule counts it." if c.source == "items"
                 else "Every run has the same loss and config: any difference between them is training noise "
                 "(seed). This is the noise floor an A/B gap must clear; pass this folder as `--aa` to an A/B "
                 "comparison.")), "",
             "## Between-seed spread", "",
             "| seed | endpoint mean |", "|---:|---:|"]
    lines += [f"| {s} | {a:.4f} |" for s, a in aa["accuracy_by_seed"].items()]
    lines += ["", (f"Mean {aa['mean']:.4f}, between-seed sd {_size(aa['between_seed_sd'])}, largest seed-pair gap "
                   f"{_size(aa['max_abs_pair_diff'])}, mean item discordance between two seeds "
                   f"{aa['mean_discordance']:.3f}."), "",
              "## What an item-level test says about two seeds of the same loss", "",
              "| seeds | diff | Hoeffding CI | McNemar p | discordance | item-level 'significant' |",
              "|---|---:|---|---:|---:|---|"]
    for p in aa["pairs"]:
        lines.append(f"| {p['seed_a']} vs {p['seed_b']} | {_pts(p['diff'])} | [{_pts(p['ci_low'])}, "
                     f"{_pts(p['ci_high'])}] | {_p(p['mcnemar_p'])} | {p['discordance']:.3f} | "
                     f"{'yes' if p['item_level_significant'] else 'no'} |")
    lines += ["", (f"{aa['pairs_item_level_significant']} of {len(aa['pairs'])} seed pairs are 'significant' for an "
                   "item-level test (Hoeffding bound or McNemar p < alpha): those tests are about fixed "
                   "checkpoints, and two checkpoints of the same loss are different checkpoints."), ""]
    lines += _arms_section(c, 100.0 * (1.0 - rule.alpha))
    return lines


def _categories(c: Comparison) -> list[str]:
    """Per-item files with categories (eval.items): the rule on each category, Holm over all the rows."""
    cats = c.categories
    if not cats:
        return []
    lines = _category_accuracy(cats)
    lines += ["", (f"## Per category (secondary: {cats['multiplicity']}, {cats['family_size']} rows; they "
                   "decide nothing)"), "",
             ("| treatment | category | items | diff | rule interval at its Holm level | rule p | Holm p "
              "| result |"),
             "|---|---|---:|---:|---|---:|---:|---|"]
    for r in cats["rows"]:
        lines.append(f"| {r['arm']} | {r['category']} | {r['n_items']} | {_pts(r['estimate'])} | "
                     f"{_ci(r['rule_ci'])} (alpha {r['holm_level']:.4g}) | {_p(r['p_rule'])} | "
                     f"{_p(r['p_holm'])} | {r['verdict']} |")
    return lines


def _category_accuracy(cats: dict[str, Any]) -> list[str]:
    """Each arm's accuracy per category (an lm-eval task: the number its results json shows), averaged over
    seeds."""
    acc = cats.get("accuracy")
    if not acc:
        return []
    arms = list(dict.fromkeys(r["arm"] for r in acc))
    by = {(r["arm"], r["category"]): r for r in acc}
    kind = cats.get("kind", "category")
    lines = ["", f"## Accuracy per {kind} and arm (mean over seeds)", "",
             f"| {kind} | metric | items | " + " | ".join(f"acc {a}" for a in arms) + " |",
             "|---|---|---:|" + "---:|" * len(arms)]
    for c in cats["names"]:
        first = by[arms[0], c]
        lines.append(f"| {c} | {first['metric']} | {first['n_items']} | "
                     + " | ".join(f"{by[a, c]['accuracy']:.4f}" for a in arms) + " |")
    return lines


# ----------------------------------------------------------------------------- shared
def _arms_section(c: Comparison, conf: float) -> list[str]:
    lines = ["## Arms", "", f"| arm | role | seed | n | accuracy | Wilson {conf:g}% CI | endpoint mean | run |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for a in c.arm_rows:
        lines.append(f"| {a['arm']} | {a['role']} | {a['seed']} | {a['n']} | {a['accuracy']:.4f} "
                     f"| [{a['wilson_low']:.4f}, {a['wilson_high']:.4f}] | {a['endpoint_mean']:.4f} | `{a['run']}` |")
    return lines


def _tail(c: Comparison) -> list[str]:
    lines: list[str] = []
    if c.plots:
        lines += ["", "## Plots", ""]
        for name, rel in c.plots.items():
            lines += [f"### {_PLOT_TITLES.get(name, name)}", "", f"![{name}]({rel})", ""]
    notes = list(c.notes)
    if c.config_diff:
        notes.insert(0, "configs differ outside the `loss` group (allowed by --allow-config-diff): "
                     + "; ".join(c.config_diff))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {x}" for x in notes]
    ignored = ", ".join(f"`{k}`" for k in c.ignored_config_keys)
    lines += ["", "## Inputs", "", f"- ignored config keys: {ignored}",
              f"- item set sha256: `{c.arms.item_sha256}`"]
    lines += [f"- {a['arm']}: `{a['eval_file']}`" for a in c.arm_rows]
    return lines


def _endpoint(rule: Rule) -> str:
    return {"final": "final accuracy", "step": f"accuracy at step {rule.step}",
            "auc": "per-item area under the eval curve"}[rule.endpoint]


def _ci(iv: list[float] | None) -> str:
    return "-" if not iv else f"[{_pts(iv[0])}, {_pts(iv[1])}]"


def _size(x: float | None) -> str:
    """An unsigned size (sd, se, gap magnitude) in percentage points."""
    return "-" if x is None else f"{100.0 * x:.2f} pts"


def _var(x: float) -> str:
    """A variance of accuracy differences in squared percentage points (signed: an unbiased estimate can be
    below 0)."""
    return f"{1e4 * x:+.2f} pts^2"


def _pts(x: float | None) -> str:
    """A difference as signed percentage points."""
    if x is None:
        return "-"
    return f"{100.0 * x:+.2f} pts"


def _p(p: float, resolution: float | None = None) -> str:
    """A p-value; a resampling p of 0 (no resample at or beyond the observed) is `< 1/R`, R resamples."""
    if p == 0 and resolution:
        return f"< {resolution:.2g} (1/R)"
    if p == 0 or (p < 1e-4 and not math.isnan(p)):
        return f"{p:.2e}"
    return f"{p:.4f}"


if __name__ == "__main__":
    # `python -m eval.report <run folder>`: the single-run report (eval/run_report.py); this module's
    # own job is compare.md, written by `python -m eval.compare`
    import sys

    from eval.run_report import main

    sys.exit(main())
