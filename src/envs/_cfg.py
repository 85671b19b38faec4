"""Read config fields from a mapping, a dataclass, an OmegaConf node or any attribute object."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

_REQUIRED = object()


def cfg_get(cfg: Any, key: str, default: Any = _REQUIRED, *, where: str = "config") -> Any:
    """`cfg[key]` or `cfg.key`; `default` when absent, else a ValueError naming the key."""
    if isinstance(cfg, Mapping):
        if key in cfg:
            return cfg[key]
    elif hasattr(cfg, key):
        return getattr(cfg, key)
    if default is _REQUIRED:
        raise ValueError(f"{where} has no field {key!r}")
    return default


def cfg_to_dict(cfg: Any, *, where: str = "config") -> dict[str, Any]:
    """A plain dict of the config's fields (OmegaConf nodes are resolved)."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # omegaconf is optional for this package
        pass
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    raise TypeError(f"{where} must be a mapping, a dataclass or a DictConfig, got {type(cfg).__name__}")
