"""Did the switch that tells the arms apart act at all? (`inert`): the runs' own training metrics, seed pair
by seed pair."""

from __future__ import annotations

import re
from typing import Any

from eval.runs import Run
from trainer.config.losses import rules_owned_by

# metric families that describe the training itself (wall-clock, fault and eval keys differ between any two runs)
_TRAINING_FAMILIES = ("loss/", "env/", "drift/", "entropy/", "mismatch/", "ratio/", "optim/", "tokens/")


# each loss's own objective value: different functions of the same tokens, unequal even when the gradients
# are identical (GRPO's clipped surrogate vs DPPO's REINFORCE surrogate), so it says nothing about whether
# the arms trained alike
_OBJECTIVE_KEYS = ("loss/value",)


def _rule_fraction_keys(losses: tuple[str, ...]) -> re.Pattern[str]:
    """loss/<rule>_frac of the two arms' own rules (the rule table's owners: grpo -> grpo_clip, dppo ->
    dppo_masked): every loss logs every rule's fraction, its own and the counterfactual ones (what the other
    arm's rule would have done to the same tokens). Rules of losses outside the comparison (a GSPO sequence
    clip in a GRPO vs DPPO sweep) do not tell the two arms apart."""
    return re.compile(r"^loss/(" + "|".join(re.escape(x) for x in rules_owned_by(losses)) + r")_frac$")


#: losses whose gradient, where no rule clips or masks a token, is the same r A grad log p (GRPO's and CISPO's
#: clipped ratio, DPPO's and CPPO's masked REINFORCE and importance sampling all reduce to it). GSPO is not
#: among them: its gradient carries the sequence's geometric-mean ratio s in place of the token ratio, so two
#: arms of which one is GSPO train differently even when no rule fires
SAME_UNCLIPPED_GRADIENT = frozenset({"grpo", "dppo", "cppo", "cispo", "importance_sampling"})


def switch_activity(pairs: dict[int, tuple[Run, Run]], loss_switch: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Did the switch that tells the arms apart act at all? Per seed pair (treatment, baseline): the largest
    fraction of the two arms' rules either arm logged at any update, and whether the two runs' training rows
    (the metric families in _TRAINING_FAMILIES but the objective value, update by update) are identical. The
    comparison is `inert` when every seed pair shows one of the two: both arms' rule fractions 0 at every
    update (no token was masked or clipped by either rule, so the losses computed the same gradients: only
    for two losses in SAME_UNCLIPPED_GRADIENT), or identical training rows (the arms trained identically).
    Then the verdict says nothing about the switch: the runs never exercised it. A switch other than the loss
    (a learning rate, updates per batch) acts without any rule firing: only identical rows count there."""
    from eval.plots import load_metrics

    per_seed, notes = [], []
    for seed, (t, b) in pairs.items():
        t_rows, t_notes = load_metrics(t.path / "metrics.jsonl")
        b_rows, b_notes = load_metrics(b.path / "metrics.jsonl")
        notes += [f"activity check: {n}" for n in t_notes + b_notes if "not found" not in n]
        if not t_rows or not b_rows:
            notes.append(f"seed {seed}: no training metrics in {t.arm} or {b.arm}: whether the switch acted is "
                         "unknown (not called inert)")
            per_seed.append({"seed": seed, "updates": 0, "identical_training_rows": None,
                             "max_rule_fraction": None, "rule_fractions_all_zero": None})
            continue
        rule_key = _rule_fraction_keys((t.loss, b.loss))
        fracs = {k: max(float(r[k]) for r in t_rows + b_rows if isinstance(r.get(k), (int, float)))
                 for k in {k for r in t_rows + b_rows for k in r if rule_key.match(k)}}
        identical = len(t_rows) == len(b_rows) and all(_training_part(x) == _training_part(y)
                                                       for x, y in zip(t_rows, b_rows))
        per_seed.append({"seed": seed, "updates": len(t_rows), "identical_training_rows": identical,
                         "max_rule_fraction": fracs, "rule_fractions_all_zero": bool(fracs) and not any(fracs.values())})
    # "no rule fired" means "the same gradients" only for a pair of losses whose unclipped gradients are equal
    losses = {x for t, b in pairs.values() for x in (t.loss, b.loss)}
    rules_path = loss_switch and losses <= SAME_UNCLIPPED_GRADIENT
    inert = bool(per_seed) and all(x["identical_training_rows"] or (rules_path and x["rule_fractions_all_zero"])
                                   for x in per_seed)
    return {"inert": inert, "per_seed": per_seed, "rule_fractions_count": rules_path}, notes


def _training_part(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items()
            if (k in ("step", "update") or k.startswith(_TRAINING_FAMILIES)) and k not in _OBJECTIVE_KEYS}
