"""Per-group advantages from scalar rewards."""

from __future__ import annotations

import numpy as np


def compute_advantages(rewards_G: np.ndarray, mode: str = "group_mean") -> np.ndarray:
    """One advantage per trajectory of a group.

    group_mean: A = R - mean(R), the cookbook's default (tinker_cookbook 0.5.8,
    rl/data_processing.py::compute_advantages, no std normalisation).
    group_zscore: (R - mean) / (std + 1e-6), GRPO's original normalisation.
    none: A = R (plain REINFORCE)."""
    rewards_G = np.asarray(rewards_G, dtype=np.float64)
    if mode == "none":
        return rewards_G.copy()
    centred = rewards_G - rewards_G.mean()
    if mode == "group_mean":
        return centred
    if mode == "group_zscore":
        return centred / (rewards_G.std() + 1e-6)
    raise ValueError(f"advantage: unknown estimator {mode!r} (group_mean | group_zscore | none)")
