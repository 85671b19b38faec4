"""One typed config per loss plugin: every setting's default and bounds, stated once.

The plugin classes (trainer/losses/*.py) are built from these objects (`GRPOLoss(GRPOLossConfig(...))`,
or `GRPOLoss(clip_eps=0.3)`, which builds the config first), and Hydra composes `conf/loss/<name>.yaml`
against the same dataclasses, so a default changes here and nowhere else and the same `__post_init__`
rejects a bad value from the command line and from Python. `_target_` is the one selector of the loss
class (`trainer.losses.build_loss`). Bounds in the dataclass follow prime-rl's one model per loss
(PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/config.py, `DefaultLossConfig` with `Field(ge=...)`).
Torch-free, like the whole config package.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from trainer.config.checks import ConfigError, in_set, number, require
from trainer.config.enums import AGGREGATIONS, ANCHORS, DPPO_DEFAULT_DELTA, DPPO_MODES, NEEDS_NORM_LENGTH


@dataclass
class LossCommonConfig:
    """Settings every loss plugin takes (each loss's dataclass adds its own after these)."""

    if TYPE_CHECKING:
        # every loss's dataclass states these two as its own fields (checked by `_check_name` and
        # `build_loss`); declared here for the type only, not as fields, so that a loss group keeps its key
        # order in config.yaml (the common settings first, as runs already written have it)
        _target_: str
        name: str

    # token-loss aggregation: sum (Tinker) | token_mean | seq_mean_token_sum | seq_mean_token_mean |
    # seq_mean_token_sum_norm (Dr. GRPO: per-sequence sums / (#sequences * norm_length))
    aggregation: str = "sum"
    # the constant H of seq_mean_token_sum_norm (the completion budget); ignored by the others
    norm_length: Optional[float] = None
    # trust-region anchor: sampler (the rollout logprobs) | recomputed (trainer logprobs from one extra
    # forward pass before the first update of each step; Stable-RL's *_recompute modes)
    anchor: str = "sampler"
    # coefficient of the k3 KL penalty to the initial weights (0 = off, no extra pass)
    kl_coef: float = 0.0

    def _check_numbers(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "float" in str(f.type) and not (value is None and str(f.type).startswith("Optional")):
                number(f.name, value)

    def _check_common(self) -> None:
        in_set("aggregation", self.aggregation, AGGREGATIONS)
        if self.aggregation in NEEDS_NORM_LENGTH:
            require(self.norm_length is not None and self.norm_length > 0, "norm_length",
                    f"must be > 0 for aggregation {self.aggregation}", self.norm_length)
        in_set("anchor", self.anchor, ANCHORS)
        require(0 <= self.kl_coef < math.inf, "kl_coef", "must be a finite number >= 0 (0 = off)", self.kl_coef)

    def _check_name(self, expected: str) -> None:
        require(self.name == expected, "name", f"must be '{expected}' for this schema", self.name)  # type: ignore[attr-defined]


@dataclass
class GRPOLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.grpo.GRPOLoss"
    # name of the loss (the arm's loss label)
    name: str = "grpo"
    # symmetric PPO ratio clip epsilon: r is clipped to [1-eps, 1+eps]
    clip_eps: float = 0.2
    # lower clip epsilon; null = clip_eps
    clip_eps_low: Optional[float] = None
    # upper clip epsilon; null = clip_eps
    clip_eps_high: Optional[float] = None
    # binary-TV delta of the counterfactual DPPO mask logged in this arm (probability units; DPPO's default)
    cf_dppo_delta: float = DPPO_DEFAULT_DELTA["binary_tv"]

    def __post_init__(self) -> None:
        self._check_name("grpo")
        self._check_numbers()
        for key in ("clip_eps", "clip_eps_low", "clip_eps_high"):
            v = getattr(self, key)
            if v is not None:
                require(v > 0, key, "must be > 0 (inf disables the clip)", v)
        self._check_common()
        require(0 < self.cf_dppo_delta <= 1, "cf_dppo_delta", "must be in (0, 1]", self.cf_dppo_delta)


@dataclass
class DPPOLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.dppo.DPPOLoss"
    # name of the loss (the arm's loss label)
    name: str = "dppo"
    # divergence used by the trust-region mask: binary_tv | binary_kl
    mode: str = "binary_tv"
    # trust-region threshold for both directions; null = 0.15 (binary_tv) or 0.05 (binary_kl)
    delta: Optional[float] = None
    # threshold for tokens with A <= 0; null = delta
    delta_low: Optional[float] = None
    # threshold for tokens with A > 0; null = delta
    delta_high: Optional[float] = None
    # truncation cap c of the importance weight min(r, c); 1e4 = the authors' "fair comparison"
    # (verl-project/verl examples/dppo_trainer, PR #5397 @ 182383bbb, run_qwen30b_dppo.sh: clip_ratio_c)
    is_cap: float = 1.0e4
    # epsilon of the counterfactual GRPO clip fraction logged in this arm (GRPO's default)
    cf_grpo_eps: float = GRPOLossConfig.clip_eps

    def __post_init__(self) -> None:
        self._check_name("dppo")
        in_set("mode", self.mode, DPPO_MODES)
        self._check_numbers()
        for key in ("delta", "delta_low", "delta_high"):
            v = getattr(self, key)
            if v is None:
                continue
            if self.mode == "binary_tv":
                # a TV distance between two-point distributions is at most 1
                require((0 < v <= 1) or math.isinf(v), key, "must be in (0, 1] for binary_tv", v)
            else:
                require(v > 0, key, "must be > 0 for binary_kl", v)
        require(self.is_cap >= 1, "is_cap", "must be >= 1", self.is_cap)
        self._check_common()
        require(self.cf_grpo_eps > 0, "cf_grpo_eps", "must be > 0", self.cf_grpo_eps)

    def delta_or_default(self) -> float:
        """`delta`, or the mode's default when it is null."""
        return DPPO_DEFAULT_DELTA[self.mode] if self.delta is None else self.delta


@dataclass
class CPPOLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.cppo.CPPOLoss"
    # name of the loss (the arm's loss label)
    name: str = "cppo"
    # per-token binary-TV threshold delta on Z_t = w_t |p - p_anchor| (probability units); arXiv 2606.10968
    # Table 3: 0.15 for dense models (0.20 for the 30B-A3B MoE), DPPO's binary-TV default
    delta: float = DPPO_DEFAULT_DELTA["binary_tv"]
    # floor of the position weight w_t = w_min + (1 - w_min)(T - t)/(T - 1): 1 at the first loss token of a
    # sequence, w_min at its last (the paper's and UniRL's default 0.8); 1 = no position weighting
    w_min: float = 0.8
    # floor of the per-sequence prefix budget delta_b^seq = clamp(P90(D), delta_b, 2 delta_b) (paper Eq. 22,
    # UniRL's cppo_delta_b 0.02); finite: any delta_b >= 1 never binds (S_{t-1} <= W_{t-1} since D <= 1)
    delta_b: float = 0.02
    # truncation cap c of the importance weight min(r, c), as DPPO's (the reference has none: r <= e^20)
    is_cap: float = DPPOLossConfig.is_cap

    def __post_init__(self) -> None:
        self._check_name("cppo")
        self._check_numbers()
        # a TV distance between two-point distributions is at most 1
        require(0 < self.delta <= 1, "delta", "must be in (0, 1] (a binary-TV threshold)", self.delta)
        require(0 <= self.w_min <= 1, "w_min", "must be in [0, 1]", self.w_min)
        require(0 < self.delta_b < math.inf, "delta_b",
                "must be a finite number > 0 (any value >= 1 turns the prefix budget off)", self.delta_b)
        require(self.is_cap >= 1, "is_cap", "must be >= 1", self.is_cap)
        self._check_common()


@dataclass
class ImportanceSamplingLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.importance_sampling.ImportanceSamplingLoss"
    # name of the loss (the arm's loss label)
    name: str = "importance_sampling"

    def __post_init__(self) -> None:
        self._check_name("importance_sampling")
        self._check_numbers()
        self._check_common()


@dataclass
class CISPOLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.cispo.CISPOLoss"
    # name of the loss (the arm's loss label)
    name: str = "cispo"
    # lower bound of the truncated IS weight clip(r, low, high) (Tinker's key and default; docs
    # /tinker/losses/cispo and tinker-cookbook tutorials/202_loss_functions.py)
    clip_low_threshold: float = 0.0
    # upper bound of the truncated IS weight (Tinker's key and default)
    clip_high_threshold: float = 4.0

    def __post_init__(self) -> None:
        self._check_name("cispo")
        self._check_numbers()
        require(0 <= self.clip_low_threshold <= 1, "clip_low_threshold", "must be in [0, 1]",
                self.clip_low_threshold)
        require(self.clip_high_threshold >= 1, "clip_high_threshold", "must be >= 1 (inf allowed)",
                self.clip_high_threshold)
        self._check_common()


@dataclass
class GSPOLossConfig(LossCommonConfig):
    # hydra.utils.instantiate target of this loss plugin
    _target_: str = "trainer.losses.gspo.GSPOLoss"
    # name of the loss (the arm's loss label)
    name: str = "gspo"
    # lower clip epsilon of the sequence ratio (GSPO paper, arXiv 2507.18071, section 5.1: 3e-4)
    seq_clip_eps_low: float = 3.0e-4
    # upper clip epsilon of the sequence ratio (GSPO paper section 5.1: 4e-4)
    seq_clip_eps_high: float = 4.0e-4

    def __post_init__(self) -> None:
        self._check_name("gspo")
        self._check_numbers()
        for key in ("seq_clip_eps_low", "seq_clip_eps_high"):
            require(getattr(self, key) > 0, key, "must be > 0 (inf disables the clip)", getattr(self, key))
        self._check_common()


@dataclass(frozen=True)
class RuleSpec:
    """One token rule that every arm evaluates and logs as `loss/<name>_frac` (`_adv_pos`, `_adv_neg`):
    its owner's own rule with that arm's settings, a counterfactual in the other arms.

    `mask` names the rule's bool-mask function in `trainer.losses.trust_region`, called as
    `mask(logp, sampler_logp, anchor_logp, advantages, mask, **settings)`; `defaults` are its settings
    (keyword names, prefixed by the owner) at the owner's own defaults, the values the other arms use.
    `per_datum` says whether the one-pass per-datum function counts the rule: False for a rule that sorts
    along the sequence (CPPO's P90), a function a service's table of what uploaded graphs may call can lack;
    the one-pass path then computes its fractions client-side from the returned logprobs
    (`OnePassLossPath.metrics`), so only the arm whose loss needs the sort registers a graph that calls it."""

    name: str
    owner: str
    mask: str
    defaults: tuple[tuple[str, Any], ...]
    per_datum: bool = True


#: Every rule, in the order every arm reports them. The loss fields, diagnostics and per-datum keys,
#: the float64 reference's names and eval.compare's "whose rule is this" all read this table.
RULE_TABLE: tuple[RuleSpec, ...] = (
    RuleSpec("dppo_masked", "dppo", "dppo_rule_mask",
             (("dppo_mode", DPPOLossConfig.mode), ("dppo_delta_low", DPPO_DEFAULT_DELTA[DPPOLossConfig.mode]),
              ("dppo_delta_high", DPPO_DEFAULT_DELTA[DPPOLossConfig.mode]))),
    RuleSpec("grpo_clip", "grpo", "grpo_rule_mask",
             (("grpo_eps_low", GRPOLossConfig.clip_eps), ("grpo_eps_high", GRPOLossConfig.clip_eps))),
    RuleSpec("cispo_clip", "cispo", "cispo_rule_mask",
             (("cispo_low", CISPOLossConfig.clip_low_threshold),
              ("cispo_high", CISPOLossConfig.clip_high_threshold))),
    RuleSpec("gspo_clip", "gspo", "gspo_rule_mask",
             (("gspo_eps_low", GSPOLossConfig.seq_clip_eps_low),
              ("gspo_eps_high", GSPOLossConfig.seq_clip_eps_high))),
    # CPPO's mask and its two causes, which partition it: the per-token threshold (Z_t > delta) and the
    # prefix budget alone (c_t < Z_t <= delta)
    *(RuleSpec(name, "cppo", mask,
               (("cppo_delta", CPPOLossConfig.delta), ("cppo_w_min", CPPOLossConfig.w_min),
                ("cppo_delta_b", CPPOLossConfig.delta_b)), per_datum=False)
      for name, mask in (("cppo_masked", "cppo_rule_mask"), ("cppo_token_masked", "cppo_token_rule_mask"),
                         ("cppo_budget_masked", "cppo_budget_rule_mask"))),
)
RULE_NAMES: tuple[str, ...] = tuple(r.name for r in RULE_TABLE)
#: the rules the one-pass per-datum function counts (RuleSpec.per_datum)
PER_DATUM_RULE_NAMES: tuple[str, ...] = tuple(r.name for r in RULE_TABLE if r.per_datum)
#: every rule setting at its owner's default
RULE_DEFAULTS: dict[str, Any] = {k: v for r in RULE_TABLE for k, v in r.defaults}


def rules_owned_by(losses: Any) -> tuple[str, ...]:
    """The names of the rules the losses `losses` (names) own: an arm's own rule, as against the
    counterfactual ones it also logs."""
    return tuple(r.name for r in RULE_TABLE if r.owner in set(losses))


def own_rule(loss: str) -> str | None:
    """The rule that says whether the loss `loss` acts at all: the first it owns in RULE_TABLE's order
    (CPPO's whole mask, before the two causes that partition it); None for a loss without a token rule."""
    owned = rules_owned_by([loss])
    return owned[0] if owned else None


def rule_label(rule: str) -> str:
    """A rule's name for people: `grpo_clip` -> "GRPO clip", `cppo_masked` -> "CPPO masked"."""
    owner = next(r.owner for r in RULE_TABLE if r.name == rule)
    return f"{owner.upper()} {rule.removeprefix(owner + '_').replace('_', ' ')}"


#: Hydra's schema name of each loss option (conf/loss/<name>.yaml names `<name>_schema` in its defaults)
LOSS_SCHEMAS: dict[str, type[LossCommonConfig]] = {
    "grpo_schema": GRPOLossConfig,
    "dppo_schema": DPPOLossConfig,
    "importance_sampling_schema": ImportanceSamplingLossConfig,
    "cispo_schema": CISPOLossConfig,
    "gspo_schema": GSPOLossConfig,
    "cppo_schema": CPPOLossConfig,
}


def make_loss_config(config_class: type, config: Any = None, fields: dict[str, Any] | None = None,
                     owner: str | None = None) -> Any:
    """`config` (a `config_class` instance, or None for the defaults) with `fields` replaced; the
    dataclass's checks run on the result. A ConfigError names `owner` (the plugin class) and the key."""
    fields = dict(fields or {})
    fields.pop("_target_", None)
    if config is not None and not isinstance(config, config_class):
        raise TypeError(f"{owner or config_class.__name__}: expected a {config_class.__name__}, "
                        f"got {type(config).__name__}")
    try:
        if config is None:
            return config_class(**fields)
        return dataclasses.replace(config, **fields) if fields else config
    except ConfigError as e:
        raise ConfigError(f"{owner or config_class.__name__}: {e}") from None
    except TypeError as e:  # an unknown keyword
        raise TypeError(f"{owner or config_class.__name__}: {e}") from None
