"""`build_task(env_cfg, renderer)`: the Task class named by the env config's `_target_`, built from the
config's other fields, as `trainer.losses.build_loss` builds a loss: `_target_` is the one selector, so
adding an env needs no list to extend here."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from tinker_cookbook import renderers

from envs.types import Task
from trainer.config.schema import EnvCommonConfig, env_schema


def _task_class(target: str) -> type[Task]:
    module, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"env _target_ {target!r} names no importable class: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"env _target_ {target!r} is not an envs.types.Task subclass")
    return cls


def _accepted_keys(cls: type) -> set[str] | None:
    params = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_task(env_cfg: EnvCommonConfig | Mapping[str, Any], renderer: renderers.Renderer) -> Task:
    """The task of `env_cfg` (its `_target_` class) built with the fields other than `_target_` and
    `name` as keyword arguments. `env_cfg`: the env group's typed config (`GSM8KEnvConfig`, ...: a Config's
    `env`), or a plain mapping (tests, bench); a mapping without `_target_` takes the one of the env its
    `name` names (`trainer.config.schema.env_schema`)."""
    if dataclasses.is_dataclass(env_cfg) and not isinstance(env_cfg, type):
        fields = {f.name: getattr(env_cfg, f.name) for f in dataclasses.fields(env_cfg)}
        # and a key a `+env.<key>=...` override added (validate() keeps it as an attribute): refused below
        fields.update({k: v for k, v in vars(env_cfg).items() if k not in fields})
    elif isinstance(env_cfg, Mapping):
        fields = dict(env_cfg)
    else:
        raise TypeError(f"env config must be a dataclass or a mapping, got {type(env_cfg).__name__}")
    name = fields.pop("name", None)
    if name is None:
        raise ValueError("env config has no 'name'")
    target = fields.pop("_target_", None)
    if target is None:
        target = env_schema(name)._target_  # a ConfigError (a ValueError) naming the known envs
    cls = _task_class(target)
    accepted = _accepted_keys(cls)
    if accepted is not None:
        unknown = sorted(set(fields) - accepted)
        if unknown:
            raise ValueError(f"env {name!r} does not take field(s) {unknown}; accepted: {sorted(accepted)}")
    return cls(renderer, **fields)
