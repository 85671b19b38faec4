"""Loss plugins: registry, aggregation, GRPO and DPPO, diagnostics, tinker adapters and the two loss paths.

`hydra.utils.instantiate(cfg.loss)` returns a callable
`loss(logp, sampler_logp, advantages, mask, anchor_logp=None, ref_logp=None) -> (scalar, metrics)`;
see docs/architecture.md.
"""

from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.aggregate import AGGREGATIONS, aggregate
from trainer.losses.base import PolicyLoss
from trainer.losses.cispo import CISPOLoss
from trainer.losses.dppo import DPPOLoss
from trainer.losses.grpo import GRPOLoss
from trainer.losses.gspo import GSPOLoss
from trainer.losses.importance_sampling import ImportanceSamplingLoss
from trainer.losses.paths import LossPath, OnePassLossPath, TwoPassLossPath
from trainer.losses.per_datum import make_per_datum_fn
from trainer.losses.registry import LOSSES, get_loss_class, register_loss

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "CISPOLoss",
    "DPPOLoss",
    "GRPOLoss",
    "GSPOLoss",
    "ImportanceSamplingLoss",
    "LossPath",
    "OnePassLossPath",
    "PolicyLoss",
    "TwoPassLossPath",
    "aggregate",
    "get_loss_class",
    "make_custom_loss_fn",
    "make_per_datum_fn",
    "register_loss",
]
