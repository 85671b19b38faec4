"""Loss plugins: aggregation, GRPO, DPPO, CPPO and the Tinker built-ins' forms, diagnostics, tinker adapters
and the two loss paths.

`build_loss(cfg.loss)` (or `hydra.utils.instantiate(cfg.loss)`: the same `_target_` selects the class)
returns a callable
`loss(logp, sampler_logp, advantages, mask, anchor_logp=None, ref_logp=None) -> (scalar, metrics)`;
see docs/architecture.md.
"""

from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.aggregate import AGGREGATIONS, aggregate
from trainer.losses.base import PolicyLoss
from trainer.losses.build import build_loss, loss_class
from trainer.losses.cispo import CISPOLoss
from trainer.losses.cppo import CPPOLoss
from trainer.losses.dppo import DPPOLoss
from trainer.losses.grpo import GRPOLoss
from trainer.losses.gspo import GSPOLoss
from trainer.losses.importance_sampling import ImportanceSamplingLoss
from trainer.losses.paths import LossPath, OnePassLossPath, TwoPassLossPath
from trainer.losses.per_datum import make_per_datum_fn

__all__ = [
    "AGGREGATIONS",
    "CISPOLoss",
    "CPPOLoss",
    "DPPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "ImportanceSamplingLoss",
    "LossPath",
    "OnePassLossPath",
    "PolicyLoss",
    "TwoPassLossPath",
    "aggregate",
    "build_loss",
    "loss_class",
    "make_custom_loss_fn",
    "make_per_datum_fn",
]
