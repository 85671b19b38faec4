"""The typed objects of one comparison, from the request to compare.json.

A `CompareRequest` holds what a caller asks for (the command line's options, or `eval.compare.compare`'s
keywords). A source reads the inputs into `Arms`: scores per arm x seed x item over one item order, with
each row's label, the items' hash and the source's notes (eval.comparison for training runs, eval.items for
per-item files). `eval.comparison.decide` turns Arms and the `Rule` into one `TreatmentResult` per
treatment, each with its `Decision` (the rule's numbers and the verdict word); the source adds what only it
knows (the switch's activity, the A/A calibration, the eval curve) and assembles a `Comparison`, whose
`to_json()` is compare.json and which eval.report renders as compare.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eval.methods import ESTIMANDS, METHOD_SCOPE, RULE_TEXT
from eval.stats import SCOPE_TEXT

#: the bootstrap's resamples and RNG seed are part of the rule when the bootstrap decides (its verdict on a
#: borderline sweep depends on them): other values are an override
DEFAULT_BOOTSTRAP, DEFAULT_BOOTSTRAP_SEED = 10000, 0


@dataclass
class CompareRequest:
    """What the caller asks of a comparison. The rule options (method ... threshold, baseline) must equal the
    pre-registered rule unless override_decision; None leaves the rule's own value."""

    treatment: str | list[str] | None = None  # the treatment arm(s), comma-separated or a list (runs only)
    baseline: str | None = None
    method: str | None = None
    alpha: float | None = None  # in (0, 1)
    margin: float | None = None
    equivalence_margin: float | None = None
    endpoint: str | None = None  # trainer.config.enums.ENDPOINTS (runs only)
    step: int | None = None  # eval step of endpoint `step` (runs only)
    threshold: float | None = None  # the steps-to-threshold accuracy, reported only (runs only)
    override_decision: bool = False
    # >= 0; 0 = off; None: the bootstrap runs only where it is the rule (at DEFAULT_BOOTSTRAP resamples), the
    # descriptive ones are skipped (issue #51: 98% of a 10-arm --items comparison went to bootstraps that
    # decide nothing); a number runs every bootstrap at that many resamples
    n_bootstrap: int | None = None
    seed: int = DEFAULT_BOOTSTRAP_SEED  # the bootstrap's RNG seed
    aa: str | Path | None = None  # an A/A sweep calibrating the A/B gap (runs only)
    eval_name: str | None = None  # eval/<NAME>.jsonl (runs only; default: the runs' eval.name)
    allow_config_diff: bool = False  # runs only
    allow_mixed_loss_paths: bool = False  # runs only
    make_plots: bool = True  # runs only (per-item files have no training curves)
    out: str | Path | None = None  # output folder (default: the sweep / the runs' or files' common parent)
    fmt: str | None = None  # per-item files' format (default: detected; items only)
    metric: str | None = None  # per-item metric (default: the format's primary one; items only)
    plan: str | None = None  # a YAML of the decision block's keys (items only)

    @property
    def resamples(self) -> int:
        """The bootstrap's resamples wherever it runs."""
        return DEFAULT_BOOTSTRAP if self.n_bootstrap is None else self.n_bootstrap

    def treatments(self) -> list[str]:
        t = self.treatment
        return [x for x in t.split(",") if x] if isinstance(t, str) else list(t or [])

    def rule_options(self, *keys: str) -> dict[str, Any]:
        """The rule keys the caller set, for eval.comparison.resolve_rule (None: the plan's own value)."""
        return {k: getattr(self, k) for k in keys}


RUN_RULE_KEYS = ("method", "alpha", "margin", "endpoint", "step", "threshold", "baseline",
                 "equivalence_margin")
ITEMS_RULE_KEYS = ("method", "alpha", "margin", "baseline", "equivalence_margin")


