"""The one loss selector: the config's `_target_` names the plugin class, which is built from the typed config.

`hydra.utils.instantiate(cfg.loss)` reaches the same class through the same `_target_` (passing the
fields as keywords, which the plugin turns into the same typed config); `build_loss` also takes the
typed object that `trainer.config.schema.validate` returns, and checks that the target is a loss plugin.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

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


def build_loss(config: LossCommonConfig | DictConfig) -> PolicyLoss:
    """The loss plugin `config` selects, built from it. `config` is a loss config dataclass or the
    composed `cfg.loss` node (converted to its dataclass first, which runs the range checks)."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_object(config)  # type: ignore[assignment]
    if not isinstance(config, LossCommonConfig):
        raise TypeError(f"build_loss: expected a loss config dataclass or DictConfig, got {type(config).__name__}")
    cls = loss_class(config._target_)  # type: ignore[attr-defined]
    if not isinstance(config, cls.config_class):
        target = config._target_  # type: ignore[attr-defined]
        raise ValueError(  # noqa: TRY004 - a bad config value: the target does not match the group's schema
            f"loss._target_ {target!r} takes a {cls.config_class.__name__}, not a {type(config).__name__}")
    return cls(config)
