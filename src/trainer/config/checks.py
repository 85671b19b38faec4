"""Range checks of the config dataclasses: each failure is a ConfigError whose message names the key."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A config value is out of range or inconsistent; the message names the key."""


def require(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key} {msg}, got {value!r}")


def positive_int(key: str, value: int) -> None:
    require(isinstance(value, int) and value >= 1, key, "must be an integer >= 1", value)


def nonneg_int(key: str, value: int) -> None:
    require(isinstance(value, int) and value >= 0, key, "must be an integer >= 0", value)


def in_set(key: str, value: Any, allowed: tuple) -> None:
    require(value in allowed, key, f"must be one of {list(allowed)}", value)


def number(key: str, value: Any) -> None:
    """A real number (int or float, not bool; inf allowed, NaN not): Hydra checks the type of a composed
    value, this catches what Python callers pass to a dataclass directly."""
    require(not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value), key,
            "must be a number", value)
