"""Rollouts -> tinker Datums carrying target tokens, sampler logprobs, advantages and the loss mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tinker


@dataclass
class Rollout:
    """One sampled completion of one prompt."""

    group: int
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    reward: float
    metrics: dict[str, float]
    stop_reason: str
    advantage: float = 0.0


def rollout_to_datum(r: Rollout) -> tinker.Datum:
    """Right-shifted input / left-shifted targets over prompt + completion.

    Same alignment as tinker_cookbook 0.5.8 rl/data_processing.py::trajectory_to_data for a
    single-turn episode: position i of the input predicts target i; prompt positions get
    logprob 0, advantage 0 and mask 0; completion positions carry the sampler's logprob, the
    trajectory's advantage and mask 1."""
    n_prompt, n_comp = len(r.prompt_tokens), len(r.tokens)
    if n_comp == 0:
        raise ValueError("rollout has no completion tokens")
    if len(r.logprobs) != n_comp:
        raise ValueError(f"rollout has {n_comp} tokens but {len(r.logprobs)} sampler logprobs")
    full = np.asarray(r.prompt_tokens + r.tokens, dtype=np.int64)
    T = full.shape[0] - 1
    logprobs_T = np.zeros(T, dtype=np.float32)
    adv_T = np.zeros(T, dtype=np.float32)
    mask_T = np.zeros(T, dtype=np.float32)
    logprobs_T[n_prompt - 1:] = np.asarray(r.logprobs, dtype=np.float32)
    adv_T[n_prompt - 1:] = r.advantage
    mask_T[n_prompt - 1:] = 1.0
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(full[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(full[1:]),
            "logprobs": tinker.TensorData.from_numpy(logprobs_T),
            "advantages": tinker.TensorData.from_numpy(adv_T),
            "mask": tinker.TensorData.from_numpy(mask_T),
        },
    )


def split_minibatches(items: list, n: int) -> list[list]:
    """Split in order into n nearly equal contiguous chunks (the first ones one longer)."""
    if n < 1 or n > len(items):
        raise ValueError(f"cannot split {len(items)} datums into {n} minibatches")
    q, rem = divmod(len(items), n)
    out, i = [], 0
    for k in range(n):
        size = q + (1 if k < rem else 0)
        out.append(items[i:i + size])
        i += size
    return out
