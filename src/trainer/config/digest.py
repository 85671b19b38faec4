"""The config digest that resume checks, preflight records and eval.compare's plan matching share.

Kept free of torch so that `eval.compare` (which must start fast and run without the engine) computes
the same digest as the trainer and the preflight gates.
"""

from __future__ import annotations

import hashlib
import json

from trainer.config.ignored_keys import RESUME_IGNORED_KEYS


def config_hash(cfg_dict: dict, ignored: tuple[str, ...] = RESUME_IGNORED_KEYS) -> str:
    """16 hex digits of the config's sorted JSON without the `ignored` (dotted) keys."""
    d = json.loads(json.dumps(cfg_dict, default=str))
    for key in ignored:
        node = d
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def decision_hash(decision: dict | None) -> str:
    """16 hex digits of a run's `decision` block: train.py records it in run_info.json (`decision_sha256`),
    and eval.compare refuses runs whose config.yaml holds another block than the one they trained under."""
    return config_hash({"decision": decision or {}}, ())
