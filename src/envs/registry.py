"""`build_task(env_cfg, renderer)`: the task named by `env_cfg.name`, built from the other fields."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from tinker_cookbook import renderers

from envs.types import Task

TaskBuilder = Callable[..., Task]
_TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str, builder: TaskBuilder) -> None:
    """Make `builder(renderer, **fields)` available as env name `name`."""
    _TASKS[name] = builder


def available_tasks() -> list[str]:
    _register_builtin()
    return sorted(_TASKS)


def _register_builtin() -> None:
    # imported lazily: the gsm8k module pulls in `datasets` through the cookbook's math_env
    if "gsm8k" not in _TASKS:
        from envs.gsm8k import GSM8KTask

        register_task("gsm8k", GSM8KTask)
    if "arithmetic" not in _TASKS:
        from envs.arithmetic import ArithmeticTask

        register_task("arithmetic", ArithmeticTask)


def _accepted_keys(builder: TaskBuilder) -> set[str] | None:
    params = inspect.signature(builder).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_task(env_cfg: Any, renderer: renderers.Renderer) -> Task:
    """The task `env_cfg.name` built with the remaining env fields as keyword arguments. `env_cfg`: the env
    group's typed config (`trainer.config.schema.GSM8KEnvConfig`, ...), or a mapping (a DictConfig
    included) for a task registered without a schema."""
    if dataclasses.is_dataclass(env_cfg) and not isinstance(env_cfg, type):
        fields = {f.name: getattr(env_cfg, f.name) for f in dataclasses.fields(env_cfg)}
    elif isinstance(env_cfg, Mapping):
        fields = dict(env_cfg)  # a DictConfig's interpolations are resolved as they are read
    else:
        raise TypeError(f"env config must be a dataclass or a mapping, got {type(env_cfg).__name__}")
    name = fields.pop("name", None)
    if name is None:
        raise ValueError("env config has no 'name'")
    _register_builtin()
    if name not in _TASKS:
        raise ValueError(f"unknown env name {name!r}; available: {sorted(_TASKS)}")
    builder = _TASKS[name]
    accepted = _accepted_keys(builder)
    if accepted is not None:
        unknown = sorted(set(fields) - accepted)
        if unknown:
            raise ValueError(f"env {name!r} does not take field(s) {unknown}; accepted: {sorted(accepted)}")
    return builder(renderer, **fields)
