"""One-pass form of a loss plugin for tinker's `ServiceClient.create_custom_loss`.

tinker 0.38, tinker/lib/public_interfaces/custom_loss.py (`trace_loss`, `_inputs`,
`_check_graph`, `run_loss_handle`): the function runs once per datum and the losses are
summed; it takes `logprobs` (the datum's current target logprobs) first, then one
parameter per `loss_fn_inputs` key it reads; it is traced with torch.fx, so no Python
branching on tensor values, no `.item()`, no captured tensors, only torch/math calls; it
returns `(scalar, {"custom/<name>:sum|mean": scalar tensor})`.

The first parameter must be called `logprobs`, which is also the key tinker-cookbook uses
for the sampler logprobs; the per-datum function therefore reads the sampler logprobs
from `sampler_logprobs` (see `with_per_datum_inputs`). Because tinker sums per-datum
losses, only `aggregation="sum"` can be expressed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer.losses.adapter import ADVANTAGES_KEY, MASK_KEY, SAMPLER_LOGPROBS_KEY, default_mask

PER_DATUM_SAMPLER_KEY = "sampler_logprobs"
PER_DATUM_INPUT_RANKS: dict[str, int] = {
    "logprobs": 1,
    PER_DATUM_SAMPLER_KEY: 1,
    ADVANTAGES_KEY: 1,
    MASK_KEY: 1,
}

# Per-datum metric sums (tinker metric-key rule custom/<name>:sum) and how
# `finalize_per_datum_metrics` turns them into the shared diagnostic keys.
_COUNT_KEYS = {
    "n_tokens": "custom/loss/n_tokens:sum",
    "dppo_masked": "custom/loss/dppo_masked:sum",
    "nonzero_adv": "custom/loss/nonzero_adv_tokens:sum",
    "dppo_masked_nonzero_adv": "custom/loss/dppo_masked_nonzero_adv:sum",
    "grpo_clipped": "custom/loss/grpo_clipped:sum",
    "ratio_sum": "custom/ratio/sum:sum",
    "cap_hits": "custom/ratio/cap_hits:sum",
    "kl_k3_sum": "custom/drift/kl_k3:sum",
}


@dataclass(frozen=True)
class PerDatumLoss:
    """`fn(logprobs, sampler_logprobs, advantages, mask) -> (loss, metrics)` and its ranks."""

    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    input_ranks: Mapping[str, int]


def make_per_datum_fn(loss: Any) -> PerDatumLoss:
    """Build the traceable per-datum function of a `PolicyLoss` (aggregation must be "sum").

    Summed over datums it equals the padded batch loss in value and gradient. Its metrics
    are counts / sums (see `finalize_per_datum_metrics`); quantiles and maxima cannot be
    combined by tinker's sum/mean rule and are left to `loss.diagnostics` on the returned
    logprobs.
    """
    if getattr(loss, "aggregation", None) != "sum":
        raise ValueError(
            f"per-datum loss needs aggregation='sum' (tinker sums per-datum losses), "
            f"got aggregation={getattr(loss, 'aggregation', None)!r}; use the two-pass "
            "make_custom_loss_fn path for other aggregations"
        )
    is_cap = float(loss.is_cap)

    def per_datum_loss(logprobs, sampler_logprobs, advantages, mask):
        sel = mask > 0
        token_loss = loss.token_loss(logprobs, sampler_logprobs, advantages)
        value = torch.where(sel, token_loss, torch.zeros_like(token_loss)).sum()

        drop, clip = loss.trust_region_masks(logprobs, sampler_logprobs, advantages)
        log_ratio = logprobs.detach() - sampler_logprobs
        ratio = torch.exp(log_ratio)
        zeros = torch.zeros_like(ratio)
        nonzero = sel & (advantages != 0)
        metrics = {
            _COUNT_KEYS["n_tokens"]: sel.float().sum(),
            _COUNT_KEYS["dppo_masked"]: (sel & drop).float().sum(),
            _COUNT_KEYS["nonzero_adv"]: nonzero.float().sum(),
            _COUNT_KEYS["dppo_masked_nonzero_adv"]: (nonzero & drop).float().sum(),
            _COUNT_KEYS["grpo_clipped"]: (sel & clip).float().sum(),
            _COUNT_KEYS["ratio_sum"]: torch.where(sel, ratio, zeros).sum(),
            _COUNT_KEYS["cap_hits"]: (sel & (ratio > is_cap)).float().sum(),
            _COUNT_KEYS["kl_k3_sum"]: torch.where(sel, ratio - 1.0 - log_ratio, zeros).sum(),
        }
        return value, metrics

    per_datum_loss.__name__ = f"{loss.name}_per_datum"
    return PerDatumLoss(fn=per_datum_loss, input_ranks=dict(PER_DATUM_INPUT_RANKS))


def finalize_per_datum_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Turn summed per-datum metrics into the shared diagnostic keys derivable from sums.

    Returns loss/n_tokens, loss/dppo_masked_frac, loss/dppo_masked_frac_nonzero_adv,
    loss/grpo_clip_frac, ratio/mean, ratio/cap_hits, drift/kl_sampler_current.
    """
    missing = [k for k in _COUNT_KEYS.values() if k not in metrics]
    if missing:
        raise ValueError(f"finalize_per_datum_metrics: missing metric keys {missing}")
    get = {name: float(metrics[key]) for name, key in _COUNT_KEYS.items()}
    n = get["n_tokens"]
    if n <= 0:
        raise ValueError("finalize_per_datum_metrics: no loss tokens (custom/loss/n_tokens:sum is 0)")
    nz = get["nonzero_adv"]
    return {
        "loss/n_tokens": n,
        "loss/dppo_masked_frac": get["dppo_masked"] / n,
        "loss/dppo_masked_frac_nonzero_adv": get["dppo_masked_nonzero_adv"] / nz if nz else 0.0,
        "loss/grpo_clip_frac": get["grpo_clipped"] / n,
        "ratio/mean": get["ratio_sum"] / n,
        "ratio/cap_hits": get["cap_hits"],
        "drift/kl_sampler_current": get["kl_k3_sum"] / n,
    }


def with_per_datum_inputs(datum: Any) -> Any:
    """Copy of a tinker `Datum` with the keys the per-datum function reads.

    Adds `sampler_logprobs` (= its `logprobs`) and, when absent, `mask` by the same rule
    as `make_custom_loss_fn` (advantages != 0 or logprobs != 0).
    """
    from tinker import types

    inputs = dict(datum.loss_fn_inputs)
    for key in (SAMPLER_LOGPROBS_KEY, ADVANTAGES_KEY):
        if key not in inputs:
            raise ValueError(f"with_per_datum_inputs: datum has no loss_fn_inputs[{key!r}]")
    sampler_T = inputs[SAMPLER_LOGPROBS_KEY].to_torch().to(torch.float32)
    inputs[PER_DATUM_SAMPLER_KEY] = types.TensorData.from_torch(sampler_T)
    if MASK_KEY not in inputs:
        adv_T = inputs[ADVANTAGES_KEY].to_torch().to(torch.float32)
        inputs[MASK_KEY] = types.TensorData.from_torch(default_mask(sampler_T, adv_T))
    return dataclasses.replace(datum, loss_fn_inputs=inputs)