@dataclass
class Rule:
    """The decision rule compare applies: the runs' `decision` config, with any --override-decision change."""

    method: str
    alpha: float
    margin: float
    endpoint: str
    step: int | None
    threshold: float | None
    baseline: str
    source: str  # "config" | "default (runs predate decision config)" | a plan file | the command line
    overridden: list[str] = field(default_factory=list)  # "key: config value -> used value"
    requested: str = ""  # decision.method as written (`auto` resolves by the seeds per arm)
    resolution: str = ""  # how `method` was chosen
    equivalence_margin: float | None = None  # `equivalent` when the rule's interval lies inside +-this
    looks: list[int] | None = None  # seeds per arm at which compare may decide (eval.sequential)
    target_effect: float | None = None  # the gain the plan means to detect (the power note's effect)

    @property
    def scope(self) -> str:
        return METHOD_SCOPE[self.method]

    @property
    def pre_registered(self) -> bool:
        return self.source == "config" or self.source.startswith("pre-registered")

    def text(self) -> str:
        where = {"final": "final accuracy", "step": f"accuracy at step {self.step}",
                 "auc": "area under the eval curve (per item)"}[self.endpoint]
        return (RULE_TEXT[self.method].format(conf=100 * (1 - self.alpha), alpha=self.alpha)
                + f", endpoint {where}, margin {self.margin:g}"
                + (f", equivalence margin {self.equivalence_margin:g}" if self.equivalence_margin else "")
                + (f", looks at {self.looks} seeds per arm (O'Brien-Fleming-like alpha spending)"
                   if self.looks else ""))

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "requested": self.requested, "resolution": self.resolution,
                "alpha": self.alpha, "margin": self.margin, "endpoint": self.endpoint,
                "step": self.step, "threshold": self.threshold, "baseline": self.baseline,
                "source": self.source,
                "overridden": self.overridden, "text": self.text(), "estimand": ESTIMANDS[self.method],
                "scope": self.scope, "equivalence_margin": self.equivalence_margin, "looks": self.looks,
                "bootstrap_resamples": DEFAULT_BOOTSTRAP, "bootstrap_seed": DEFAULT_BOOTSTRAP_SEED}


@dataclass
class Arms:
    """What a source read: `scores_SN[arm]` holds one row per seed (in `seeds` order) over `item_order`,
    `labels[arm]` each row's run label. `categories` gives each item's category (an lm-eval task) where the
    source has them."""

    baseline: str
    treatments: list[str]
    scores_SN: dict[str, np.ndarray]
    labels: dict[str, list[str]]
    seeds: list[int]
    item_order: list[str]
    item_sha256: str
    notes: list[str] = field(default_factory=list)
    categories: list[str] | None = None

    @property
    def n_items(self) -> int:
        return len(self.item_order)


#: compare.json keys of a paired difference's interval bounds (rows, methods, per-seed and seed-level parts)
BOUND_KEYS = frozenset({"ci_low", "ci_high", "hoeffding_ci_low", "hoeffding_ci_high", "t_ci_low", "t_ci_high",
                        "bootstrap_low", "bootstrap_high", "two_level_low", "two_level_high"})


def clip_to_score_range(obj: Any) -> bool:
    """Cut every interval bound of a difference of two [0, 1] scores to [-1, 1] in place (Hoeffding at few
    items and t at two seeds reach beyond it); True when any bound moved. The verdicts were decided before,
    and no verdict depends on a bound beyond +-1 (the margins are below 1)."""
    moved = False
    if isinstance(obj, (Decision, TreatmentResult)):
        return obj.clip()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in BOUND_KEYS and isinstance(v, float) and abs(v) > 1.0:
                obj[k], moved = max(-1.0, min(1.0, v)), True
            elif (k == "rule_ci" and isinstance(v, list)
                  and any(isinstance(x, float) and abs(x) > 1 for x in v)):
                obj[k], moved = [max(-1.0, min(1.0, x)) for x in v], True
            else:
                moved |= clip_to_score_range(v)
    elif isinstance(obj, list):
        for v in obj:
            moved |= clip_to_score_range(v)
    return moved


