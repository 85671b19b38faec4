"""Loss registry: the `loss` config group selects a plugin class by name.

`register_loss("grpo")` decorates a loss class; `get_loss_class("grpo")` returns it.
Hydra configs may also name the class directly through `_target_`; the registry is the
name-based view of the same classes (used by CLIs, tests and the preflight gates).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

LOSSES: dict[str, type] = {}

_T = TypeVar("_T", bound=type)


def register_loss(name: str) -> Callable[[_T], _T]:
    """Class decorator registering a loss plugin under `name` (unique, non-empty)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_loss: name must be a non-empty string, got {name!r}")

    def decorator(cls: _T) -> _T:
        existing = LOSSES.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"register_loss: name {name!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        LOSSES[name] = cls
        return cls

    return decorator


def get_loss_class(name: str) -> type:
    """The loss class registered under `name`; ValueError listing the known names otherwise."""
    # Importing the package registers the built-in losses.
    import trainer.losses  # noqa: F401

    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; registered losses: {sorted(LOSSES)}") from None
