"""The one loss selector: the config's `_target_` names the plugin class, which is built from the typed config.

`hydra.utils.instantiate(cfg.loss)` reaches the same class through the same `_target_` (passing the
fields as keywords, which the plugin turns into the same typed config); `build_loss` takes the typed
loss group of the Config that `trainer.config.schema.validate` returns, and checks that the target is
a loss plugin.
"""

from __future__ import annotations

from trainer.config.losses import LossCommonConfig
from trainer.losses.base import PolicyLoss


def loss_class(target: str) -> type[PolicyLoss]:
    """The plugin class a `_target_` string names; ValueError when it names something else."""
    from hydra.utils import get_class

    try:
        cls = get_class(target)
    except Exception as e:  # noqa: BLE001 - Hydra raises ImportError or ValueError; both mean a bad target
        raise ValueError(f"loss._target_ {target!r} is not an importable class ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, PolicyLoss)):
        raise ValueError(  # noqa: TRY004 - a bad config value, like an unimportable target
            f"loss._target_ {target!r} is not a loss plugin (a trainer.losses.base.PolicyLoss)")
    return cls


def build_loss(config: LossCommonConfig) -> PolicyLoss:
    """The loss plugin `config` (a loss config dataclass: a Config's `loss`) selects, built from it."""
    if not isinstance(config, LossCommonConfig):
        raise TypeError(f"build_loss: expected a loss config dataclass, got {type(config).__name__}")
    cls = loss_class(config._target_)
    if not isinstance(config, cls.config_class):
        target = config._target_
        raise ValueError(  # noqa: TRY004 - a bad config value: the target does not match the group's schema
            f"loss._target_ {target!r} takes a {cls.config_class.__name__}, not a {type(config).__name__}")
    return cls(config)