@dataclass
class Decision:
    """The rule's numbers on one treatment and the verdict: its estimate, its interval at the treatment's
    Holm level (None for the exact tests), its own p and the Holm-adjusted one, and the verdict in every form
    compare shows it (the word, the scope, the scope in words, the headline)."""

    method: str
    estimate: float
    p_rule: float
    p_holm: float
    holm_level: float
    rule_ci: list[float] | None
    p_adjusted: str | None  # "holm" with several treatments
    verdict: str = ""
    verdict_scope: str = ""
    headline: str = ""

    @property
    def ci_low(self) -> float | None:
        return self.rule_ci[0] if self.rule_ci else None

    @property
    def ci_high(self) -> float | None:
        return self.rule_ci[1] if self.rule_ci else None

    @property
    def p(self) -> float:
        """The p compare reports beside the verdict: Holm-adjusted (the rule's own when K = 1)."""
        return self.p_holm

    @property
    def verdict_about(self) -> str:
        return SCOPE_TEXT[self.verdict_scope]

    def clip(self) -> bool:
        if self.rule_ci and any(abs(x) > 1 for x in self.rule_ci):
            self.rule_ci = [max(-1.0, min(1.0, x)) for x in self.rule_ci]
            return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {"p_rule": self.p_rule, "p_holm": self.p_holm, "holm_level": self.holm_level,
                "rule_ci": self.rule_ci, "method": self.method, "estimate": self.estimate,
                "ci_low": self.ci_low, "ci_high": self.ci_high, "p": self.p, "p_adjusted": self.p_adjusted,
                "verdict": self.verdict, "verdict_scope": self.verdict_scope,
                "verdict_about": self.verdict_about, "headline": self.headline}


#: one entry of compare.json's `verdicts`: what the verdict is about, and the rule's numbers behind it
VERDICT_KEYS = ("treatment", "baseline", "verdict", "verdict_scope", "verdict_about", "headline", "method",
                "estimate", "ci_low", "ci_high", "p", "holm_level")


@dataclass
class TreatmentResult:
    """One treatment against the baseline: the item-level numbers (paired_compare's, the Hoeffding ones
    under hoeffding_* names), each seed pair's row, every method's table entry, the effect sizes, and the
    rule's Decision; a training-runs source adds the switch's activity and the A/A calibration."""

    treatment: str
    baseline: str
    item: dict[str, Any]  # eval.comparison.item_level: n, n_items, n_seeds, diff, b, c, ..., seed_level
    per_seed: list[dict[str, Any]]
    methods: dict[str, dict[str, Any]]
    effect_sizes: dict[str, Any]
    decision: Decision
    bootstrap_resamples: int = DEFAULT_BOOTSTRAP
    bootstrap_seed: int = DEFAULT_BOOTSTRAP_SEED
    bootstrap_skipped: list[str] = field(default_factory=list)  # descriptive bootstraps not run
    activity: dict[str, Any] | None = None
    aa_calibration: dict[str, Any] | None = None
    sample: Any = field(default=None, repr=False, compare=False)  # eval.methods.Sample the rule read

    @property
    def verdict(self) -> str:
        return self.decision.verdict

    @property
    def inert(self) -> bool:
        return bool(self.activity and self.activity.get("inert"))

    @property
    def seed_level(self) -> dict[str, Any] | None:
        return self.item.get("seed_level")

    def clip(self) -> bool:
        moved = self.decision.clip()
        for part in (self.item, self.per_seed, self.methods, self.effect_sizes):
            moved |= clip_to_score_range(part)
        return moved

    def to_json(self) -> dict[str, Any]:
        out = {"treatment": self.treatment, "baseline": self.baseline, **self.item, "per_seed": self.per_seed,
               "methods": self.methods, "bootstrap_resamples": int(self.bootstrap_resamples),
               "bootstrap_seed": int(self.bootstrap_seed), "effect_sizes": self.effect_sizes,
               **self.decision.to_json()}
        if self.bootstrap_skipped:
            out["bootstrap_skipped"] = self.bootstrap_skipped
        if self.aa_calibration is not None:
            out["aa_calibration"] = self.aa_calibration
        if self.activity is not None:
            out["activity"] = self.activity
        return out

    def verdict_entry(self) -> dict[str, Any]:
        j = {"treatment": self.treatment, "baseline": self.baseline, **self.decision.to_json()}
        return {k: j[k] for k in VERDICT_KEYS}


@dataclass
class Comparison:
    """One comparison's result: `mode` "ab" (rows, one per treatment) or "aa" (the between-seed spread of
    one arm), from `source` "runs" (training runs) or "items" (per-item files). `to_json()` is compare.json,
    key for key."""

    mode: str
    source: str
    rule: Rule
    arms: Arms
    rows: list[TreatmentResult]
    arm_rows: list[dict[str, Any]]  # one per run or file: accuracy, Wilson interval, where it was read
    notes: list[str]
    inputs: list[str]
    output_dir: Path
    eval_name: str | None
    switch: str | None = None  # what the arms differ in (runs: `loss` or a config key; items: `arm`)
    look: dict[str, Any] | None = None  # this comparison's place among decision.looks (eval.comparison)
    scope_settings: dict[str, Any] | None = None
    curve: dict[str, Any] | None = None
    aa: dict[str, Any] | None = None  # the A/A spread (mode aa), or the --aa sweep's (mode ab)
    config_diff: list[str] = field(default_factory=list)
    ignored_config_keys: list[str] = field(default_factory=list)
    categories: dict[str, Any] | None = None  # per-item files: per-category secondary results
    fmt: str | None = None  # per-item files' format and metric
    metric: str | None = None
    plots: dict[str, str] = field(default_factory=dict)
    looks: list[dict[str, Any]] | None = None  # earlier decisions of this comparison (eval.comparison)
    decisions: dict[str, Any] | None = None
    looks_ledger: str | None = None

    @property
    def baseline(self) -> str:
        return self.arms.baseline

    @property
    def treatments(self) -> list[str]:
        return self.arms.treatments

    @property
    def seeds(self) -> list[int]:
        return self.arms.seeds

    @property
    def n_seeds(self) -> int:
        return len(self.arms.seeds)

    @property
    def n_items(self) -> int:
        return self.arms.n_items

    @property
    def verdict_scope(self) -> str:
        return "across_seeds" if self.mode == "aa" else self.rule.scope

    def verdicts(self) -> list[dict[str, Any]]:
        return [r.verdict_entry() for r in self.rows]

    def to_json(self) -> dict[str, Any]:
        rule = self.rule
        out: dict[str, Any] = {
            "mode": self.mode, "treatments": list(self.treatments), "baseline": self.baseline,
            "eval_name": self.eval_name, "verdict_scope": self.verdict_scope, "n_seeds": self.n_seeds,
            "seeds": list(self.seeds), "decision": rule.to_json(), "aa": self.aa, "arms": self.arm_rows,
            "config_diff": self.config_diff, "ignored_config_keys": list(self.ignored_config_keys),
            "item_set_sha256": self.arms.item_sha256, "inputs": self.inputs,
            "output_dir": str(self.output_dir),
            "plots": self.plots, "notes": self.notes, "alpha": rule.alpha, "method": rule.method,
            "decision_rule": rule.text()}
        if self.source == "items":
            out.update(source="items", format=self.fmt, metric=self.metric, n_items=self.n_items)
        if self.mode == "aa":
            out.update(verdict=None)
            if self.source == "runs":
                out.update(n_items=self.n_items)
            return out
        out.update(switch=self.switch, verdict_about=SCOPE_TEXT[rule.scope],
                   comparisons=[r.to_json() for r in self.rows], verdicts=self.verdicts(), curve=self.curve)
        if self.source == "runs":
            out.update(look=self.look, scope_settings=self.scope_settings)
        else:
            out.update(categories=self.categories)
        if self.looks is not None:
            out.update(looks=self.looks, decisions=self.decisions)
        if self.looks_ledger is not None:
            out["looks_ledger"] = self.looks_ledger
        # one treatment: its numbers (the rule's estimate, interval, p, verdict) at the top level
        if len(self.rows) == 1:
            row = self.rows[0].to_json()
            out.update({k: v for k, v in row.items() if k not in out or k in ("verdict", "method")},
                       treatment=self.treatments[0])
        return out
